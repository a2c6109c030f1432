"""Faults that the tests inject into training runs, as llmtrain callbacks (llmtrain.callbacks).

In the test's own process, install them with ``installed(...)`` around the call that trains. In the
processes of a run that a test starts (spawned workers, torchrun), pass ``environment(...)`` to the
command: ``LLMTRAIN_CALLBACKS`` names :func:`from_env`, which builds the faults described in
``TEST_FAULTS`` (JSON), and ``PYTHONPATH`` gains this folder so that those processes import this module.

NanLoss and CrashBeforeStep act on the last rank only, so the other ranks must follow.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sys
import time
import zipfile
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from llmtrain import callbacks

FAULTS_ENV = "TEST_FAULTS"
TESTS_DIR = Path(__file__).resolve().parent


class LastRankFault(callbacks.Callback):
    """A fault that only the last rank commits."""

    rank, last_rank = 0, True  # until fit() starts: a single process

    def on_fit_start(self, job) -> None:
        self.rank = job.runtime.rank
        self.last_rank = job.runtime.rank == job.runtime.world_size - 1


class NanLoss(LastRankFault):
    """The loss of the given optimizer steps is multiplied by NaN before its backward pass."""

    def __init__(self, steps: Iterable[int]) -> None:
        self.steps = frozenset(steps)

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if self.last_rank and step in self.steps else loss


class CrashBeforeStep(LastRankFault):
    """The process ends with ``os._exit(1)`` before the given step, on the first attempt only
    (TORCHELASTIC_RESTART_COUNT unset or 0), so that a restarted group gets through."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_start(self, step: int) -> None:
        if (step == self.step and self.last_rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            print(f"[rank {self.rank}] test fault: crashing before step {step}", file=sys.stderr, flush=True)
            os._exit(1)


class FreezeBeforeStep(LastRankFault):
    """The last rank stops before the given step and never goes on (a hung GPU, a stuck filesystem read): the
    others wait for it in their next collective until --dist_timeout ends it.

    NOTE: the frozen rank dies of the SIGTERM the launcher stops it with once another rank failed, as a rank stuck
    outside Python would not: llmtrain's own SIGTERM handler only sets a flag for the next step, which a rank asleep
    here never reaches, so the launcher would wait its 30 s grace before SIGKILL, and the test with it, for nothing
    the test checks (the error line is the failing rank's, written before the launcher stops the others)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_start(self, step: int) -> None:
        if step == self.step and self.last_rank:
            print(f"[rank {self.rank}] test fault: freezing before step {step}", file=sys.stderr, flush=True)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(3600)


class SlowSave(callbacks.Callback):
    """Every save sleeps after its files are written and before its marker, so that a test can kill the run
    in the middle of a save."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_checkpoint_written(self, directory: Path) -> None:
        time.sleep(self.seconds)


class DiskFull(callbacks.Callback):
    """The disk fills during every save's weights: a safetensors file gets its first bytes, then its write fails with
    ENOSPC, as on a full disk. Through the real save path, on every rank (only those that write weights fail)."""

    def on_fit_start(self, job) -> None:
        from llmtrain.checkpoint import files

        def fill_the_disk(tensors: dict, path: Path) -> None:
            Path(path).write_bytes(bytes(4096))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        files.save_safetensors = files.save_weights_checksummed = fill_the_disk  # final/'s writer, a step's


FLIPPED = 64


def flip(path: Path, offset: int) -> None:
    """Invert ``FLIPPED`` bytes of ``path`` from ``offset``: its size stays what the marker recorded."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        data = bytes(byte ^ 0xFF for byte in handle.read(FLIPPED))
        handle.seek(offset)
        handle.write(data)


def tensor_data_offset(path: Path) -> int:
    """Where the bytes of the largest tensor in ``path`` start, a little way in: not its header, nor its index."""
    if path.suffix == ".safetensors":
        header_size = int.from_bytes(path.read_bytes()[:8], "little")
        return 8 + header_size + (path.stat().st_size - 8 - header_size) // 2
    if path.suffix == ".pt":  # a zip of stored (uncompressed) entries, one per tensor storage
        with zipfile.ZipFile(path) as archive:
            entry = max((info for info in archive.infolist() if "/data/" in info.filename), key=lambda i: i.file_size)
        local_header = path.read_bytes()[entry.header_offset:entry.header_offset + 30]
        name_length, extra_length = (int.from_bytes(local_header[at:at + 2], "little") for at in (26, 28))
        return entry.header_offset + 30 + name_length + extra_length + entry.file_size // 2
    return path.stat().st_size // 2  # a DCP shard: nothing but tensor bytes


def from_env() -> callbacks.Callbacks:
    """The faults that ``$TEST_FAULTS`` describes (see :func:`environment`); what LLMTRAIN_CALLBACKS names."""
    spec = json.loads(os.environ.get(FAULTS_ENV, "{}"))
    faults: list[callbacks.Callback] = []
    if spec.get("nan_steps"):
        faults.append(NanLoss(spec["nan_steps"]))
    if spec.get("crash_before_step") is not None:
        faults.append(CrashBeforeStep(spec["crash_before_step"]))
    if spec.get("slow_save_s") is not None:
        faults.append(SlowSave(spec["slow_save_s"]))
    if spec.get("freeze_before_step") is not None:
        faults.append(FreezeBeforeStep(spec["freeze_before_step"]))
    if spec.get("disk_full"):
        faults.append(DiskFull())
    return callbacks.Callbacks(faults)


def environment(nan_steps: Iterable[int] = (), crash_before_step: Optional[int] = None,
                slow_save_s: Optional[float] = None, disk_full: bool = False,
                freeze_before_step: Optional[int] = None) -> dict[str, str]:
    """Environment variables that install these faults in every training process of a run started with them."""
    spec = {"nan_steps": sorted(nan_steps), "crash_before_step": crash_before_step, "slow_save_s": slow_save_s,
            "disk_full": disk_full, "freeze_before_step": freeze_before_step}
    return {callbacks.CALLBACKS_ENV: "faults:from_env", FAULTS_ENV: json.dumps(spec),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}


@contextlib.contextmanager
def installed(*faults: callbacks.Callback) -> Iterator[None]:
    """Install the faults in this process for the duration of the block."""
    for fault in faults:
        callbacks.register(fault)
    try:
        yield
    finally:
        for fault in faults:
            callbacks.unregister(fault)
