"""Issue 42, deliverables 6 and 7: what the machine cannot give is said in one line.

- A model config larger than the device it would be built on is refused by its size, naming its file, before
  anything is allocated: in generate, chat, merge_lora, convert (both ways) and the training recipes.
- A disk that fills during a save ends the run (every rank) with exit 1 and one line naming the disk and its free
  space; the unfinished temporary directory is removed.
- A collective that times out because a rank hangs names that rank.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.lora import write_lora_settings
from llmtrain.config import Config
from llmtrain.convert.hf import to_hf
from llmtrain.lora import LoRAArgs
from llmtrain.model import GPT
from llmtrain.tokenizer import train_bpe_tokenizer

import dist_worker
import faults
from conftest import TINY_MODEL, write_tiny_model
from forked_cli import run_forked

HUGE = {"n_layer": 10**9}
LONG = {"block_size": 10**12}
MEMORY_LIMIT = 6 * 2**30
"""Address space each command may take: were the size check missing, a command fails here, not the machine."""


def _with_config(source: Path, target: Path, config_name: str, **fields) -> Path:
    """A copy of the folder ``source`` whose ``config_name`` has ``fields`` changed."""
    shutil.copytree(source, target)
    path = target / config_name
    values = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    values.update(fields)
    path.write_text(json.dumps(values) if path.suffix == ".json" else yaml.safe_dump(values))
    return target


def _make_inputs(root: Path) -> None:
    """A tiny model directory, its transformers copy, a LoRA checkpoint on it, and too-large copies of each."""
    tokenizer = train_bpe_tokenizer(iter([f"w{i} " for i in range(300)] * 2), vocab_size=300, out_dir=root / "tok")
    config = Config(**TINY_MODEL)
    model = GPT(config)
    model.init_weights()
    files.write_model_dir(root / "model", state_dict=model.state_dict(), model_config=config, hyperparameters=None,
                          tokenizer=tokenizer)
    to_hf(root / "model", root / "hf")
    lora = root / "lora"
    lora.mkdir()
    write_lora_settings(lora, LoRAArgs(), root / "model", None)
    config.save(lora / layout.CONFIG_FILE)
    files.save_safetensors({"blocks.0.attn.qkv.lora_A": torch.zeros(8, 64)}, lora / layout.LORA_FILE)
    for name, fields in (("huge", HUGE), ("long", LONG)):
        _with_config(root / "model", root / f"{name}-model", layout.CONFIG_FILE, **fields)
        (root / f"{name}.yaml").write_text(yaml.safe_dump({**TINY_MODEL, **fields}))
    _with_config(root / "hf", root / "huge-hf", "config.json", num_hidden_layers=HUGE["n_layer"])
    _with_config(lora, root / "huge-lora", layout.CONFIG_FILE, **HUGE)


def _pretrain(model_config: str) -> list[str]:
    return ["pretrain", "--model_config", model_config, "--out_dir", "{out}", "--data", "BuiltinStories",
            "--train.max_steps", "1"]


# (name, command line, what its one line names); {in} is the inputs folder, {out} a fresh one.
HUGE_MODEL = ("huge-model/model_config.yaml", "parameters")
CASES = [
    ("generate", ["generate", "{in}/huge-model", "--prompt", "hi", "--raw", "true"], HUGE_MODEL),
    ("generate_block_size", ["generate", "{in}/long-model", "--prompt", "hi", "--raw", "true"],
     ("long-model/model_config.yaml", "block_size 1000000000000")),
    ("chat", ["chat", "{in}/huge-model"], HUGE_MODEL),
    ("merge_lora", ["merge_lora", "{in}/huge-lora", "--out_dir", "{out}"],
     ("huge-lora/model_config.yaml", "parameters")),
    ("convert_to_hf", ["convert", "to_hf", "{in}/huge-model", "{out}"], HUGE_MODEL),
    ("convert_from_hf", ["convert", "from_hf", "{in}/huge-hf", "{out}"], ("huge-hf/config.json", "parameters")),
    ("pretrain", _pretrain("{in}/huge.yaml"), ("--model_config", "parameters")),
    ("pretrain_block_size", _pretrain("{in}/long.yaml"), ("--model_config", "block_size 1000000000000")),
    ("finetune_lora", ["finetune_lora", "{in}/huge-model", "--out_dir", "{out}"], HUGE_MODEL),
    ("finetune_full", ["finetune_full", "{in}/huge-model", "--out_dir", "{out}"], HUGE_MODEL),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    root = tmp_path_factory.mktemp("sizes")
    inputs = root / "in"
    inputs.mkdir()
    _make_inputs(inputs)
    argvs = [[arg.replace("{in}", str(inputs)).replace("{out}", str(root / "out" / name)) for arg in argv]
             for name, argv, _ in CASES]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "LLMTRAIN_CACHE_DIR": str(root / "cache")}
    done = run_forked(argvs, root / "logs", env, timeout_s=300, memory_limit=MEMORY_LIMIT)  # a hang guard
    return {name: (result, root / "out" / name) for (name, _, _), result in zip(CASES, done)}


@pytest.mark.slow  # ten command lines, forked two at a time: about 20 s
@pytest.mark.parametrize("name, names", [(name, names) for name, _, names in CASES], ids=[case[0] for case in CASES])
def test_a_model_too_large_for_the_machine_is_refused_by_its_size(name, names, refused):
    done, out = refused[name]
    message = done.stderr.strip()
    assert done.returncode == 2, message
    assert "Traceback" not in message and message.startswith("error: "), message
    assert len(message.splitlines()) == 2, message  # the line and the --debug hint
    assert all(part in message for part in (*names, "GiB")) and "disk" not in message, message
    assert not out.exists(), f"{name} wrote {out}"


@pytest.mark.parametrize("devices, fits", [(1, False), (64, True)])
def test_training_counts_the_state_one_device_holds_after_sharding(devices, fits):
    """Llama 2 70B's weights, gradients and AdamW state, 1.1 TB, fit an 80 GB GPU only sharded over 64 of them:
    the check refuses one device, not the many that a cluster run spreads the model over."""
    from llmtrain.args import FSDPArgs, TrainArgs
    from llmtrain.distributed.parallel_plan import ParallelPlan
    from llmtrain.memory import ModelTooLargeError
    from llmtrain.args import DryRunArgs
    from llmtrain.plan.search import check_state_fits

    plan = ParallelPlan.resolve(devices=devices, num_nodes=1, precision="bf16-mixed", device_type="cuda",
                                train=TrainArgs(global_batch_size=devices, micro_batch_size=1),
                                fsdp=FSDPArgs(sharding_strategy="FULL_SHARD" if devices > 1 else None))
    config = Config.from_name("Llama-2-70b-hf")
    if fits:
        check_state_fits(config, plan, DryRunArgs(gpu="H100"), source="model Llama-2-70b-hf")
        return
    with pytest.raises(ModelTooLargeError, match=r"model Llama-2-70b-hf: .*one H100.*68,976,648,192 parameters"):
        check_state_fits(config, plan, DryRunArgs(gpu="H100"), source="model Llama-2-70b-hf")


def _tiny_run(tmp_path: Path, dist_env: dict, devices: int, *extra: str, **fault: Any) -> tuple[Path, str]:
    """A tiny pretraining run on ``devices`` CPU ranks with ``fault`` (tests/faults.environment) that must fail:
    its out_dir and its one error line."""
    out_dir = tmp_path / "out"
    model_config = write_tiny_model(tmp_path / "m.yaml")
    command = [sys.executable, "-m", "llmtrain", "pretrain", "--model_config", str(model_config), "--out_dir",
               str(out_dir), "--data", "BuiltinStories", "--data.num_documents", "100", "--data.num_val_documents",
               "10", "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_seq_length", "32",
               "--train.max_steps", "3", "--eval.max_iters", "1", "--devices", str(devices), "--accelerator", "cpu",
               *extra]
    env = {**dist_env, "LLMTRAIN_CACHE_DIR": str(tmp_path / "cache"), **faults.environment(**fault)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)  # a hang guard
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert done.returncode == 1, done.stderr
    assert len(errors) == 1 and errors[0].startswith("error: "), done.stderr
    return out_dir, errors[0]


@pytest.mark.parametrize("devices", [pytest.param(1, marks=pytest.mark.slow),
                                     pytest.param(2, marks=pytest.mark.multiproc)])
def test_a_disk_that_fills_during_a_save_is_named_in_one_line(devices, tmp_path, dist_env):
    """The first save's weights fail with ENOSPC half-written (tests/faults.DiskFull): the run ends, on every rank,
    with exit 1 and one line naming out_dir's disk and its free space, and no .step-N.tmp is left to fill it."""
    out_dir, error = _tiny_run(tmp_path, dist_env, devices, "--train.save_interval", "1", disk_full=True)
    assert f"no space left on the disk of {out_dir}" in error and "GiB free" in error, error
    assert [path.name for path in out_dir.iterdir() if path.name.startswith(".step-")] == []


@pytest.mark.multiproc
def test_the_rank_that_hangs_is_named_when_a_collective_times_out(tmp_path, dist_env):
    """Rank 1 of 2 freezes before step 2 (tests/faults.FreezeBeforeStep); rank 0's next collective times out after
    --dist_timeout 5, and the one line names rank 1, not only gloo's "Timed out waiting 5000ms for recv"."""
    _, error = _tiny_run(tmp_path, dist_env, 2, "--dist_timeout", "5", freeze_before_step=2)
    assert error.startswith("error: rank 0 of 2: rank 1 never reached the collective"), error
    assert "Timed out" in error, error


Usage = namedtuple("Usage", "total used free")


def test_a_write_whose_error_hides_the_errno_counts_as_disk_full_when_the_disk_is(tmp_path, monkeypatch):
    """torch.save and safetensors wrap ENOSPC in errors of their own (RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos, SafetensorError): a failed write on a nearly full disk is a full disk, one
    on a disk with room is left as it was."""
    from llmtrain.checkpoint import size

    def wrapped(tensors: dict, path: Path) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(files, "save_safetensors", wrapped)
    config = Config(**TINY_MODEL)
    write = lambda target: files.write_model_dir(target, state_dict={"wte.weight": torch.zeros(2)},  # noqa: E731
                                                 model_config=config, hyperparameters=None, tokenizer=None)
    with pytest.raises(RuntimeError, match="unexpected pos"):  # plenty of room: not a full disk
        write(tmp_path / "roomy")
    monkeypatch.setattr(size.shutil, "disk_usage", lambda path: Usage(2**40, 2**40 - 2**20, 2**20))
    with pytest.raises(size.DiskFullError, match=rf"no space left on the disk of {tmp_path} .*0.00 GiB free"):
        write(tmp_path / "full")
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def suite_hung_ranks(runtime, workdir: Path) -> dict:
    """Four ranks met as a run's do; ranks 0 to 2 find a collective timed out, rank 2 two seconds after the others,
    and rank 3 never does (it hangs): what each rank is told (None: it was not asked)."""
    import time

    from llmtrain.distributed.runtime import ranks_that_never_arrived

    told = None
    if runtime.rank in (0, 1, 2):
        time.sleep(2.0 if runtime.rank == 2 else 0.2 * runtime.rank)
        told = ranks_that_never_arrived()
    return {"told": runtime.all_gather_object(told)}


@pytest.mark.multiproc
def test_every_rank_that_timed_out_is_told_the_same_ranks_that_never_arrived(tmp_path):
    """Over a real gloo group of 4: the first rank to time out waits for the others (up to HUNG_RANKS_WAIT_S), lists
    the one that never came, and the others read that list instead of checking every rank themselves."""
    result = dist_worker.launch(4, "hung_ranks", tmp_path, timeout_s=300, script=Path(__file__))
    assert result["told"] == [[3], [3], [3], None]


if __name__ == "__main__":  # a rank of dist_worker.launch(..., script=this file)
    dist_worker.worker_main(sys.argv[1], Path(sys.argv[2]), suites={"hung_ranks": suite_hung_ranks})
