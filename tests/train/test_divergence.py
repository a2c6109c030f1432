"""A diverging run never replaces its good checkpoints (issue 42, case 2).

No checkpoint is written while a streak of NaN or inf gradient norms is open (interval saves, the end of the run,
a stop signal); a checkpoint is good once a later step was finite; --train.keep_last spares the last good one; the
message names it with the exact command that resumes it at a lower learning rate, and --resume auto picks it.
"""

from __future__ import annotations

import csv
import math
import os
import re
import shlex
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import faults
from conftest import ListLoader, write_tiny_model
from llmtrain.args import EvalArgs, TrainArgs, batch_plan
from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.checkpointer import NonFiniteWeightsError
from llmtrain.checkpoint.resume import resolve_resume
from llmtrain.config import Config
from llmtrain.distributed.runtime import Runtime
from llmtrain.model import GPT
from llmtrain import callbacks
from llmtrain.train.horizon import plan_horizon
from llmtrain.train.loop import Fit, fit
from llmtrain.train.nonfinite import NonFiniteError, Rewind
from llmtrain.precision import Precision
from llmtrain.signals import Preempted

CONFIG = dict(name="diverge-test", vocab_size=64, padding_multiple=64, block_size=16, n_layer=1, n_head=2, n_embd=16,
              n_query_groups=1, intermediate_size=32)


def fit_with_nan(nan_steps: list[int], max_steps: int, *more: callbacks.Callback, max_nonfinite: int = 5,
                 refuse_step: int = 0):
    """fit() a tiny model saving every step, with NaN losses at ``nan_steps``; returns (the job, what it saved).
    The save of ``refuse_step`` raises as the checkpointer does for weights with NaN or inf."""
    torch.manual_seed(0)
    model = GPT(Config(**CONFIG))
    model.init_weights()
    samples = [(torch.randint(0, 64, (12,)), torch.randint(0, 64, (12,))) for _ in range(2 * max_steps)]
    train = TrainArgs(global_batch_size=2, micro_batch_size=1, max_steps=max_steps, lr_warmup_steps=0,
                      save_interval=1, log_interval=1, max_nonfinite_steps=max_nonfinite)
    saved = []

    def save(state):
        if state.step == refuse_step:
            raise NonFiniteWeightsError(f"refusing to write out/step-{state.step}: 1 weight tensor(s) hold NaN or inf")
        saved.append(state.step)
        return Path(f"out/step-{state.step}")

    job = Fit(runtime=Runtime(), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
              train_loader=ListLoader(samples, 1), val_loader=None, train=train,
              eval=EvalArgs(initial_validation=False, final_validation=False), plan=batch_plan(train, 1),
              horizon=plan_horizon(train, 24, None), precision=Precision("32-true"), save_checkpoint=save,
              save_final=lambda state: saved.append("final"), callbacks=[faults.NanLoss(nan_steps), *more],
              rewind=Rewind(command=["llmtrain", "pretrain", "--optimizer.lr", "0.1"]))
    return job, saved


def test_no_checkpoint_while_the_streak_is_open_and_the_message_names_the_last_good_one():
    """Steps 3-5 NaN: the saves of steps 3 and 4 are skipped. Step 2's weights gave the NaN of step 3, so the last
    good checkpoint is step 1's, the one the advised command resumes at a tenth of the rate."""
    job, saved = fit_with_nan([3, 4, 5], max_steps=8, max_nonfinite=3)
    with pytest.raises(NonFiniteError, match=r"steps 3-5.*no checkpoint was written during them") as error:
        fit(job)
    assert saved == [1, 2]
    assert "The last good checkpoint is out/step-1; resume from it with a lower learning rate: llmtrain pretrain " \
           "--resume out/step-1 --optimizer.lr 0.01" in str(error.value)


def test_a_run_that_ends_in_a_streak_writes_neither_a_checkpoint_nor_final():
    job, saved = fit_with_nan([3], max_steps=3)
    with pytest.raises(NonFiniteError, match=r"reached its end \(reached --train.max_steps 3\) in a streak of 1 "
                                             r"steps.*neither a checkpoint nor final/"):
        fit(job)
    assert saved == [1, 2]


def test_weights_gone_nan_or_inf_stop_the_run_in_one_line_naming_the_last_good_checkpoint():
    """Weights that an update with a finite gradient norm made non-finite: the save is refused (no checkpoint holds
    them), and the run stops as for a streak, with the command that resumes the checkpoint before."""
    job, saved = fit_with_nan([], 6, refuse_step=3)
    with pytest.raises(NonFiniteError, match=r"refusing to write out/step-3: .*The last good checkpoint is "
                                             r"out/step-2; .*--resume out/step-2 --optimizer.lr 0.01$"):
        fit(job)
    assert saved == [1, 2]


class TermAfterStep(callbacks.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, step: int) -> None:
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_stop_signal_during_a_streak_exits_75_without_a_checkpoint():
    """SIGTERM after step 2 stops the run after step 3 (the ranks vote as a step starts), both of them NaN."""
    job, saved = fit_with_nan([2, 3], 6, TermAfterStep(2))
    with pytest.raises(Preempted):
        fit(job)
    assert saved == [1]


def test_the_advised_command_replaces_the_flags_it_sets():
    command = ["llmtrain", "pretrain", "--out_dir", "out", "--resume", "auto", "--optimizer.lr=0.003",
               "--initial_checkpoint_dir", "base model", "--train.min_lr", "0.001", "--train.max_steps", "9"]
    advice = Rewind(checkpoint=Path("out/step-00000008"), command=command).advice(0.003, 0.001)
    assert advice.endswith(": llmtrain pretrain --out_dir out --train.max_steps 9 --resume out/step-00000008 "
                           "--optimizer.lr 0.0003 --train.min_lr 0.0003")
    fresh = Rewind(command=command).advice(0.003, 0.0)
    assert fresh.startswith("No good checkpoint") and fresh.endswith(" --train.max_steps 9 --optimizer.lr 0.0003")


def test_keep_last_spares_the_last_good_checkpoint(tmp_path):
    for step in (2, 4, 6):
        directory = tmp_path / layout.step_dir_name(step)
        directory.mkdir()
        (directory / layout.STATE_FILE).write_bytes(b"")
        files.write_marker(directory, {"step": step})
    newest, good = tmp_path / "step-00000006", tmp_path / "step-00000004"
    assert files.prune_checkpoints(tmp_path, 1, keep=newest, good=good) == [tmp_path / "step-00000002"]
    assert [path for _, path in layout.list_checkpoints(tmp_path)] == [good, newest]


@pytest.mark.slow
def test_a_diverging_run_keeps_its_last_good_checkpoint_and_the_advised_command_resumes_it(tmp_path, monkeypatch):
    """The issue's run: --optimizer.lr 1e6 (warmed up over 1e5 steps, so that it diverges at step 11), a save every
    step and --train.keep_last 1. Step 10's weights give inf gradients: step 9's checkpoint is the last good one."""
    from llmtrain.cli import main

    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    model_file = write_tiny_model(tmp_path / "tiny.yaml")
    out_dir = tmp_path / "out"
    argv = ["pretrain", "--model_config", str(model_file), "--out_dir", str(out_dir), "--data", "BuiltinStories",
            "--data.num_documents", "400", "--data.num_val_documents", "40", "--train.global_batch_size", "4",
            "--train.micro_batch_size", "2", "--train.max_seq_length", "32", "--train.lr_warmup_steps", "100000",
            "--train.log_interval", "1", "--eval.interval", "100", "--eval.max_iters", "2",
            "--eval.initial_validation", "false", "--optimizer", "AdamW", "--optimizer.lr", "1e6",
            "--train.max_steps", "14", "--train.save_interval", "1", "--train.keep_last", "1",
            "--train.max_nonfinite_steps", "2"]
    with pytest.raises(NonFiniteError, match=r"steps 11-12") as error:
        main(argv)
    good = out_dir / "step-00000009"
    assert [path for _, path in layout.list_checkpoints(out_dir)] == [good]
    assert sorted(p.name for p in (out_dir / layout.REWOUND_DIR).iterdir()) == ["step-00000010"]
    for weights in out_dir.rglob(layout.MODEL_FILE):
        assert all(torch.isfinite(tensor).all() for tensor in load_file(str(weights)).values()), weights
    assert resolve_resume("auto", out_dir, None) == good
    advised = re.search(r"lower learning rate: (llmtrain .*) \(or lengthen", str(error.value)).group(1)
    assert advised == shlex.join(["llmtrain", *argv[:argv.index("--optimizer.lr")], *argv[argv.index("1e6") + 1:],
                                  "--resume", str(good), "--optimizer.lr", "100000"])

    main(shlex.split(advised)[1:])
    rows = [row for row in csv.DictReader(open(out_dir / "metrics.csv")) if row["loss"] and int(row["step"]) > 9]
    assert [int(row["step"]) for row in rows][-5:] == [10, 11, 12, 13, 14]
    assert all(math.isfinite(float(row["grad_norm"])) for row in rows[-5:])
    assert layout.is_complete(out_dir / layout.FINAL_DIR)
    assert [path.name for _, path in layout.list_checkpoints(out_dir)] == ["step-00000014"]
