"""Tiny training runs through the real command line, shared by the end-to-end tests.

- ``pretrain_args`` / ``finetune_args``: the command lines of a tiny in-process run on the built-in data;
- ``resumable_args`` and the ``launcher`` fixture: a 2-process tiny pretraining run (``--devices 2``) that saves every
  few steps, started as a real process whose output is read as it comes (``Run``), to interrupt and resume;
- ``losses``, ``assert_same_weights``, ``step_of``: what a finished run left behind.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmtrain.checkpoint import layout

from conftest import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 20
SAVE_INTERVAL = 4
STOPPED = re.compile(r"stopping after step (\d+): (got SIG\w+|another rank got a stop signal)")


def pretrain_args(model_file, out_dir, *extra):
    """A tiny one-process pretraining run on the built-in stories (4 sequences of 32 tokens a step)."""
    return ["pretrain", "--model_config", str(model_file), "--out_dir", str(out_dir),
            "--data", "BuiltinStories", "--data.num_documents", "400", "--data.num_val_documents", "40",
            "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_seq_length", "32",
            "--train.lr_warmup_steps", "2", "--train.log_interval", "1", "--eval.interval", "100",
            "--eval.max_iters", "2", "--optimizer", "AdamW", "--optimizer.lr", "0.003", *extra]


def finetune_args(recipe, base_model, out_dir, *extra):
    return [recipe, str(base_model), "--out_dir", str(out_dir), "--data", "BuiltinInstruct",
            "--data.num_train", "200", "--data.num_val", "16", "--train.global_batch_size", "4",
            "--train.micro_batch_size", "2", "--train.max_seq_length", "128", "--train.lr_warmup_steps", "1",
            "--train.log_interval", "1", "--eval.interval", "100", "--eval.max_iters", "2",
            "--optimizer", "AdamW", "--optimizer.lr", "0.01", *extra]


def losses(out_dir):
    with open(Path(out_dir) / "metrics.csv") as handle:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(handle) if r["loss"]}


@pytest.fixture(autouse=True)
def shared_cache(tmp_path_factory, monkeypatch):
    """One token cache for the module, for in-process runs and (through the environment) for subprocesses."""
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "shared-cache"))


def resumable_args(model_file: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["pretrain", "--model_config", str(model_file), "--out_dir", str(out_dir), "--data", "BuiltinStories",
            "--data.num_documents", "400", "--data.num_val_documents", "40", "--train.global_batch_size", "8",
            "--train.micro_batch_size", "2", "--train.max_seq_length", "32", "--train.lr_warmup_steps", "2",
            "--train.log_interval", "1", "--eval.interval", "100", "--eval.max_iters", "2", "--optimizer", "AdamW",
            "--optimizer.lr", "0.003", "--train.max_steps", str(MAX_STEPS), "--train.save_interval",
            str(SAVE_INTERVAL), *extra]


@pytest.fixture
def model_file(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.getbasetemp() / "tiny-reliable.yaml")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), read from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            with open(f"/proc/{entry}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        children = parents.get(queue.pop(), [])
        found += children
        queue += children
    return found


class Run:
    """One command (the llmtrain launcher, or torchrun) whose output is collected line by line as it comes."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        """The first output line that matches ``pattern``, waiting for it to come."""
        regex, deadline = re.compile(pattern), time.monotonic() + timeout
        while True:
            for line in list(self.lines):
                if match := regex.search(line):
                    return match
            if self.proc.poll() is not None and not self.reader.is_alive():
                pytest.fail(f"the run ended (exit {self.proc.returncode}) before printing {pattern!r}:\n{self.output}")
            if time.monotonic() > deadline:
                pytest.fail(f"no line matched {pattern!r} within {timeout}s:\n{self.output}")
            time.sleep(0.02)

    def wait_for_files(self, directory: Path, pattern: str, count: int = 1, timeout: float = 300) -> list[Path]:
        """At least ``count`` files matching ``pattern`` under ``directory``, waiting while the run goes on."""
        deadline = time.monotonic() + timeout
        while len(found := sorted(directory.glob(pattern))) < count:
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended (exit {self.proc.returncode}) before {pattern} appeared:\n{self.output}")
            if time.monotonic() > deadline:
                pytest.fail(f"{pattern} did not appear within {timeout}s:\n{self.output}")
            time.sleep(0.02)
        return found

    def workers(self, count: int = 2) -> dict[int, int]:
        """Rank -> pid of the workers below this process (read from their environment)."""
        ranks: dict[int, int] = {}
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/environ", "rb") as handle:
                    variables = dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)
                if b"RANK" in variables and b"LOCAL_RANK" in variables:
                    ranks[int(variables[b"RANK"])] = pid
        assert len(ranks) == count, f"expected {count} workers, found {ranks}"
        return ranks

    def kill_9(self) -> None:
        """SIGKILL the launcher and every worker at once, like a machine that loses power."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.reader.join(timeout=10)

    def finish(self, timeout: float = 600) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_9()
            pytest.fail(f"did not finish within {timeout}s:\n{self.output}")
        self.reader.join(timeout=10)
        return self.proc.returncode


@pytest.fixture
def launcher(dist_env, model_file):
    """``launcher.start(out_dir, *flags, env=...)`` starts a 2-process tiny pretraining run; leftovers die at teardown."""
    runs: list[Run] = []

    class Launcher:
        env = dist_env

        def start(self, out_dir: Path, *extra: str, env: dict | None = None, torchrun: list[str] | None = None) -> Run:
            prefix = [sys.executable, "-m", *(["torch.distributed.run", *torchrun] if torchrun else []), "llmtrain"]
            command = [*prefix, *resumable_args(model_file, out_dir, "--devices", "2", *extra)]
            runs.append(Run(command, {**dist_env, **(env or {})}))
            return runs[-1]

        def complete(self, out_dir: Path, *extra: str, env: dict | None = None) -> Run:
            run = self.start(out_dir, *extra, env=env)
            assert run.finish() == 0, run.output
            return run

    yield Launcher()
    for run in runs:
        if run.proc.poll() is None:
            run.kill_9()


def assert_same_weights(out_dir: Path, expected: dict[str, torch.Tensor]) -> None:
    weights = load_file(str(Path(out_dir) / "final" / "model.safetensors"))
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), f"{name} differs from the uninterrupted run's"


def step_of(checkpoint: Path) -> int:
    return json.loads((checkpoint / layout.MARKER_FILE).read_text())["step"]
