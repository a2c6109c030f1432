"""Crash safety, preemption, exact resume and numerical faults.

The multi-process tests run ``llmtrain pretrain --devices 2`` (two spawned workers, FSDP over gloo) on
a tiny model, interrupt it (kill -9, SIGTERM, SIGUSR1, a crashed rank) and continue it with
``--resume auto``; every time, the final weights must equal those of one uninterrupted run bit for bit.
The in-process tests drive the checkpointers and ``fit()`` directly.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import math
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import faults
from limits import hard_limit
from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.checkpointer import Checkpointer, NonFiniteWeightsError
from llmtrain.checkpoint.resume import resolve_resume
from llmtrain.args import EvalArgs, TrainArgs, batch_plan
from llmtrain.config import Config
from llmtrain.data.base import TrainLoader
from llmtrain.distributed.runtime import Runtime
from llmtrain.model import GPT
from llmtrain.train.horizon import plan_horizon
from llmtrain.train.loop import Fit, TrainState, fit
from llmtrain.train.nonfinite import NonFiniteError
from llmtrain.precision import Precision
from llmtrain import callbacks
from llmtrain.signals import PREEMPTED_EXIT_CODE, Preempted

from conftest import write_tiny_model
from runs import (MAX_STEPS, SAVE_INTERVAL, STOPPED, assert_same_weights, launcher, losses,  # noqa: F401
                  model_file, resumable_args, shared_cache, step_of)

ROOT = Path(__file__).resolve().parents[2]
TEST_LIMIT_S = 900


@pytest.fixture(autouse=True)
def time_limit(request):
    """Every test here ends within TEST_LIMIT_S, whatever it waits on (its processes are killed on the way out)."""
    with hard_limit(TEST_LIMIT_S, request.node.name):
        yield


# ------------------------------------------------------------------------------ running processes


_REFERENCE: dict = {}


_REFERENCE_LOSSES: dict[int, float] = {}


@pytest.fixture
def reference(launcher, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of one uninterrupted 2-process run (made once for the module; its losses in
    _REFERENCE_LOSSES)."""
    if not _REFERENCE:
        out_dir = tmp_path_factory.mktemp("reference")
        launcher.complete(out_dir)
        _REFERENCE.update(load_file(str(out_dir / "final" / "model.safetensors")))
        _REFERENCE_LOSSES.update(losses(out_dir))
    return _REFERENCE


def leftovers(out_dir: Path) -> list[str]:
    return sorted(p.name for p in Path(out_dir).iterdir() if p.name.startswith(".") and p.name != layout.LOCK_FILE)


# ----------------------------------------------------------------------------------- kill -9
def test_kill_9_at_any_moment_then_resume_auto_matches_an_uninterrupted_run(launcher, reference, tmp_path, free_port):
    """Killed during the first step, between steps and in the middle of a save: each resume picks up the
    newest complete checkpoint, and the finished run's weights equal the uninterrupted run's.

    The run is finished under torchrun --max-restarts 1, where rank 1 dies on the first attempt two steps after
    that attempt's next checkpoint: the restarted workers find that checkpoint through --resume auto and finish as
    if nothing had happened. (One launch for both claims: the elastic restart and the last resume.)"""
    out_dir = tmp_path / "run"
    first = launcher.start(out_dir, "--resume", "auto")
    first.wait_for(r"^step 0 \| val_loss")  # the first optimizer step is under way
    first.kill_9()
    assert layout.latest_checkpoint(out_dir) is None

    second = launcher.start(out_dir, "--resume", "auto")
    second.wait_for(r"^step 6 \|")  # between steps, after the step-4 checkpoint
    second.kill_9()
    resumed_from = layout.latest_checkpoint(out_dir)
    assert resumed_from is not None and step_of(resumed_from) >= 4

    # Every save of this run sleeps after writing its weights: the kill lands half-way through one.
    third = launcher.start(out_dir, "--resume", "auto", env=faults.environment(slow_save_s=60))
    weights = third.wait_for_files(out_dir, ".step-*.tmp*/model.safetensors")
    third.kill_9()
    partial = weights[0].parent
    assert partial.is_dir() and not (partial / layout.MARKER_FILE).exists()
    assert layout.latest_checkpoint(out_dir) == resumed_from  # the half-written one does not count
    assert resolve_resume("auto", out_dir, None) == resumed_from

    # The first attempt resumes from resumed_from, saves SAVE_INTERVAL steps later and crashes 2 steps after that
    # (after a kill that landed late, with no room for another save before the end: crashes 2 steps in).
    restart_from = step_of(resumed_from) + SAVE_INTERVAL
    if restart_from + 2 >= MAX_STEPS:
        restart_from = step_of(resumed_from)
    crash = restart_from + 2
    last = launcher.start(out_dir, "--resume", "auto", env=faults.environment(crash_before_step=crash),
                          torchrun=["--nproc_per_node", "2", "--max-restarts", "1", "--master_addr", "127.0.0.1",
                                    "--master_port", str(free_port())])
    assert last.finish() == 0, last.output
    assert f"resumed from {resumed_from}" in last.output
    assert f"crashing before step {crash}" in last.output
    assert f"resumed from {out_dir / layout.step_dir_name(restart_from)} at step {restart_from}" in last.output
    assert leftovers(out_dir) == []  # the next save removed the half-written directory
    assert_same_weights(out_dir, reference)


def test_kill_9_during_a_sharded_save_then_resume(launcher, reference, tmp_path):
    """The same with sharded (DCP) checkpoints, resumed at the same world size; then a flipped shard of the
    finished run's newest checkpoint, caught by its rank."""
    out_dir = tmp_path / "sharded"
    sharded = ("--fsdp.state_dict_type", "sharded", "--resume", "auto")
    first = launcher.start(out_dir, *sharded)
    first.wait_for(r"^step 6 \|")
    first.kill_9()
    resumed_from = layout.latest_checkpoint(out_dir)
    assert resumed_from is not None and (resumed_from / "dcp").is_dir()

    second = launcher.start(out_dir, *sharded, env=faults.environment(slow_save_s=60))
    shards = second.wait_for_files(out_dir, ".step-*.tmp/dcp/*.distcp", count=2)  # both ranks wrote theirs
    second.kill_9()
    assert not (shards[0].parents[2] / layout.MARKER_FILE).exists()
    assert layout.latest_checkpoint(out_dir) == resumed_from

    last = launcher.start(out_dir, *sharded)
    assert last.finish() == 0, last.output
    assert leftovers(out_dir) == []
    assert_same_weights(out_dir, reference)

    # Rank 1's shard of the newest checkpoint gets flipped bytes (same size). Rank 1 finds it (rank 0 hashes only
    # its own shard), both ranks fall back to the previous checkpoint together, and the run ends with the losses and
    # weights of the run that never saw the damage. (tests/checkpoint/test_checksums.py: one process.)
    shutil.rmtree(out_dir / layout.FINAL_DIR)
    (_, previous), (_, newest) = layout.list_checkpoints(out_dir)[-2:]
    assert step_of(newest) == MAX_STEPS
    shard = newest / layout.DCP_DIR / "__1_0.distcp"
    faults.flip(shard, faults.tensor_data_offset(shard))
    run = launcher.complete(out_dir, *sharded)
    warned = [line for line in run.output.splitlines() if "does not match the checksum" in line]
    assert len(warned) == 1 and str(shard) in warned[0], run.output
    assert f"resumed from {previous}" in run.output
    trained = {step: loss for step, loss in losses(out_dir).items() if step > step_of(previous)}
    assert sorted(trained) == list(range(step_of(previous) + 1, MAX_STEPS + 1))
    assert trained == {step: _REFERENCE_LOSSES[step] for step in trained}
    assert_same_weights(out_dir, reference)


# ------------------------------------------------------------------------------------- signals
def test_sigterm_and_sigusr1_checkpoint_exit_75_and_resume_exactly(launcher, reference, tmp_path):
    """TERM sent to the launcher (as torchrun does), TERM or USR1 sent to a single worker: every rank
    stops after the same step, a complete checkpoint of that step is written, the exit code is 75, and
    the resumed run ends with the uninterrupted run's weights. (USR1 to the launcher, SLURM's time-limit
    signal, is test_slurm's preemption test.)"""
    out_dir = tmp_path / "preempted"
    deliveries = [(signal.SIGTERM, "launcher"), (signal.SIGTERM, 1), (signal.SIGUSR1, 0)]
    reached = 0
    for signum, target in deliveries:
        run = launcher.start(out_dir, "--resume", "auto")
        run.wait_for(rf"^step {reached + 1} \|")  # training has resumed
        pid = run.proc.pid if target == "launcher" else run.workers()[target]
        os.kill(pid, signum)
        code = run.finish()
        assert code == PREEMPTED_EXIT_CODE, f"{signum.name} to {target}: exit {code}\n{run.output}"
        stopped = STOPPED.search(run.output)
        assert stopped, run.output
        step = int(stopped.group(1))
        # A single worker's signal stops both ranks; rank 0 reports whose it was.
        assert stopped.group(2) == (f"got {signum.name}" if target in ("launcher", 0) else
                                    "another rank got a stop signal")
        assert reached < step < MAX_STEPS
        latest = layout.latest_checkpoint(out_dir)
        assert latest == out_dir / layout.step_dir_name(step) and step_of(latest) == step
        assert torch.load(latest / layout.STATE_FILE, weights_only=True)["train_state"]["step"] == step
        assert not (out_dir / "final").exists()
        reached = step
    last = launcher.start(out_dir, "--resume", "auto")
    assert last.finish() == 0, last.output
    assert_same_weights(out_dir, reference)


# --------------------------------------------------------------------------------- numerical faults
def test_nan_on_one_rank_is_skipped_by_every_rank_and_too_many_stop_the_run(launcher, tmp_path):
    """NaN gradients made on rank 1 only: both ranks skip the step (no hang, no divergence), the skip is
    logged, and three in a row end the run with a message; no checkpoint holds NaN."""
    out_dir = tmp_path / "nan"
    run = launcher.start(out_dir, "--train.max_nonfinite_steps", "3",
                         env=faults.environment(nan_steps=[3, 6, 7, 8]))
    code = run.finish()
    assert code != 0 and code != PREEMPTED_EXIT_CODE, run.output
    assert re.search(r"step 3 \| skipped: the gradient norm is nan, no update \(1 in a row", run.output), run.output
    assert "NaN or inf in 3 optimizer steps in a row (steps 6-8; --train.max_nonfinite_steps 3)" in run.output
    rows = {int(r["step"]): r for r in csv.DictReader(open(out_dir / "metrics.csv")) if r["skipped"]}
    assert sorted(rows) == [3, 6, 7, 8] and all(math.isnan(float(r["grad_norm"])) for r in rows.values())
    assert [p.name for _, p in layout.list_checkpoints(out_dir)] == ["step-00000004"]
    for tensor in load_file(str(out_dir / "step-00000004" / "model.safetensors")).values():
        assert torch.isfinite(tensor).all()
    assert not (out_dir / "final").exists()


class StateAfterSteps(callbacks.Callback):
    """Copies of the weights and the optimizer state after each of the given steps."""

    def __init__(self, steps: list[int]) -> None:
        self.steps, self.copies = steps, {}

    def on_fit_start(self, job) -> None:
        self.job = job

    def on_step_end(self, step: int) -> None:
        if step in self.steps:
            self.copies[step] = copy.deepcopy((self.job.model.state_dict(), self.job.optimizer.state_dict()["state"]))


def test_skipped_steps_change_no_weight_and_no_optimizer_state(tmp_path, model_file):
    from llmtrain.cli import main

    out_dir = tmp_path / "skip"
    # NOTE: copied in the run, as no checkpoint is written while the steps are skipped (tests/train/test_divergence.py).
    states = StateAfterSteps([2, 4])
    with faults.installed(faults.NanLoss([3, 4]), states):
        main([*resumable_args(model_file, out_dir), "--train.max_steps", "6", "--train.save_interval", "2",
              "--train.global_batch_size", "4"])
    (before, old), (after, new) = states.copies[2], states.copies[4]
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    for key in old:
        for field in old[key]:
            assert torch.equal(old[key][field], new[key][field]), (key, field)
    rows = list(csv.DictReader(open(out_dir / "metrics.csv")))
    assert [int(r["step"]) for r in rows if r["skipped"] == "1"] == [3, 4]
    losses = [float(r["loss"]) for r in rows if r["loss"]]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    for tensor in load_file(str(out_dir / "final" / "model.safetensors")).values():
        assert torch.isfinite(tensor).all()


def test_too_many_nonfinite_steps_in_a_row_stop_before_the_next_save(tmp_path, model_file):
    from llmtrain.cli import main

    out_dir = tmp_path / "stop"
    too_many = r"in 2 optimizer steps in a row \(steps 2-3; --train.max_nonfinite"
    with faults.installed(faults.NanLoss([2, 3])):
        with pytest.raises(NonFiniteError, match=too_many):
            main([*resumable_args(model_file, out_dir), "--train.max_steps", "6", "--train.save_interval", "1",
                  "--train.global_batch_size", "4", "--train.max_nonfinite_steps", "2"])
    # Step 2's save was skipped (in the streak), and step 1's weights gave those NaNs: it is set aside.
    assert layout.list_checkpoints(out_dir) == []
    assert [step_of(p) for p in (out_dir / layout.REWOUND_DIR).iterdir()] == [1]
    assert not (out_dir / "final").exists()


def test_fp16_overflow_is_the_loss_scalers_business(tmp_path, model_file):
    """With 16-mixed a non-finite step backs the loss scale off instead of counting toward the stop,
    while the scale can still be blamed (it starts at 65536)."""
    from llmtrain.cli import main

    out_dir = tmp_path / "fp16"
    with faults.installed(faults.NanLoss([2, 3, 4])):
        main([*resumable_args(model_file, out_dir), "--train.max_steps", "5", "--train.global_batch_size", "4",
              "--precision", "16-mixed", "--train.max_nonfinite_steps", "2"])
    scaler = torch.load(out_dir / "step-00000005" / layout.STATE_FILE, weights_only=True)["scaler"]
    assert scaler["scale"] == 65536.0 / 2**3
    rows = list(csv.DictReader(open(out_dir / "metrics.csv")))
    assert [int(r["step"]) for r in rows if r["skipped"] == "1"] == [2, 3, 4]


_BASE: dict = {}


@pytest.fixture
def base_model(tmp_path_factory) -> Path:
    """A 2-step pretraining run of the tiny model with room for instructions (made once for the module)."""
    from llmtrain.cli import main

    if not _BASE:
        base = tmp_path_factory.mktemp("finetune-base") / "base"
        longer = base.parent / "tiny-128.yaml"  # instructions need a longer context
        write_tiny_model(longer, block_size=128)
        main([*resumable_args(longer, base), "--train.max_steps", "2", "--train.global_batch_size", "4"])
        _BASE["out_dir"] = base
    return _BASE["out_dir"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["finetune_full", "finetune_lora"])
def test_fine_tuning_resumed_ends_with_bit_identical_weights(tmp_path, base_model, recipe):
    from llmtrain.cli import main

    base = base_model

    def finetune(out_dir: Path, *extra: str) -> None:
        main([recipe, str(base / "final"), "--out_dir", str(out_dir), "--data", "BuiltinInstruct", "--data.num_train",
              "100", "--data.num_val", "8", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
              "--train.max_seq_length", "128", "--train.lr_warmup_steps", "1", "--eval.max_iters", "1",
              "--optimizer.lr", "0.01", "--train.max_steps", "6", "--train.save_interval", "3", *extra])

    finetune(tmp_path / "straight")
    crashed = tmp_path / "crashed"  # died after its step-3 checkpoint
    crashed.mkdir()
    shutil.copytree(tmp_path / "straight" / "step-00000003", crashed / "step-00000003")
    finetune(crashed, "--resume", "auto")
    files = ["model.safetensors"] + (["lora.safetensors"] if recipe == "finetune_lora" else [])
    for name in files:
        expected = load_file(str(tmp_path / "straight" / "final" / name))
        resumed = load_file(str(crashed / "final" / name))
        assert all(torch.equal(resumed[key], tensor) for key, tensor in expected.items()), name


# ------------------------------------------------------------------------ checkpointers in-process
CONFIG = dict(name="ckpt-test", vocab_size=64, padding_multiple=64, block_size=16, n_layer=1, n_head=2, n_embd=16,
              n_query_groups=1, intermediate_size=32)


def random_batches(indices: np.ndarray) -> dict[str, torch.Tensor]:
    """Sample i is a fixed sequence drawn from seed i, so a sample's contents name it."""
    rows = torch.stack([torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(int(i))) for i in indices])
    return {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}


def checkpointer_parts(out_dir: Path, lora: bool = False) -> dict:
    torch.manual_seed(0)
    config = Config(**CONFIG)
    model = GPT(config)
    model.init_weights()
    if lora:
        from llmtrain.lora import LoRAArgs, apply_lora, mark_only_lora_trainable

        apply_lora(model, LoRAArgs(lora_r=2, lora_dropout=0.0))
        mark_only_lora_trainable(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return dict(runtime=Runtime(), out_dir=out_dir, model=model, optimizer=optimizer,
                train_loader=TrainLoader(12, random_batches, 2), model_config=config, tokenizer=None,
                hyperparameters={})


class SimulatedCrash(Exception):
    pass


@pytest.mark.parametrize("kind", ["full", "sharded", "lora"])
def test_a_save_killed_half_way_leaves_nothing_resume_would_take(tmp_path, monkeypatch, kind):
    """A save that dies after writing its weights leaves only a hidden temporary directory: resume takes
    the previous checkpoint, the next save deletes the leftover, and final/ is complete or absent."""
    out_dir = tmp_path / kind
    checkpointer = Checkpointer(**checkpointer_parts(out_dir, lora=kind == "lora"), format=kind)
    checkpointer.save(TrainState(step=1))

    class CrashMidSave(callbacks.Callback):
        def on_checkpoint_written(self, directory: Path) -> None:
            raise SimulatedCrash

    with faults.installed(CrashMidSave()):
        with pytest.raises(SimulatedCrash):
            checkpointer.save(TrainState(step=2))
        assert leftovers(out_dir) and not (out_dir / "step-00000002").exists()
        assert resolve_resume("auto", out_dir, None) == out_dir / "step-00000001"

    checkpointer.save(TrainState(step=2))
    assert leftovers(out_dir) == []
    assert layout.latest_checkpoint(out_dir) == out_dir / "step-00000002"
    if kind != "full":  # sharded and LoRA write final/ anew (full links the step's files)
        with faults.installed(CrashMidSave()):
            with pytest.raises(SimulatedCrash):
                checkpointer.save_final(TrainState(step=2))
        assert not (out_dir / "final").exists() and leftovers(out_dir)
    checkpointer.save_final(TrainState(step=2))
    assert layout.is_complete(out_dir / "final") and leftovers(out_dir) == []
    if kind != "full":  # rewriting final/ that dies half-way keeps the complete old one
        with faults.installed(CrashMidSave()):
            with pytest.raises(SimulatedCrash):
                checkpointer.save_final(TrainState(step=2))
        assert layout.is_complete(out_dir / "final")


@pytest.mark.parametrize("kind", ["full", "sharded", "lora", "async"])
def test_weights_with_nan_are_never_written(tmp_path, kind):
    """Nor lost: an asynchronous save still under way becomes the checkpoint that the refusal says to resume from."""
    out_dir = tmp_path / kind
    parts = checkpointer_parts(out_dir, lora=kind == "lora")
    checkpointer = Checkpointer(**parts, format="sharded" if kind == "async" else kind, async_save=kind == "async")
    checkpointer.save(TrainState(step=1))
    with torch.no_grad():
        next(p for p in parts["model"].parameters() if p.requires_grad)[0, 0] = float("nan")
    for save in (checkpointer.save, checkpointer.save_final):
        with pytest.raises(NonFiniteWeightsError, match="refusing to write .* hold NaN or inf"):
            save(TrainState(step=2))
        assert layout.latest_checkpoint(out_dir) == out_dir / "step-00000001"
    assert [p.name for p in out_dir.iterdir()] == ["step-00000001"]


def test_keep_last_deletes_older_checkpoints_once_a_newer_one_is_complete(tmp_path, model_file):
    from llmtrain.cli import main

    out_dir = tmp_path / "keep"
    main([*resumable_args(model_file, out_dir), "--train.max_steps", "5", "--train.save_interval", "1",
          "--train.global_batch_size", "4", "--train.keep_last", "2"])
    assert [p.name for _, p in layout.list_checkpoints(out_dir)] == ["step-00000004", "step-00000005"]
    assert leftovers(out_dir) == []
    final = load_file(str(out_dir / "final" / "model.safetensors"))
    newest = load_file(str(out_dir / "step-00000005" / "model.safetensors"))
    assert all(torch.equal(final[name], newest[name]) for name in newest)
    # Only complete checkpoints count and go, and never the one just written (here: an older one).
    (out_dir / "step-00000009").mkdir()
    assert files.prune_checkpoints(out_dir, 1, keep=out_dir / "step-00000004") == []
    assert files.prune_checkpoints(out_dir, 1) == [out_dir / "step-00000004"]
    assert sorted(p.name for p in out_dir.glob("step-*")) == ["step-00000005", "step-00000009"]


# -------------------------------------------------------------------------- data: exactly once
class RecordingLoader(TrainLoader):
    """A TrainLoader that records (global position, sample indices) of each micro-batch it serves, and
    at chosen positions signals its own process or crashes."""

    def __init__(self, num_samples: int, record: list, interrupt_at: dict):
        super().__init__(num_samples, random_batches, micro_batch_size=2, seed=7)
        self.record, self.interrupt_at = record, interrupt_at
        # Batches are made ahead in a thread; what counts is what is served, named by its contents.
        every = random_batches(range(num_samples))["input_ids"]
        self.sample_of = {tuple(row.tolist()): i for i, row in enumerate(every)}

    def __next__(self):
        action = self.interrupt_at.pop(self.samples_consumed, None)
        if action == "crash":
            raise SimulatedCrash(f"killed at sample {self.samples_consumed}")
        if action is not None:
            os.kill(os.getpid(), action)  # the real path: handler, stop vote, checkpoint, Preempted
        position = self.samples_consumed
        batch = super().__next__()
        self.record.append((position, [self.sample_of[tuple(row.tolist())] for row in batch["input_ids"]]))
        return batch


def train_epochs(out_dir: Path, record: list, interrupt_at: dict) -> None:
    """3 epochs over 11 samples (accumulation 2 × micro batch 2), continuing out_dir's newest checkpoint."""
    parts = checkpointer_parts(out_dir)
    loader = parts["train_loader"] = RecordingLoader(11, record, interrupt_at)
    checkpointer = Checkpointer(**parts)
    state = TrainState()
    if (latest := layout.latest_checkpoint(out_dir)) is not None:
        checkpointer.load(latest, state)
    train = TrainArgs(global_batch_size=4, micro_batch_size=2, epochs=3, lr_warmup_steps=1, save_interval=2)
    fit(Fit(runtime=parts["runtime"], model=parts["model"], optimizer=parts["optimizer"], train_loader=loader,
            val_loader=None, train=train, eval=EvalArgs(initial_validation=False), plan=batch_plan(train, 1),
            horizon=plan_horizon(train, 4 * 8, loader.samples_per_epoch), precision=Precision("32-true"),
            save_checkpoint=checkpointer.save, save_final=checkpointer.save_final, state=state))


def samples_consumed(checkpoint) -> int:
    return torch.load(checkpoint / layout.STATE_FILE, weights_only=True)["data"]["samples_consumed"] if checkpoint else 0


@pytest.mark.slow
def test_every_sample_of_an_epoch_is_trained_exactly_once_however_often_the_run_stops(tmp_path):
    """Signals mid-epoch and at an epoch boundary, a crash after a checkpoint: the micro-batches of the
    checkpointed steps, joined over all attempts, are the uninterrupted run's, each epoch a permutation of
    the samples; the final weights are the uninterrupted run's too."""
    expected: list = []
    train_epochs(tmp_path / "straight", expected, {})
    out_dir = tmp_path / "interrupted"
    trained: list = []
    interruptions = [{10: signal.SIGUSR1}, {22: signal.SIGTERM}, {30: "crash"}, {30: signal.SIGUSR1}, {}]
    for interrupt_at in interruptions:
        start = samples_consumed(layout.latest_checkpoint(out_dir))
        record: list = []
        with contextlib.suppress(Preempted, SimulatedCrash):
            train_epochs(out_dir, record, interrupt_at)
        assert not interrupt_at, "the interruption did not happen"
        # Only what a checkpoint covers counts: the crashed attempt's steps after step 6 are trained again.
        end = samples_consumed(layout.latest_checkpoint(out_dir))
        trained += [entry for entry in record if start <= entry[0] < end]
    assert [step_of(p) for _, p in layout.list_checkpoints(out_dir)] == [2, 3, 4, 6, 8, 9]
    assert trained == expected
    assert [position for position, _ in trained] == list(range(0, 36, 2))  # 9 steps of 4 samples
    samples = [sample for _, batch in trained for sample in batch]
    for epoch in range(3):
        assert sorted(samples[epoch * 11:(epoch + 1) * 11]) == list(range(11)), f"epoch {epoch}"
    expected_weights = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    weights = load_file(str(out_dir / "final" / "model.safetensors"))
    for name, tensor in expected_weights.items():
        assert torch.equal(weights[name], tensor), name
