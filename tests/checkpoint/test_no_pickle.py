"""No pickle from any checkpoint file (issue 42, cases 5, 6 and 12).

A payload (a pickle that touches a file when unpickled) is planted in every file type that a resume, a conversion
or a fine-tune reads: a full checkpoint's training_state.pt, a sharded checkpoint's non-tensor DCP item, DeepSpeed's
model and optimizer files under ZeRO stages 1 to 3 (loaded directly, and through the universal checkpoint that a
resume on another number of processes converts them to), a LoRA checkpoint's training state, and a transformers
folder's pytorch_model.bin. Each command ends with exit 2 and one ``error:`` line naming the file or checkpoint, no
traceback, and the payload never runs. The checkpoints come from one tiny single-process run per format; the
command lines run as real ``python -m llmtrain`` processes (tests/helpers/forked_cli.py).
"""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from safetensors.torch import load_file

from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.state import DamagedCheckpointError
from llmtrain.cli import main

from conftest import write_tiny_model
from forked_cli import forked_driver, forked_results
from pickles import RunsCode
from runs import finetune_args

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="the deepspeed package is not installed")
STEP = layout.step_dir_name(1)
DS_MODEL = "mp_rank_00_model_states.pt"  # DeepSpeed's names (stage 3: one model file per rank)
DS_MODEL_3 = "zero_pp_rank_0_mp_rank_00_model_states.pt"
DS_OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _tiny_run(model_file: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["pretrain", "--model_config", str(model_file), "--out_dir", str(out_dir), "--data", "BuiltinStories",
            "--data.num_documents", "100", "--data.num_val_documents", "10", "--train.global_batch_size", "2",
            "--train.micro_batch_size", "2", "--train.max_seq_length", "16", "--train.lr_warmup_steps", "1",
            "--train.max_steps", "1", "--train.save_interval", "1", "--eval.max_iters", "1", *extra]


def _lora_run(base: Path, out_dir: Path, *extra: str) -> list[str]:
    return finetune_args("finetune_lora", base, out_dir, "--train.max_steps", "1", "--train.save_interval", "1",
                         *extra)


# ----------------------------------------------------------------------------------------- planting
def _payload(sentinel: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"weights": torch.ones(2), "extra": RunsCode(sentinel)}, buffer)
    return buffer.getvalue()


def plant_in_torch_file(path: Path, sentinel: Path) -> None:
    """Add the payload beside what a torch.save'd dict holds (our own file: plain torch.load may read it)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    state["extra"] = RunsCode(sentinel)
    torch.save(state, path)


def plant_in_dcp_item(dcp_dir: Path, sentinel: Path) -> None:
    """Replace the first non-tensor (BYTE_IO) item of a DCP folder by the payload, appended to its shard file; the
    index, rewritten to point at it, stays clean."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = pickle.loads((dcp_dir / layout.DCP_METADATA_FILE).read_bytes())  # our own index
    index = next(index for index in metadata.storage_data
                 if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata))
    shard = dcp_dir / metadata.storage_data[index].relative_path
    payload = _payload(sentinel)
    offset = shard.stat().st_size
    with open(shard, "ab") as handle:
        handle.write(payload)
    metadata.storage_data[index] = _StorageInfo(shard.name, offset, len(payload))
    (dcp_dir / layout.DCP_METADATA_FILE).write_bytes(pickle.dumps(metadata))


def plant_in_bin(hf_dir: Path, sentinel: Path) -> None:
    """The transformers folder's weights as pytorch_model.bin, with the payload beside them."""
    weights = load_file(str(hf_dir / "model.safetensors"))
    (hf_dir / "model.safetensors").unlink()
    torch.save({**weights, "extra": RunsCode(sentinel)}, hf_dir / "pytorch_model.bin")


def remark(step_dir: Path, world_size: Optional[int] = None) -> None:
    """Mark a changed checkpoint complete again, as its writer would (sizes of the changed files included), so that
    only the payload is wrong with it; ``world_size``: claim another writer's world (DeepSpeed: the universal path)."""
    marker = files.read_marker(step_dir)
    fields = {key: marker[key] for key in ("kind", "format", "step", "tokens", "world_size") if key in marker}
    if world_size is not None:
        fields["world_size"] = world_size
    files.write_marker(step_dir, fields)


def run_forked(argvs: list[list[str]], workdir: Path, env: dict) -> list:
    """forked_cli.run_forked, its driver importing DeepSpeed first where it is installed: each DeepSpeed command
    imported it anew, and the module of it that compiles at import (deepspeed.runtime.zero.muon), 1.5 s each."""
    executable, flag, code, *rest = forked_driver(argvs, workdir)
    if importlib.util.find_spec("deepspeed") is not None:
        code = "import deepspeed.runtime.zero.muon.muon_optimizer\n" + code
    driver = subprocess.run([executable, flag, code, *rest], capture_output=True, text=True, timeout=1200, env=env)
    assert driver.returncode == 0, f"the driver failed:\n{driver.stdout}{driver.stderr}"
    return forked_results(workdir)


# -------------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    name: str
    run: str  # the fixture's run (a folder of out_dir's) the case plants into a copy of
    plant: Callable[[Path, Path], None]  # (the copy, the sentinel)
    argv: Callable[[Path, Path], list[str]]  # (the copy, the inputs folder)
    names: str  # what the error line names: a file or the checkpoint, relative to the copy
    deepspeed: bool = False


def _in_step(name: str, world_size: Optional[int] = None) -> Callable[[Path, Path], None]:
    def plant(copy: Path, sentinel: Path) -> None:
        plant_in_torch_file(copy / STEP / name, sentinel)
        remark(copy / STEP, world_size)
    return plant


def _in_dcp(copy: Path, sentinel: Path) -> None:
    plant_in_dcp_item(copy / STEP / layout.DCP_DIR, sentinel)
    remark(copy / STEP)


def _resume(*extra: str) -> Callable[[Path, Path], list[str]]:
    return lambda copy, inputs: _tiny_run(inputs / "tiny.yaml", copy, "--resume", "auto", "--train.max_steps", "2",
                                          *extra)


def _deepspeed(stage: int, name: str, world_size: Optional[int] = None) -> Case:
    how = "through the universal checkpoint" if world_size else "directly"
    return Case(f"DeepSpeed stage {stage} {name} {how}", f"ds{stage}", _in_step(name, world_size),
                _resume("--strategy", f"deepspeed_stage_{stage}", "--devices", "1"), STEP, deepspeed=True)


CASES = [
    Case("full checkpoint training_state.pt", "full", _in_step(layout.STATE_FILE), _resume(),
         f"{STEP}/{layout.STATE_FILE}"),
    Case("sharded checkpoint non-tensor item", "sharded", _in_dcp, _resume("--fsdp.state_dict_type", "sharded"),
         f"{STEP}/{layout.DCP_DIR}/"),
    Case("LoRA checkpoint training_state.pt", "lora", _in_step(layout.STATE_FILE),
         lambda copy, inputs: _lora_run(inputs / "full" / layout.FINAL_DIR, copy, "--resume", "auto",
                                        "--train.max_steps", "2"), f"{STEP}/{layout.STATE_FILE}"),
    Case("convert from_hf a pytorch_model.bin", "hf", plant_in_bin,
         lambda copy, inputs: ["convert", "from_hf", str(copy), str(copy.parent / f"{copy.name}-converted")],
         "pytorch_model.bin"),
    Case("fine-tune a transformers folder's pytorch_model.bin", "hf", plant_in_bin,
         lambda copy, inputs: _lora_run(copy, copy.parent / f"{copy.name}-out"), "pytorch_model.bin"),
    *[_deepspeed(stage, name) for stage, name in ((1, DS_MODEL), (1, DS_OPTIM), (2, DS_MODEL), (2, DS_OPTIM),
                                                  (3, DS_MODEL_3), (3, DS_OPTIM))],
    _deepspeed(2, DS_OPTIM, world_size=2),
    _deepspeed(3, DS_MODEL_3, world_size=2),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    """Each case's command, run on its planted copy: {name: (result, copy, sentinel)}."""
    root = tmp_path_factory.mktemp("no-pickle")
    inputs, logs = root / "in", root / "logs"
    inputs.mkdir()
    env = {**os.environ, "LLMTRAIN_CACHE_DIR": str(root / "cache"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "DS_ACCELERATOR": "cpu"}
    model_file = write_tiny_model(inputs / "tiny.yaml", block_size=128)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMTRAIN_CACHE_DIR", env["LLMTRAIN_CACHE_DIR"])
        main(_tiny_run(model_file, inputs / "full"))
        main(["convert", "to_hf", str(inputs / "full" / layout.FINAL_DIR), str(inputs / "hf")])
    cases = [case for case in CASES if not case.deepspeed or importlib.util.find_spec("deepspeed")]
    runs = {"sharded": _tiny_run(model_file, inputs / "sharded", "--fsdp.state_dict_type", "sharded"),
            "lora": _lora_run(inputs / "full" / layout.FINAL_DIR, inputs / "lora")}
    runs.update({run: _tiny_run(model_file, inputs / run, "--strategy", f"deepspeed_stage_{run[-1]}", "--devices", "1")
                 for run in sorted({case.run for case in cases if case.deepspeed})})
    for result in run_forked(list(runs.values()), logs / "runs", env):
        assert result.returncode == 0, result.stderr
    planted = []
    for index, case in enumerate(cases):
        copy, sentinel = root / f"case-{index}", root / f"ran-{index}"
        shutil.copytree(inputs / case.run, copy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.load(weights_only=False) of our own files warns
            case.plant(copy, sentinel)
        planted.append((case, copy, sentinel))
    results = run_forked([case.argv(copy, inputs) for case, copy, _ in planted], logs / "cases", env)
    return {case.name: (result, copy, sentinel) for (case, copy, sentinel), result in zip(planted, results)}


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(case, marks=needs_deepspeed if case.deepspeed else ())
                                  for case in CASES], ids=[case.name for case in CASES])
def test_a_planted_pickle_never_runs_and_is_refused_in_one_line(case, refusals):
    result, copy, sentinel = refusals[case.name]
    assert not sentinel.exists(), f"the payload ran:\n{result.stderr}"
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert str(copy / case.names) in errors[0], errors[0]
    assert "could run code" in errors[0], errors[0]


def test_a_dcp_load_reads_no_pickled_item(tmp_path):
    """The planner itself refuses the item, naming the shard file (not only the check before a run starts)."""
    import torch.distributed.checkpoint as dcp

    from llmtrain.checkpoint import dcp_reader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group
        dcp.save({"weight": torch.ones(2), "lr": 0.1}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        plant_in_dcp_item(tmp_path / "dcp", tmp_path / "ran")
        with pytest.raises(DamagedCheckpointError, match=r"__0_0\.distcp: its entry 'lr' holds a pickled"):
            dcp_reader.load({"weight": torch.empty(2), "lr": 0.0}, tmp_path / "dcp", no_dist=True)
    assert not (tmp_path / "ran").exists()


def _call_by_name(module: str, name: str, argument: str) -> bytes:
    """A protocol-4 pickle that looks ``name`` up in ``module`` and calls it with ``argument``, written opcode by
    opcode (pickle.dumps would look the function up by its own module)."""
    def text(value: str) -> bytes:  # BINUNICODE
        encoded = value.encode()
        return b"X" + len(encoded).to_bytes(4, "little") + encoded

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(argument) + b"\x85R."


def test_a_dcp_index_reaches_no_function_through_a_dotted_name(tmp_path):
    """DCP's metadata module, whose classes an index may name, imports os: "os.mkdir" looked up in it (a dotted name
    is followed attribute by attribute) used to pass the allow-list, and ran."""
    from llmtrain.checkpoint.resume import check_dcp_metadata

    sentinel, dcp_dir = tmp_path / "ran", tmp_path / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / layout.DCP_METADATA_FILE).write_bytes(
        _call_by_name("torch.distributed.checkpoint.metadata", "os.mkdir", str(sentinel)))
    with pytest.raises(DamagedCheckpointError, match=r"\.metadata names torch\.distributed\.checkpoint\.metadata\.os"):
        check_dcp_metadata(dcp_dir)
    assert not sentinel.exists()
