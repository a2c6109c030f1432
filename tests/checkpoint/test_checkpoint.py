"""The checkpoint package: sizes in the marker, damaged checkpoints on resume, the LoRA merge.

The resume tests run the real CLI (``python -m llmtrain pretrain``, one process each, forked from one interpreter:
tests/helpers/forked_cli.py) on a tiny model; the others drive the checkpointer and the merge in this process.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.checkpointer import Checkpointer
from llmtrain.checkpoint.lora import merged_state_dict, write_lora_settings
from llmtrain.checkpoint.resume import resolve_resume, verify_checkpoint
from llmtrain.checkpoint.state import DamagedCheckpointError, load_training_state
from llmtrain.config import Config
from llmtrain.data.base import TrainLoader
from llmtrain.distributed.runtime import Runtime
from llmtrain.lora import LoRAArgs, apply_lora, lora_modules, mark_only_lora_trainable
from llmtrain.model import GPT
from llmtrain.model_dir import load_model_dir, merge_lora_checkpoint
from llmtrain.train.loop import TrainState

from forked_cli import run_forked

TINY = dict(name="tiny-checkpoint", vocab_size=1100, padding_multiple=64, block_size=64, n_layer=2, n_head=2,
            n_embd=64, n_query_groups=1, intermediate_size=128)


class _RunsCode:
    """A pickle that, if anything ever unpickled it, would leave a file behind."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (Path.touch, (self.sentinel,))


def _batches(indices) -> dict:
    rows = torch.stack([torch.arange(i, i + 9) % TINY["vocab_size"] for i in indices])
    return {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}


def _checkpointer(out_dir: Path, fmt: str = "full", model: GPT | None = None) -> Checkpointer:
    torch.manual_seed(0)
    if model is None:
        model = GPT(Config(**TINY))
        model.init_weights()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return Checkpointer(runtime=Runtime(), out_dir=out_dir, model=model, optimizer=optimizer,
                        train_loader=TrainLoader(8, _batches, 2), model_config=model.config, tokenizer=None,
                        hyperparameters={}, format=fmt)


def _truncate(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


# ------------------------------------------------------------------------------ marker and verify
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_the_marker_records_every_file_size_and_resume_checks_them(tmp_path, fmt):
    checkpointer = _checkpointer(tmp_path, fmt)
    first, second = (checkpointer.save(TrainState(step=step)) for step in (1, 2))
    sizes = files.read_marker(second)["sizes"]
    on_disk = {p.relative_to(second).as_posix(): p.stat().st_size for p in second.rglob("*")
               if p.is_file() and p.name != layout.MARKER_FILE}
    assert sizes == on_disk and layout.STATE_FILE in sizes
    if fmt == "sharded":
        assert any(name.startswith(f"{layout.DCP_DIR}/") and name.endswith(".distcp") for name in sizes)
    verify_checkpoint(second)

    damaged = second / (layout.MODEL_FILE if fmt == "full" else next(n for n in sizes if n.endswith(".distcp")))
    _truncate(damaged)
    with pytest.raises(DamagedCheckpointError, match=str(damaged)):
        verify_checkpoint(second)
    with pytest.warns(UserWarning, match=f"skipping {second.name}: {damaged}"):
        assert resolve_resume("auto", tmp_path, None) == first
    with pytest.warns(UserWarning, match=str(damaged)):
        assert resolve_resume(True, tmp_path, None) == first
    with pytest.raises(DamagedCheckpointError, match=f"--resume {second}: {damaged}"):
        resolve_resume(second, tmp_path, None)
    with pytest.raises(DamagedCheckpointError, match=str(damaged)):
        checkpointer.load(second, TrainState())  # checked again when a worker loads it


def test_a_safetensors_header_that_lies_is_found_without_the_marker_sizes(tmp_path):
    step = _checkpointer(tmp_path).save(TrainState(step=1))
    marker = files.read_marker(step)
    del marker["sizes"]  # as a version-1 marker
    (step / layout.MARKER_FILE).write_text(json.dumps(marker))
    _truncate(step / layout.MODEL_FILE)
    with pytest.raises(DamagedCheckpointError, match=f"{step / layout.MODEL_FILE} is damaged"):
        verify_checkpoint(step)
    (step / layout.MODEL_FILE).write_bytes(b"\xff" * 16)
    with pytest.raises(DamagedCheckpointError, match="safetensors header is unreadable"):
        verify_checkpoint(step)


def test_a_training_state_that_would_run_code_is_never_unpickled(tmp_path):
    checkpointer = _checkpointer(tmp_path)
    first, second = (checkpointer.save(TrainState(step=step)) for step in (1, 2))
    sentinel = tmp_path / "code-ran"
    torch.save({"train_state": _RunsCode(sentinel)}, second / layout.STATE_FILE)
    with pytest.raises(DamagedCheckpointError, match=f"{second / layout.STATE_FILE} holds objects that "
                                                     r"torch.load\(weights_only=True\) refuses"):
        load_training_state(second)
    with pytest.warns(UserWarning, match=str(second / layout.STATE_FILE)):
        assert resolve_resume("auto", tmp_path, None) == first
    assert not sentinel.exists()
    (second / layout.STATE_FILE).write_bytes(b"not a zip file")
    with pytest.raises(DamagedCheckpointError, match=f"{second / layout.STATE_FILE} cannot be read"):
        load_training_state(second)


def test_no_intact_checkpoint_left_is_an_error_not_a_fresh_start(tmp_path):
    step = _checkpointer(tmp_path).save(TrainState(step=1))
    _truncate(step / layout.STATE_FILE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DamagedCheckpointError, match=f"no intact checkpoint .* {step / layout.STATE_FILE}"):
            resolve_resume("auto", tmp_path, None)


# ------------------------------------------------------------------------------------ loading
def _file_mapped(tensor: torch.Tensor) -> set[str]:
    """The files whose memory mapping holds ``tensor``'s data (Linux's /proc/self/maps)."""
    files = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(address, 16) for address in fields[0].split("-"))
        if len(fields) == 6 and start <= tensor.data_ptr() < end:
            files.add(fields[5].strip())
    return files


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc/self/maps")
def test_a_full_checkpoints_optimizer_state_is_mapped_from_the_file_not_read_whole(tmp_path):
    saver = _checkpointer(tmp_path / "run")
    saver.model(torch.randint(0, 1100, (2, 8)), labels=torch.randint(0, 1100, (2, 8))).backward()
    saver.optimizer.step()
    state = TrainState(step=1)
    checkpoint = saver.save(state)
    loader = _checkpointer(tmp_path / "resumed")
    loader.load(checkpoint, TrainState())
    saved, loaded = saver.optimizer.state_dict()["state"], loader.optimizer.state_dict()["state"]
    state_file = str(checkpoint / layout.STATE_FILE)
    for index, moments in saved.items():
        torch.testing.assert_close(loaded[index]["exp_avg_sq"], moments["exp_avg_sq"], rtol=0, atol=0)
        # Pages of the file, read when touched: the load itself copied nothing into memory.
        assert _file_mapped(loaded[index]["exp_avg"]) == {state_file}


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_resumed_run_trains_with_its_own_optimizer_flags(tmp_path, fmt):
    """The messages of a diverged run say to resume with a lower learning rate: the checkpoint's lr, weight_decay
    and the schedule's base rate used to win over the resumed run's --optimizer flags."""
    from llmtrain.train.schedule import WarmupDecaySchedule

    def checkpointer(out_dir: Path, **settings) -> Checkpointer:
        torch.manual_seed(0)
        model = GPT(Config(**TINY))
        model.init_weights()
        optimizer = torch.optim.AdamW(model.parameters(), **settings)
        return Checkpointer(runtime=Runtime(), out_dir=out_dir, model=model, optimizer=optimizer,
                            train_loader=TrainLoader(8, _batches, 2), model_config=model.config, tokenizer=None,
                            hyperparameters={}, format=fmt)

    saver = checkpointer(tmp_path / "run", lr=1e-2, weight_decay=0.1)
    WarmupDecaySchedule(saver.optimizer, warmup_steps=2, total_steps=10, min_lr=0.0).set_step(5)  # as fit() does
    saver.model(torch.randint(0, 1100, (2, 8)), labels=torch.randint(0, 1100, (2, 8))).backward()
    saver.optimizer.step()
    checkpoint = saver.save(TrainState(step=5))
    for lr, weight_decay in ((1e-2, 0.1), (1e-3, 0.0)):  # the same flags, then lower ones
        resumed = checkpointer(tmp_path / f"resumed-{lr}", lr=lr, weight_decay=weight_decay)
        resumed.load(checkpoint, TrainState())
        group = resumed.optimizer.param_groups[0]
        assert (group["initial_lr"], group["weight_decay"]) == (lr, weight_decay)
        schedule = WarmupDecaySchedule(resumed.optimizer, warmup_steps=2, total_steps=10, min_lr=0.0)
        assert schedule.set_step(5) == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * 3 / 8)))
        saved = saver.optimizer.state_dict()["state"][0]["exp_avg"]
        torch.testing.assert_close(resumed.optimizer.state_dict()["state"][0]["exp_avg"], saved, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ the CLI
def _pretrain_argv(model_file: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["pretrain", "--model_config", str(model_file), "--out_dir", str(out_dir), "--data", "BuiltinStories",
            "--data.num_documents", "200", "--data.num_val_documents", "20", "--train.global_batch_size", "4",
            "--train.micro_batch_size", "2", "--train.max_seq_length", "32", "--train.lr_warmup_steps", "1",
            "--train.log_interval", "1", "--eval.interval", "100", "--eval.max_iters", "1",
            "--train.save_interval", "2", *extra]


DAMAGES = {"truncated": layout.MODEL_FILE, "evil": layout.STATE_FILE}


@pytest.fixture(scope="module")
def damaged_runs(tmp_path_factory):
    """A run with step checkpoints 2 and 4, copied four times: model.safetensors of step 4 truncated in two,
    training_state.pt of step 4 replaced by a pickle that would run code in the other two. Then, as real
    ``python -m llmtrain`` processes forked from one interpreter (tests/helpers/forked_cli.py), two at a time: on one
    copy of each damage ``--resume auto``, on the other ``--resume`` naming the damaged step-4. The run itself trains
    in this process (what the tests check is the resumes'). {damage: (auto, its out_dir, named, its step-4)}."""
    from llmtrain.cli import main

    root = tmp_path_factory.mktemp("damaged")
    os.environ.setdefault("LLMTRAIN_CACHE_DIR", str(root / "cache"))
    model_file = root / "tiny.yaml"
    model_file.write_text(yaml.safe_dump(TINY))
    main(_pretrain_argv(model_file, root / "run", "--train.max_steps", "4"))
    sentinel = root / "code-ran"
    argvs, dirs = [], {}
    for damage, bad_name in DAMAGES.items():
        for how in ("auto", "named"):
            copy = root / f"{damage}-{how}"
            subprocess.run(["cp", "-a", str(root / "run"), str(copy)], check=True)
            step = copy / "step-00000004"
            if damage == "truncated":
                _truncate(step / bad_name)
            else:
                torch.save({"train_state": _RunsCode(sentinel)}, step / bad_name)
            argvs.append(_pretrain_argv(model_file, copy, "--train.max_steps", "6", "--resume",
                                        "auto" if how == "auto" else str(step)))
            dirs[damage, how] = copy
    results = iter(run_forked(argvs, root / "logs", {**os.environ, "OMP_NUM_THREADS": "1"}, timeout_s=900))
    runs = {}
    for damage in DAMAGES:
        auto, named = next(results), next(results)
        runs[damage] = (auto, dirs[damage, "auto"], named, dirs[damage, "named"] / "step-00000004")
    return runs, sentinel


@pytest.mark.parametrize("damage", ["truncated", "evil"])
def test_resume_auto_skips_a_damaged_newest_checkpoint_and_finishes(damaged_runs, damage):
    runs, sentinel = damaged_runs
    done, out_dir, _, _ = runs[damage]
    bad_file = out_dir / "step-00000004" / DAMAGES[damage]
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert f"skipping step-00000004: {bad_file}" in output
    assert f"resumed from {out_dir / 'step-00000002'} at step 2" in output
    assert "moved the 1 newer checkpoint(s) of the branch this run rewinds" in output  # the damaged one, kept
    assert (out_dir / layout.REWOUND_DIR / "step-00000004" / bad_file.name).is_file()
    assert layout.latest_checkpoint(out_dir) == out_dir / "step-00000006"
    verify_checkpoint(out_dir / "step-00000004")  # written anew on the way
    assert layout.is_complete(out_dir / layout.FINAL_DIR)
    assert not sentinel.exists()


def test_resume_of_a_named_damaged_checkpoint_exits_2_with_one_message(damaged_runs):
    runs, sentinel = damaged_runs
    for damage, bad_name in DAMAGES.items():
        _, _, done, step = runs[damage]
        assert done.returncode == 2, done.stderr
        message = done.stderr.strip()
        assert "Traceback" not in message and message.startswith(f"error: --resume {step}: {step / bad_name}")
        assert len([p for p in message.split("\n\n") if p.strip()]) == 1, message
    assert not sentinel.exists()


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_of_another_architecture_or_optimizer_before_any_worker(tmp_path):
    """A sharded checkpoint of another width or optimizer failed in DCP with a traceback; another rope_base resumed
    silently. The command lines run as real ``python -m llmtrain`` processes forked one after the other from one
    interpreter (tests/helpers/forked_cli.py): the run, then its three refused resumes (each refused before it
    writes, so each resumes the same checkpoint)."""
    os.environ.setdefault("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    model_file = tmp_path / "tiny.yaml"
    model_file.write_text(yaml.safe_dump(TINY))
    out_dir = tmp_path / "run"
    sharded = ("--fsdp.state_dict_type", "sharded")
    step = out_dir / "step-00000002"
    changes = (({"n_embd": 32}, "n_embd 64 vs 32"), ({"rope_base": 500000.0}, "rope_base 10000.0 vs"))
    others = []
    for index, (change, _) in enumerate(changes):
        other = tmp_path / f"other-{index}.yaml"
        other.write_text(yaml.safe_dump({**TINY, **change}))
        others.append(other)
    done, *resumes, optimizer = run_forked(
        [_pretrain_argv(model_file, out_dir, "--train.max_steps", "2", *sharded),
         *[_pretrain_argv(other, out_dir, "--train.max_steps", "4", *sharded, "--resume", "auto") for other in others],
         _pretrain_argv(model_file, out_dir, "--train.max_steps", "4", *sharded, "--resume", "auto",
                        "--optimizer", "Adagrad")],
        tmp_path / "logs", {**os.environ, "OMP_NUM_THREADS": "1"}, timeout_s=900, at_once=1)
    assert done.returncode == 0, done.stderr
    for (_, difference), resumed in zip(changes, resumes):
        assert resumed.returncode == 2, resumed.stdout + resumed.stderr
        message = resumed.stderr.strip()
        assert "Traceback" not in message and message.startswith(f"error: --resume {step} holds another model")
        assert difference in message and f"--model_config {step / layout.CONFIG_FILE}" in message
    assert optimizer.returncode == 2, optimizer.stdout + optimizer.stderr
    assert optimizer.stderr.strip().startswith(f"error: --resume {step} holds the state of optimizer "
                                               "torch.optim.adamw.AdamW (see its hyperparameters.yaml), this run's is "
                                               "torch.optim.adagrad.Adagrad: resume with --optimizer AdamW")
    assert layout.latest_checkpoint(out_dir) == step


@pytest.mark.slow
def test_resume_refuses_adapters_other_than_this_runs_lora_settings(tmp_path):
    """Without the check, --lora_query false resumed silently without the trained query adapters, --quantize
    resumed LoRA adapters on a 4-bit base they were not trained on, and finetune_full resuming a LoRA checkpoint
    failed in the optimizer load with a traceback. The command lines run as real ``python -m llmtrain`` processes
    forked one after the other from one interpreter (tests/helpers/forked_cli.py): the base, its LoRA run, then the
    four refused resumes (each refused before it writes, so each resumes the same checkpoint)."""
    os.environ.setdefault("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    model_file = tmp_path / "tiny-128.yaml"  # instructions need a longer context
    model_file.write_text(yaml.safe_dump({**TINY, "block_size": 128}))
    out_dir = tmp_path / "lora"

    def finetune(recipe: str, *extra: str) -> list[str]:
        return [recipe, str(tmp_path / "base" / "final"), "--out_dir", str(out_dir), "--data",
                "BuiltinInstruct", "--data.num_train", "40", "--data.num_val", "4",
                "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
                "--train.max_seq_length", "128", "--eval.max_iters", "1", "--train.save_interval", "2", *extra]

    step = out_dir / "step-00000002"
    cases = (
        ("finetune_lora", ["--lora_query", "false"], "holds other adapters than this run's (checkpoint vs run: "
                                                     "--lora_query true vs false)"),
        ("finetune_lora", ["--lora_r", "4", "--lora_mlp", "true"], "--lora_r 8 vs 4; --lora_mlp false vs true"),
        # QLoRA's adapters went on training against the full-precision base (and final/ merged them into it).
        ("finetune_lora", ["--quantize", "bnb.nf4"], "(checkpoint vs run: no --quantize vs --quantize bnb.nf4)"),
        ("finetune_full", [], "holds LoRA adapters"))
    # One after the other, from one interpreter: each command starts once the one before it has ended.
    base, done, *resumes = run_forked([_pretrain_argv(model_file, tmp_path / "base", "--train.max_steps", "2"),
                                       finetune("finetune_lora", "--train.max_steps", "2"),
                                       *[finetune(recipe, "--train.max_steps", "4", "--resume", "auto", *extra)
                                         for recipe, extra, _ in cases]],
                                      tmp_path / "logs", env, timeout_s=900, at_once=1)
    assert base.returncode == 0, base.stderr
    assert done.returncode == 0, done.stderr
    for (recipe, extra, expected), resumed in zip(cases, resumes):
        assert resumed.returncode == 2, resumed.stdout + resumed.stderr
        message = resumed.stderr.strip()
        assert "Traceback" not in message and message.startswith(f"error: --resume {step} ") and expected in message
    assert layout.latest_checkpoint(out_dir) == step


# ----------------------------------------------------------------------------------- LoRA merge
LORA = LoRAArgs(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_projection=True, lora_mlp=True)


def _plain_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(Config(**TINY))
    model.init_weights()
    return model.eval()


def _with_adapters(model: GPT) -> GPT:
    apply_lora(model, LORA)
    mark_only_lora_trainable(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.1)  # B starts at zero; a merge of zeros would prove nothing
    return model.eval()


def test_merged_weights_are_the_effective_weights_and_give_the_same_logits():
    model = _with_adapters(_plain_model())
    merged = merged_state_dict(model)
    assert all(tensor.device.type == "cpu" for tensor in merged.values())
    for name, module in lora_modules(model).items():
        effective = module.base.weight + module.lora_B @ module.lora_A * module.scaling
        torch.testing.assert_close(merged[f"{name}.weight"], effective)
        assert f"{name}.lora_A" not in merged and f"{name}.base.weight" not in merged
    plain = GPT(Config(**TINY)).eval()
    assert list(merged) == list(plain.state_dict())
    plain.load_state_dict(merged, strict=True)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    # The gathered-state path (rank 0 under FSDP) merges to the same tensors.
    from_state = merged_state_dict(model, {k: v.detach().clone() for k, v in model.state_dict().items()})
    assert sorted(from_state) == sorted(merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(from_state[name], tensor, rtol=0, atol=0)


def test_a_qlora_merge_moves_each_layer_to_the_host_before_it_merges_the_next(monkeypatch):
    from llmtrain.checkpoint import lora as checkpoint_lora
    from llmtrain.quantize import quantize_model

    # Adapters on every linear layer but k_proj, which stays quantized only: both kinds of layer are merged.
    model = _with_adapters(quantize_model(_plain_model(), "bnb.nf4", compute_dtype=torch.bfloat16))
    events = []
    merge_layer, to_host = checkpoint_lora._merged_linear, torch.Tensor.cpu

    def merged_linear(module):
        weight, bias = merge_layer(module)
        events.append(("merged", id(weight)))
        return weight, bias

    def cpu(tensor, *args, **kwargs):
        events.append(("to host", id(tensor)))
        return to_host(tensor, *args, **kwargs)

    monkeypatch.setattr(checkpoint_lora, "_merged_linear", merged_linear)
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    merged = merged_state_dict(model)
    monkeypatch.undo()
    on_device = None  # the merged layer not yet on the host
    for kind, tensor_id in events:
        if kind == "merged":
            assert on_device is None, "a layer was merged while the previous one was still on the device"
            on_device = tensor_id
        elif tensor_id == on_device:
            on_device = None
    assert on_device is None
    assert sum(kind == "merged" for kind, _ in events) == 7 * TINY["n_layer"]
    assert {tensor.dtype for name, tensor in merged.items() if name.startswith("blocks.")} == {torch.bfloat16}


def test_a_lora_runs_final_and_merge_lora_give_the_lora_models_logits(tmp_path):
    from llmtrain.data import BuiltinStories

    tokenizer = BuiltinStories().default_tokenizer()
    base = _plain_model()
    base_dir = files.write_model_dir(tmp_path / "base", state_dict=base.state_dict(), model_config=base.config,
                                     hyperparameters=None, tokenizer=tokenizer)
    model = _with_adapters(base)
    checkpointer = _checkpointer(tmp_path / "run", "lora", model=model)
    checkpointer.tokenizer = tokenizer
    checkpointer.write_extras = lambda directory: write_lora_settings(directory, LORA, base_dir, None)
    step = checkpointer.save(TrainState(step=1))
    assert (step / layout.LORA_FILE).is_file() and not (step / layout.MODEL_FILE).exists()
    final = checkpointer.save_final(TrainState(step=1))
    merged_dir = merge_lora_checkpoint(step, tmp_path / "merged")
    tokens = torch.randint(0, TINY["vocab_size"], (2, 16))
    with torch.no_grad():
        expected = model(tokens)
        for directory in (final, merged_dir):
            merged_model = load_model_dir(directory)[0]
            torch.testing.assert_close(merged_model(tokens), expected, rtol=1e-5, atol=1e-5)
    assert (final / layout.LORA_FILE).is_file() and files.read_marker(final)["lora_merged"]
    # A merge never writes over a folder that holds anything (here: the run, its checkpoints and final/).
    before = sorted(path.relative_to(tmp_path) for path in (tmp_path / "run").rglob("*"))
    with pytest.raises(FileExistsError, match="already exists and is not empty"):
        merge_lora_checkpoint(step, tmp_path / "run")
    assert sorted(path.relative_to(tmp_path) for path in (tmp_path / "run").rglob("*")) == before


def test_streamed_weights_make_the_file_save_file_makes_and_are_checked_against_the_shapes(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b.weight": torch.randn(7), "c": torch.arange(4),
               "d": torch.ones(2, 2, dtype=torch.bool).t(), "e": torch.zeros(0, 3)}  # a transposed one too
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    files.stream_weights(iter(tensors.items()), tmp_path / "streamed.safetensors", shapes)
    loaded = load_file(str(tmp_path / "streamed.safetensors"))
    assert list(loaded) == sorted(tensors)  # (safetensors lists names sorted)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(str(tmp_path / "streamed.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    for pairs, message in ((list(tensors.items()) + [("f", torch.ones(1))], "'f' of shape"),
                           ([("a", torch.ones(5, 3))] + list(tensors.items())[1:], "'a' of shape"),
                           (list(tensors.items())[:-1], "lack 1 tensors")):
        with pytest.raises(ValueError, match=message):
            files.stream_weights(iter(pairs), tmp_path / "bad.safetensors", shapes)


def test_a_lora_runs_final_is_written_as_it_is_merged_never_whole(tmp_path, monkeypatch):
    import weakref

    from llmtrain.checkpoint import lora as checkpoint_lora

    model = _with_adapters(_plain_model())
    merged_layers, merge_layer = [], checkpoint_lora._merged_linear

    def merged_linear(module):
        alive = [layer for layer in merged_layers if layer() is not None]
        assert len(alive) <= 1, f"{len(alive)} merged layers held at once"  # the last one may be being written
        weight, bias = merge_layer(module)
        merged_layers.append(weakref.ref(weight))
        return weight, bias

    monkeypatch.setattr(checkpoint_lora, "_merged_linear", merged_linear)
    checkpointer = _checkpointer(tmp_path / "run", "lora", model=model)
    checkpointer.write_extras = lambda directory: write_lora_settings(directory, LORA, tmp_path, None)
    final = checkpointer.save_final(TrainState(step=1))
    assert len(merged_layers) == len(lora_modules(model))
    monkeypatch.undo()
    from safetensors.torch import load_file

    expected = merged_state_dict(model)
    stored = load_file(str(final / layout.MODEL_FILE))
    assert sorted(stored) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(stored[name], tensor), name


# ----------------------------------------------------------------------------------- QLoRA base
def _base_dir(directory: Path, config: Config) -> Path:
    """A directory holding only the bf16 weights of a seeded model of ``config``: all a quantized build reads."""
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    directory.mkdir()
    files.save_weights(model.to(torch.bfloat16).state_dict(), directory / layout.MODEL_FILE)
    return directory


def _refuse_init(monkeypatch: pytest.MonkeyPatch) -> None:
    def init_weights(self):
        raise AssertionError("init_weights ran: random weights that loading would overwrite")

    monkeypatch.setattr(GPT, "init_weights", init_weights)


@pytest.mark.parametrize("tied", [False, True])
def test_a_quantized_base_streams_from_the_file_and_equals_quantizing_the_loaded_model(tmp_path, monkeypatch, tied):
    from llmtrain.model_dir import build_model_from_dir, build_quantized_model_from_dir
    from llmtrain.quantize import quantize_model

    config = Config(**{**TINY, "tie_embeddings": tied})
    base_dir = _base_dir(tmp_path / "base", config)
    _refuse_init(monkeypatch)
    streamed = build_quantized_model_from_dir(base_dir, config, "bnb.nf4", compute_dtype=torch.bfloat16)
    reference = quantize_model(build_model_from_dir(base_dir, config, dtype=torch.bfloat16), "bnb.nf4",
                               compute_dtype=torch.bfloat16)
    assert (streamed.lm_head.weight is streamed.wte.weight) == tied
    expected = reference.state_dict()
    assert list(streamed.state_dict()) == list(expected)
    for name, tensor in streamed.state_dict().items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    tokens = torch.randint(0, TINY["vocab_size"], (1, 8))
    with torch.no_grad():
        assert torch.equal(streamed.eval()(tokens), reference.eval()(tokens))


@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_qlora_build_quantizes_in_the_precisions_dtype_without_a_random_init(tmp_path, monkeypatch, precision):
    import bitsandbytes as bnb

    from llmtrain.args import TrainArgs
    from llmtrain.distributed.parallel_plan import ParallelPlan
    from llmtrain.recipes.build import build_model

    config = Config(**TINY)
    base_dir = _base_dir(tmp_path / "base", config)
    _refuse_init(monkeypatch)
    plan = ParallelPlan.resolve(devices=1, num_nodes=1, train=TrainArgs(global_batch_size=2, micro_batch_size=2),
                                precision=precision, accelerator="cpu")
    model = build_model(config, plan=plan, runtime=Runtime(), seed=0, initial_checkpoint_dir=base_dir,
                        lora=LORA, quantize="bnb.nf4")
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 7 * TINY["n_layer"]
    dtype = plan.precision.compute_dtype
    assert {m.weight.quant_state.dtype for m in quantized} == {dtype}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {dtype}


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_the_disk_estimate_holds_a_step_and_final(tmp_path, fmt):
    """What check_disk_space asks for covers the bytes a step checkpoint and final/ take on disk (hard links
    counted once): a sharded run's final/ is a copy of the weights of its own."""
    from llmtrain.checkpoint.size import checkpoint_bytes
    from llmtrain.precision import resolve_precision

    checkpointer = _checkpointer(tmp_path, fmt)
    state = TrainState(step=1)
    checkpointer.save(state)
    checkpointer.save_final(state)
    seen, used = set(), 0
    for path in tmp_path.rglob("*"):
        info = path.stat()
        if path.is_file() and (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            used += info.st_size
    config = Config(**TINY)
    needed = checkpoint_bytes(config, resolve_precision("32-true", "cpu"), separate_final=fmt == "sharded")["needed"]
    assert 0.9 * used < needed < 1.5 * used, (needed, used)


def test_a_rewind_sets_the_abandoned_branch_aside_for_resume_auto(tmp_path):
    """Resuming step 1 while steps 2 and 3 exist: those go to rewound/, so that --resume auto after a crash
    continues this run, not the branch it rewound; a second rewind past the same step keeps both copies."""
    checkpointer = _checkpointer(tmp_path, "full")
    first, second, third = (checkpointer.save(TrainState(step=step)) for step in (1, 2, 3))
    assert files.set_aside_newer(tmp_path, third) == []
    moved = files.set_aside_newer(tmp_path, first)
    assert moved == [tmp_path / "rewound" / second.name, tmp_path / "rewound" / third.name]
    assert all(layout.is_training_checkpoint(path) for path in moved)
    assert resolve_resume("auto", tmp_path, None) == first
    again = checkpointer.save(TrainState(step=2))
    assert files.set_aside_newer(tmp_path, first) == [tmp_path / "rewound" / f"{second.name}.1"]
    assert not again.exists() and resolve_resume("auto", tmp_path, None) == first
    assert files.set_aside_newer(tmp_path / "elsewhere", first) == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_weight_files_get_the_mode_the_umask_gives_every_other_file(tmp_path, umask):
    """safetensors writes its files 0600; a checkpoint's and an export's weights must be as readable as the
    JSON beside them, or a colleague can read the folder but not load the model."""
    from llmtrain.benchmark.training import write_random_model_dir
    from llmtrain.convert.hf import to_hf
    from llmtrain.data import BuiltinStories

    previous = os.umask(umask)
    try:
        base = write_random_model_dir(tmp_path / "base", "llama-debug", BuiltinStories().default_tokenizer())
        to_hf(base, tmp_path / "hf")
    finally:
        os.umask(previous)
    modes = {path.relative_to(tmp_path).as_posix(): oct(path.stat().st_mode & 0o777)
             for path in tmp_path.rglob("*") if path.is_file()}
    assert {"base/model.safetensors", "hf/model.safetensors"} <= set(modes)
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_weights_are_saved_where_the_filesystem_refuses_chmod(tmp_path, monkeypatch):
    """Some mounts (SMB, FUSE object stores) keep no modes and refuse chmod: the weights were written, then the
    mode fix raised and the checkpoint save died with them."""
    import errno

    from safetensors.torch import load_file

    def refuse(path, mode):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(path))

    monkeypatch.setattr(files.os, "chmod", refuse)
    state = {"wte.weight": torch.arange(6.0).reshape(2, 3)}
    files.save_weights(state, tmp_path / "model.safetensors")
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["wte.weight"], state["wte.weight"])


def test_weights_stay_private_where_the_umask_cannot_be_read(tmp_path, monkeypatch):
    """Without /proc (macOS, BSD) the umask was taken to be 022: under umask 077 the weights became readable by
    everyone, where every other file of the checkpoint is the owner's only."""
    read_text = Path.read_text

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", no_proc)
    previous = os.umask(0o077)
    try:
        files.save_weights({"wte.weight": torch.ones(2, 3)}, tmp_path / "model.safetensors")
    finally:
        os.umask(previous)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o077 == 0
