"""The numbers a run logs: :class:`LogInterval` (one log line's loss and throughput), memory, and rank 0's logging."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from llmtrain.flops import real_tokens
from llmtrain.train.step import PHASES

if TYPE_CHECKING:
    from llmtrain.train.loop import Fit
    from llmtrain.train.step import StepResult


class LogInterval:
    """The numbers of one log line, summed step by step on the device and read once, at the log step."""

    def __init__(self, job: Fit) -> None:
        self.job = job
        device = job.runtime.device
        self.loss_sum = torch.zeros((), device=device)  # summed token losses of the steps taken (not skipped)
        self.target_sum = torch.zeros((), device=device)
        self.updates = torch.zeros((), device=device)  # optimizer steps taken
        self._restart()

    def _restart(self) -> None:
        self.loss_sum.zero_()
        self.target_sum.zero_()
        self.updates.zero_()
        self.started, self.tokens = time.perf_counter(), 0
        self.real_tokens = 0  # this rank's input tokens that are not padding
        self.data_wait = 0.0  # seconds spent waiting for batches
        self.paused_seconds = 0.0  # seconds of validation, which the interval's throughput leaves out

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave what runs inside out of the interval's seconds (validation)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - started

    def fetch(self, batches: Iterator[dict], count: int) -> list[dict]:
        """The next ``count`` micro-batches, timing the wait for them."""
        started = time.perf_counter()
        with torch.profiler.record_function(PHASES["data"]):
            micro_batches = [next(batches) for _ in range(count)]
        self.data_wait += time.perf_counter() - started
        return micro_batches

    def add(self, result: StepResult, tokens: int, micro_batches: list[dict]) -> None:
        """Count a step in (its losses only if the optimizer stepped), its input tokens over all ranks and the
        real (not padding) tokens of this rank's ``micro_batches``."""
        if self.job.runtime.counts_batch:  # one rank of each data-parallel shard (Runtime.counts_batch)
            self.loss_sum += torch.where(result.stepped, result.loss_sum, 0.0)
            self.real_tokens += sum(real_tokens(batch) for batch in micro_batches)
        self.target_sum += torch.where(result.stepped, result.target_tokens.float(), 0.0)
        self.updates += result.stepped
        self.tokens += tokens

    def log(self, lr: float, grad_norm: torch.Tensor, extra: Optional[dict] = None) -> None:
        """Log the mean loss and throughput since the last log (if any step was taken), with ``extra`` metrics (a
        mixture of experts' balance); start the next interval."""
        job = self.job
        # One all-reduce for both sums: the losses, and the real tokens that MFU counts.
        sums = torch.stack([self.loss_sum.double(), torch.tensor(float(self.real_tokens), dtype=torch.float64,
                                                                 device=self.loss_sum.device)])
        job.runtime.all_reduce(sums)
        if self.updates.item():  # the same on every rank: the skip decision is
            loss = (sums[0] / self.target_sum.clamp(min=1)).item()
            seconds = time.perf_counter() - self.started - self.paused_seconds
            metrics = _step_metrics(job, loss, lr, float(grad_norm), self.tokens / seconds, sums[1].item() / seconds)
            metrics["data_wait_fraction"] = self.data_wait / seconds
            metrics.update(data_metrics(job.train_loader))
            metrics.update(extra or {})
            log_metrics(job, metrics)
        self._restart()


def _step_metrics(job: Fit, loss: float, lr: float, grad_norm: float, tokens_per_sec: float,
                  real_tokens_per_sec: float) -> dict:
    """One log line's numbers. MFU counts the real tokens: padding costs FLOPs that do no work."""
    state = job.state
    per_device = tokens_per_sec / job.runtime.world_size
    mfu = None
    if job.flops_per_token and job.peak_flops_per_device:
        mfu = real_tokens_per_sec / job.runtime.world_size * job.flops_per_token / job.peak_flops_per_device
    remaining = max(0, job.horizon.total_steps - state.step)
    seconds_per_step = state.elapsed_s / max(1, state.step)
    return {"step": state.step, "tokens": state.tokens, "epoch": job.train_loader.epoch, "loss": loss,
            "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_device": per_device, "mfu": mfu, **interval_memory(job.runtime.device),
            "elapsed_s": state.elapsed_s, "eta_s": remaining * seconds_per_step}


def data_metrics(train_loader: Any) -> dict:
    """What the loader reports about the data seen so far (a mixture: ``data/tokens/<source>``); most report nothing."""
    report = getattr(train_loader, "metrics", None)
    return report() if report is not None else {}


def log_metrics(job: Fit, metrics: dict, line: Optional[str] = None) -> None:
    """Rank 0 hands ``metrics`` to every logger, and prints ``line`` or updates the progress line."""
    if not job.runtime.is_main:
        return
    for logger in job.loggers:
        logger.log(metrics)
    if line is not None:
        job.console.print(line)
    else:
        job.console.update(metrics, metrics["step"])


def interval_memory(device: torch.device) -> dict:
    """The memory numbers of a log line; on CUDA, for the interval since the previous line.

    CUDA: the peak of allocated (``peak_memory_gb``) and reserved (``reserved_memory_gb``) memory since the
    last call, whose peaks it then resets, and ``alloc_retries``: the allocations so far that found no free
    block until the caching allocator had given its cache back and tried again (each one a stall; many of
    them mean memory is nearly full). CPU: this process's peak resident set size, over its lifetime (Linux
    cannot reset it).
    """
    if device.type != "cuda":
        import resource

        return {"peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    stats = torch.cuda.memory_stats(device)
    torch.cuda.reset_peak_memory_stats(device)
    return {"peak_memory_gb": stats.get("allocated_bytes.all.peak", 0) / 2**30,
            "reserved_memory_gb": stats.get("reserved_bytes.all.peak", 0) / 2**30,
            "alloc_retries": stats.get("num_alloc_retries", 0)}
