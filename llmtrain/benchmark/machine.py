"""The machine a benchmark runs on: its device's name, matmul peak, threads per process, load, and the commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

import torch

from llmtrain.flops import measure_matmul_peak

ROOT = Path(__file__).resolve().parents[2]
"""The source tree llmtrain runs from (in an installed copy, no git work tree: the commit is then "unknown")."""


def device_name(device_type: str) -> str:
    """The run's device: the GPU's name, or the CPU's (asking CUDA only for a GPU run)."""
    if device_type == "cuda":
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "cpu"


def git_commit() -> str:
    """Short hash of HEAD, with ``-dirty`` when the working tree has changes (the numbers are not HEAD's)."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=7"],
                              capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def threads_per_process(devices: int) -> int:
    """The CPU threads each training process runs with: this process's, or the launcher's share per worker."""
    if devices == 1:
        return torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    from llmtrain.distributed.supervise import _usable_cores

    return max(1, _usable_cores() // devices)  # what the launcher gives each worker


def _matmul_peak(dtype: torch.dtype, threads: int, device: str) -> tuple[float, int]:
    """The matmul peak, measured in this process with the threads each training process has."""
    all_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure_matmul_peak(dtype, device=device)
    finally:
        torch.set_num_threads(all_threads)


def _load_average() -> Optional[float]:
    """The machine's 1-minute load average at the end of the run: numbers taken next to other work are noisy."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None
