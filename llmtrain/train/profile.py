"""``--profile``: torch.profiler over a window of optimizer steps, written to ``out_dir/profile/``.

Every rank N writes, once the window's last step is done (or when the run stops or fails inside the
window, an out-of-memory error included):

- ``rankN.json``: the Chrome trace of the window (operators, and kernels on CUDA). Open it in
  https://ui.perfetto.dev or chrome://tracing.
- ``operators_rankN.txt``: the top operators by their own time (``key_averages().table()``); rank 0
  also prints its table at the end of the run.
- ``memory_rankN.pickle``, on CUDA with ``--profile.memory`` (the default): every allocation and free since
  the profiler started (the window and its warmup step, below) with its stack, for https://pytorch.org/memory_viz.

Steps are counted as the log counts them, from 1 across resumes. The profiler starts one step before
the window when this run trains that step, and records nothing during it ("warmup", torch.profiler's
word), so the profiler's own start-up is not in the trace. With ``--profile`` off, no profiler exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch

from llmtrain.args import ProfileArgs
from llmtrain.callbacks import Callback

PROFILE_DIR = "profile"
TABLE_ROWS = 20
MEMORY_HISTORY_ENTRIES = 100_000
"""Allocations and frees kept for the CUDA snapshot: a few KB each, so at most some hundred MB."""


def build_profiler(args: ProfileArgs, out_dir: Path, rank: int, device: torch.device, first_step: int,
                   last_step: int, say: Callable[[str], Any]) -> Optional["StepProfiler"]:
    """The profiler of a run that trains steps ``first_step`` to ``last_step``; None when a resumed run is
    already past the window (it says so: a requeued job reruns the same command with --resume auto)."""
    start, end = args.window(first_step, last_step)
    if end < first_step:
        say(f"--profile: steps {start}-{end} were trained before this run resumed after step {first_step - 1}; "
            "nothing is profiled")
        return None
    if start < first_step:
        say(f"--profile: this run resumes after step {first_step - 1}; profiling steps {first_step}-{end} "
            f"of {start}-{end}")
    window = range(max(start, first_step), end + 1)
    return StepProfiler(args, window, warmup=int(window.start > first_step), directory=Path(out_dir) / PROFILE_DIR,
                        rank=rank, device=device)


def takes_memory_snapshot(args: ProfileArgs, device: torch.device) -> bool:
    """CUDA's allocator records the history a memory snapshot needs; no other device's does."""
    return args.memory and device.type == "cuda"


class StepProfiler(Callback):
    """torch.profiler from the start of step ``window.start`` to the end of step ``window[-1]`` (inclusive)."""

    def __init__(self, args: ProfileArgs, window: range, warmup: int, directory: Path, rank: int,
                 device: torch.device) -> None:
        self.args, self.window, self.warmup = args, window, warmup
        self.directory, self.rank, self.device = directory, rank, device
        self.snapshot = takes_memory_snapshot(args, device)
        self.profiler: Optional[torch.profiler.profile] = None
        self.table = ""
        self.console: Any = None

    @property
    def trace_path(self) -> Path:
        return self.directory / f"rank{self.rank}.json"

    @property
    def table_path(self) -> Path:
        return self.directory / f"operators_rank{self.rank}.txt"

    @property
    def snapshot_path(self) -> Path:
        return self.directory / f"memory_rank{self.rank}.pickle"

    def on_fit_start(self, job: Any) -> None:
        self.console = job.console

    def on_step_start(self, step: int) -> None:
        if step == self.window.start - self.warmup:
            self._start()

    def on_step_end(self, step: int) -> None:
        if self.profiler is None:
            return
        self.profiler.step()  # after the window's last step, this writes the trace (on_trace_ready)
        if step == self.window[-1]:
            self._stop()

    def on_fit_end(self) -> None:
        if self.profiler is not None:  # the run stopped (or failed) inside the window: keep what was recorded
            self._stop()
        if self.table and self.console is not None:
            files = "rankN.json (traces: open in https://ui.perfetto.dev), operators_rankN.txt (tables like this one)"
            if self.snapshot:
                files += ", memory_rankN.pickle (snapshots: open in https://pytorch.org/memory_viz)"
            self.console.print(f"profile of steps {self.window.start}-{self.window[-1]} in {self.directory}: {files}\n"
                               f"{self.table}")

    def _start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=0, warmup=self.warmup, active=len(self.window), repeat=1)
        self.profiler = torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self._write, record_shapes=self.args.record_shapes,
            profile_memory=self.args.memory, with_stack=self.args.with_stack)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.profiler.start()

    def _stop(self) -> None:
        profiler, self.profiler = self.profiler, None
        if self.snapshot:  # first: after an out-of-memory error it is the file that says why
            torch.cuda.memory._dump_snapshot(str(self.snapshot_path))
            torch.cuda.memory._record_memory_history(enabled=None)
        profiler.stop()  # inside the window this writes what was recorded (on_trace_ready)

    def _write(self, profiler: torch.profiler.profile) -> None:
        """The trace and the operator table of the window (torch.profiler's on_trace_ready)."""
        profiler.export_chrome_trace(str(self.trace_path))
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages(group_by_input_shape=self.args.record_shapes).table(
            sort_by=sort_by, row_limit=TABLE_ROWS)
        self.table_path.write_text(table + "\n")
        self.table = table
