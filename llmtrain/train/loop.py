"""``fit()``: the one training loop that every recipe calls.

A step gathers ``grad_accum_steps`` micro-batches, counts their target tokens over every
data-parallel rank, and scales each micro-batch's summed loss by that count, so padding,
accumulation and the number of ranks never change the gradient.

Faults. The token-count all-reduce at the start of each step also carries every rank's stop vote
(SIGTERM or SIGUSR1 received, see :mod:`llmtrain.train.signals`), so the ranks agree to stop after
the same step without a collective of their own; they checkpoint and raise ``Preempted`` (exit 75).
A step whose global gradient norm is NaN or inf (a NaN loss makes NaN gradients) changes nothing:
no optimizer step, gradients zeroed, the fp16 loss scale backed off; it is logged, and
``--train.max_nonfinite_steps`` of them in a row stop the run. The norm is already reduced over all
ranks (the DDP gradients are, the FSDP norm is all-reduced by clipping), so every rank decides alike.

Host-device synchronisation. A generic optimizer must be told on the host whether to step, so once
per step, after clipping, the host reads three numbers (whether the norm is finite, the step's token
count, the stop votes); the counts travel to the device asynchronously from pinned memory, so that
read is the step's only synchronisation, plus more at log, eval and checkpoint intervals.
Optimizers that take ``found_inf`` (fused Adam/AdamW, the default, without an fp16 loss scaler) read
nothing from the device between those intervals: the optimizer skips a non-finite step on the device
(its step counter too), the loss sums mask it out, and the norms of the steps since the last read are
read together at the next log or checkpoint step, where skipped steps are logged with their step
numbers and ``--train.max_nonfinite_steps`` is enforced (before any save, so the limit still holds
at every checkpoint; a skipped step leaves the weights finite anyway). The input-token counts, stop
votes and ``--train.max_time`` votes, known on the host, meet in an all-reduce over a CPU (gloo)
group after each step, so every rank still stops after the same step without waiting for the device.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch

from llmtrain.args import BatchPlan, EvalArgs, TrainArgs
from llmtrain.distributed.runtime import Runtime
from llmtrain.loss import IGNORE_INDEX
from llmtrain.train.loggers import Console
from llmtrain.train.precision import Precision
from llmtrain.train.schedule import WarmupDecaySchedule
from llmtrain.train.signals import PREEMPTED_EXIT_CODE, Preempted, StopRequest, catch_stop_signals


@dataclass
class TrainState:
    """Counters that a checkpoint restores; everything else is rebuilt from the arguments."""

    step: int = 0
    """Optimizer steps done."""
    tokens: int = 0
    """Input tokens consumed, summed over all ranks."""
    elapsed_s: float = 0.0
    """Training wall time, accumulated across resumes."""
    stop_reason: str = ""
    """Why the run ended (empty while it runs)."""

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class Horizon:
    """How long the run lasts: the schedule length and every stop condition the user set."""

    total_steps: int
    warmup_steps: int
    max_steps: Optional[int] = None
    max_tokens: Optional[int] = None
    epochs: Optional[float] = None
    max_time: Optional[float] = None


def plan_horizon(train: TrainArgs, tokens_per_step: int, samples_per_epoch: Optional[int]) -> Horizon:
    """Turn max_steps / max_tokens / epochs into a step count for the LR schedule.

    The schedule ends at the earliest limit; max_time alone cannot size a schedule.
    """
    candidates = []
    if train.max_steps is not None:
        candidates.append(train.max_steps)
    if train.max_tokens is not None:
        candidates.append(max(1, math.ceil(train.max_tokens / tokens_per_step)))
    if train.epochs is not None:
        if samples_per_epoch is None:
            raise ValueError("--train.epochs needs a dataset with a known size; use --train.max_steps instead")
        candidates.append(max(1, math.ceil(train.epochs * samples_per_epoch / train.global_batch_size)))
    if not candidates:
        what = "--train.max_time alone does not size the learning-rate schedule" if train.max_time else (
            "no stop condition was given")
        raise ValueError(f"{what}; set --train.max_steps, --train.max_tokens or --train.epochs")
    total = min(candidates)
    if train.lr_warmup_fraction is not None:
        warmup = int(train.lr_warmup_fraction * total)
    else:
        warmup = train.lr_warmup_steps or 0
    if warmup > total:
        warnings.warn(f"--train.lr_warmup_steps {warmup} is longer than the whole run ({total} steps): the "
                      "learning rate never reaches its peak", stacklevel=2)
    return Horizon(total_steps=total, warmup_steps=warmup, max_steps=train.max_steps,
                   max_tokens=train.max_tokens, epochs=train.epochs, max_time=train.max_time)


def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Skip the gradient all-reduce on micro-batches that are not the step's last, where the wrapper allows."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if not enabled and hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


@dataclass
class Fit:
    """Everything ``fit`` needs, built by a recipe."""

    runtime: Runtime
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_loader: Any
    val_loader: Optional[Iterable]
    train: TrainArgs
    eval: EvalArgs
    plan: BatchPlan
    horizon: Horizon
    precision: Precision
    save_checkpoint: Callable[["TrainState"], Any]
    """Writes a training checkpoint for the given state (all ranks call it)."""
    save_final: Callable[["TrainState"], Any]
    """Writes the final model directory (all ranks call it)."""
    wait_for_checkpoint: Optional[Callable[[], Any]] = None
    """Completes an asynchronous checkpoint write still under way (all ranks call it; ``save_final`` does too)."""
    loggers: list = field(default_factory=list)
    flops_per_token: Optional[float] = None
    peak_flops_per_device: Optional[float] = None
    state: TrainState = field(default_factory=TrainState)
    scaler: Optional[torch.amp.GradScaler] = None
    """Loss scaler for fp16 (None otherwise); part of the checkpointed state."""
    autocast_enabled: bool = True
    """False when the parallel wrapper already casts (FSDP's mixed-precision policy)."""
    grad_sync_only_last: bool = True
    """Skip gradient sync on all but the last micro-batch of a step."""
    console: Optional[Console] = None
    after_validation: Optional[Callable[[], Optional[str]]] = None
    """Called on every rank after each validation (e.g. to generate an example); rank 0 prints what it returns."""


def fit(job: Fit) -> TrainState:
    """Train until the first stop condition, validating, logging and checkpointing on the way.

    Raises :class:`~llmtrain.train.signals.Preempted` (exit code 75) after writing a checkpoint when
    SIGTERM or SIGUSR1 reached any rank, and :class:`NonFiniteError` after
    ``--train.max_nonfinite_steps`` skipped steps in a row.
    """
    with catch_stop_signals() as stop_request:
        try:
            return _train(job, stop_request)
        except (Preempted, NonFiniteError):  # every rank raises these alike, so every rank can still wait
            if job.wait_for_checkpoint is not None:
                job.wait_for_checkpoint()
            raise
        finally:
            if job.console is not None:
                job.console.close()
            for logger in job.loggers:
                logger.close()


def _train(job: Fit, stop_request: StopRequest) -> TrainState:
    runtime, state, horizon = job.runtime, job.state, job.horizon
    model, optimizer = job.model, job.optimizer
    schedule = WarmupDecaySchedule(optimizer, warmup_steps=horizon.warmup_steps,
                                   total_steps=horizon.total_steps, min_lr=job.train.min_lr,
                                   decay=job.train.lr_decay)
    scaler = job.scaler
    console = job.console = job.console or Console(horizon.total_steps, state.step, enabled=runtime.is_main)
    params = [p for p in model.parameters() if p.requires_grad]
    if runtime.device.type == "cuda" and hasattr(job.train_loader, "pin_memory"):
        job.train_loader.pin_memory = True  # prefetched batches arrive pinned: their copies below do not block
    train_iter = iter(job.train_loader)
    faults = InjectedFaults.from_env()

    if job.eval.initial_validation and job.val_loader is not None and state.step == 0:
        val_loss = validate(job)
        _log(job, {"step": 0, "tokens": 0, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))},
             console, line=f"step 0 | val_loss {val_loss:.4f}")

    model.train()
    loss_sum = torch.zeros((), device=runtime.device)  # summed token losses of the updates since the last log
    target_sum = torch.zeros((), device=runtime.device)
    interval_updates = torch.zeros((), device=runtime.device)  # optimizer steps taken since the last log
    interval_start, interval_tokens = time.perf_counter(), 0
    interval_data_wait = 0.0  # seconds spent waiting for batches since the last log
    run_start, elapsed_at_start = time.perf_counter(), state.elapsed_s
    last_saved_step = state.step if state.step else None
    max_norm = job.train.max_norm if job.train.max_norm is not None else float("inf")
    skipped_in_a_row = 0
    stop_signal = ""  # why some rank asked to stop, once the ranks have agreed on it
    on_device = _skips_on_device(optimizer, scaler)
    host_group = _host_group(runtime) if on_device else None
    unread: list[tuple] = []  # on_device: (step, tokens, epoch, grad norm) of the steps whose norm is unread
    time_over: Optional[bool] = None  # on_device: the ranks' agreed --train.max_time vote after the last step

    def read_skips() -> None:
        nonlocal skipped_in_a_row
        skipped_in_a_row = _read_skipped(job, unread, skipped_in_a_row, console)

    while not (reason := _stop_reason(job, state, time_over) or stop_signal):
        faults.crash_before(state.step + 1, runtime)
        lr = schedule.set_step(state.step)
        fetch_start = time.perf_counter()
        micro_batches = [next(train_iter) for _ in range(job.plan.grad_accum_steps)]
        interval_data_wait += time.perf_counter() - fetch_start
        local_input_tokens = sum(b["input_ids"].numel() for b in micro_batches)
        # The step's one all-reduce before the forward: target tokens, input tokens, and stop votes.
        host_counts = torch.tensor([0.0, local_input_tokens, float(stop_request.requested)], dtype=torch.float64)
        host_counts[0] = sum((b["labels"] != IGNORE_INDEX).sum() for b in micro_batches)  # no read: a tensor
        counts = _to_device(host_counts, runtime.device)
        runtime.all_reduce(counts)
        # Each rank's loss is its share of (sum over the step's tokens) / (token count of the step);
        # DDP and FSDP average gradients over ranks, hence the factor data_parallel_size.
        loss_scale = runtime.data_parallel_size / counts[0].clamp(min=1).float()
        step_loss = torch.zeros((), device=runtime.device)
        for index, batch in enumerate(micro_batches):
            input_ids = batch["input_ids"].to(runtime.device, non_blocking=True)
            labels = batch["labels"].to(runtime.device, non_blocking=True)
            last = index == len(micro_batches) - 1
            with gradient_sync(model, last or not job.grad_sync_only_last):
                with job.precision.autocast(runtime.device, job.autocast_enabled):
                    token_loss_sum = model(input_ids, labels=labels)  # chunked: no full fp32 logits
                loss = token_loss_sum * loss_scale
                if last and faults.poisons(state.step + 1, runtime):
                    loss = loss * float("nan")
                (scaler.scale(loss) if scaler else loss).backward()
            step_loss += token_loss_sum.detach()
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = _replicated(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if on_device:
            # No read (module docstring): the norm, reduced over all ranks, skips the step on the device.
            finite = torch.isfinite(grad_norm)
            optimizer.found_inf = (~finite).float()
            optimizer.step()
            loss_sum += torch.where(finite, step_loss, 0.0)
            target_sum += torch.where(finite, counts[0].float(), 0.0)
            interval_updates += finite
        else:
            # NOTE: the step's one host-device synchronisation (module docstring). The norm is already
            # reduced over all ranks, so every rank takes the same decision without another collective.
            finite, step_tokens, stop_votes = torch.cat(
                [torch.isfinite(grad_norm).reshape(1).to(counts), counts[1:]]).tolist()
            if finite:
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                loss_sum += step_loss
                target_sum += counts[0].float()
                interval_updates += 1
                skipped_in_a_row = 0
            else:
                skipped_in_a_row += _skip_update(scaler)
        optimizer.zero_grad(set_to_none=True)

        state.step += 1
        console.advance(state.step)
        state.elapsed_s = elapsed_at_start + time.perf_counter() - run_start
        if on_device:
            time_limit = horizon.max_time
            step_tokens, stop_votes, time_votes = _host_sum(
                [local_input_tokens, float(stop_request.requested),
                 float(time_limit is not None and state.elapsed_s >= time_limit)], host_group)
            time_over = time_votes > 0
        state.tokens += int(step_tokens)
        interval_tokens += int(step_tokens)
        if stop_votes > 0:
            stop_signal = f"got {stop_request.name}" if stop_request.requested else "another rank got a stop signal"
        if on_device:
            unread.append((state.step, state.tokens, job.train_loader.epoch, grad_norm.detach()))
        elif not finite:
            _report_skipped(job, state.step, state.tokens, job.train_loader.epoch, float(grad_norm),
                            skipped_in_a_row, console)

        save_now = bool(job.train.save_interval and state.step % job.train.save_interval == 0)
        if state.step % job.train.log_interval == 0 or save_now:
            read_skips()
        if state.step % job.train.log_interval == 0:
            runtime.all_reduce(loss_sum)
            if interval_updates.item():  # the same on every rank: the skip decision is
                loss_value = (loss_sum / target_sum.clamp(min=1)).item()
                seconds = time.perf_counter() - interval_start
                metrics = _step_metrics(job, state, loss_value, lr, float(grad_norm), interval_tokens / seconds)
                metrics["data_wait_fraction"] = interval_data_wait / seconds
                _log(job, metrics, console)
            loss_sum.zero_()
            target_sum.zero_()
            interval_updates.zero_()
            interval_start, interval_tokens = time.perf_counter(), 0
            interval_data_wait = 0.0
        if job.val_loader is not None and state.step % job.eval.interval == 0:
            val_loss = validate(job)
            _log(job, {"step": state.step, "tokens": state.tokens, "val_loss": val_loss,
                       "val_ppl": math.exp(min(val_loss, 50))}, console,
                 line=f"step {state.step} | val_loss {val_loss:.4f}")
            model.train()
        if save_now:
            job.save_checkpoint(state)
            last_saved_step = state.step

    read_skips()  # before any save below, and so that every skipped step is logged
    state.stop_reason = reason
    console.print(f"stopping after step {state.step}: {reason}")
    if reason == stop_signal:
        if last_saved_step != state.step:
            job.save_checkpoint(state)
        console.print(f"checkpoint of step {state.step} written; exit code {PREEMPTED_EXIT_CODE}: run the same "
                      "command with --resume auto to continue")
        raise Preempted(state.step, stop_request.name)
    if job.eval.final_validation and job.val_loader is not None and state.step % job.eval.interval != 0:
        val_loss = validate(job)
        _log(job, {"step": state.step, "tokens": state.tokens, "val_loss": val_loss,
                   "val_ppl": math.exp(min(val_loss, 50))}, console, line=f"step {state.step} | val_loss {val_loss:.4f}")
    if last_saved_step != state.step:
        job.save_checkpoint(state)
    job.save_final(state)
    return state


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``, copied without waiting for the device to finish its queue."""
    if device.type == "cuda":
        # NOTE: a copy from pageable memory blocks until the GPU has drained its queue (a host-device sync).
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _skips_on_device(optimizer: torch.optim.Optimizer, scaler: Optional[torch.amp.GradScaler]) -> bool:
    """Whether the optimizer skips a step itself given ``found_inf`` (as for GradScaler: fused Adam, AdamW, SGD).

    With an fp16 scaler the loop keeps the host decision: the scale is backed off on every rank alike.
    """
    return scaler is None and bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _host_group(runtime: Runtime) -> Any:
    """A process group over CPU (gloo) for numbers the host knows; None in a single process."""
    if not runtime.is_distributed:
        return None
    import torch.distributed as dist

    # NOTE: every rank calls this at the same point of fit(): creating a group is a collective.
    return dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def _host_sum(values: list[float], group: Any) -> list[float]:
    """Sum host numbers over the ranks of ``group`` without touching the device queue."""
    buffer = np.array(values, dtype=np.float64)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(torch.from_numpy(buffer), group=group)  # in place: the tensor shares the array
    return buffer.tolist()


def _read_skipped(job: Fit, unread: list[tuple], in_a_row: int, console: Console) -> int:
    """Read the norms of the steps in ``unread`` at once, report the skipped ones; returns the run of skips."""
    if not unread:
        return in_a_row
    norms = torch.stack([record[3] for record in unread]).tolist()
    records = [(*record[:3], norm) for record, norm in zip(unread, norms)]
    unread.clear()
    for step, tokens, epoch, norm in records:
        if math.isfinite(norm):
            in_a_row = 0
            continue
        in_a_row += 1
        _report_skipped(job, step, tokens, epoch, norm, in_a_row, console)
    return in_a_row


def _replicated(grad_norm: torch.Tensor) -> torch.Tensor:
    """The global gradient norm as a plain tensor (FSDP2 returns it as a replicated DTensor)."""
    from torch.distributed.tensor import DTensor

    return grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm


def _skip_update(scaler: Optional[torch.amp.GradScaler]) -> int:
    """Leave weights and optimizer state alone (the caller zeroes the gradients); back the fp16 loss scale off.

    Returns 1 when the step counts toward --train.max_nonfinite_steps. NOTE: with fp16 an overflow is
    how the scaler finds its scale, so it counts only once the scale is below 1 and can no longer be
    blamed. The scale is set here, the same on every rank, rather than from each rank's own inf check.
    """
    if scaler is None:
        return 1
    scale = scaler.get_scale()
    scaler.update(scale * scaler.get_backoff_factor())
    return int(scale < 1.0)


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a NaN or inf gradient norm."""


def _report_skipped(job: Fit, step: int, tokens: int, epoch: float, grad_norm: float, in_a_row: int,
                    console: Console) -> None:
    """Log a skipped step (a console line, a metrics row with ``skipped`` 1); stop after too many in a row."""
    limit = job.train.max_nonfinite_steps
    _log(job, {"step": step, "tokens": tokens, "epoch": epoch, "grad_norm": grad_norm, "skipped": 1,
               "elapsed_s": job.state.elapsed_s}, console,
         line=f"step {step} | skipped: the gradient norm is {grad_norm}, no update "
              f"({in_a_row} in a row; --train.max_nonfinite_steps {limit})")
    if in_a_row >= limit:
        raise NonFiniteError(
            f"the gradient norm was NaN or inf in {limit} optimizer steps in a row (steps "
            f"{step - limit + 1}-{step}; --train.max_nonfinite_steps {limit}), so training stopped. "
            "Those steps changed no weights and every checkpoint holds finite ones. Lower the learning rate or "
            "lengthen the warmup, look at the data of these steps, then continue with --resume auto")


NAN_STEPS_ENV = "LLMTRAIN_TEST_INJECT_NAN_STEPS"
CRASH_STEP_ENV = "LLMTRAIN_TEST_CRASH_AT_STEP"


@dataclass(frozen=True)
class InjectedFaults:
    """Test hooks, read once per ``fit()``; both act on the last rank only, so the others must follow.

    ``LLMTRAIN_TEST_INJECT_NAN_STEPS="3,4"``: the loss of those steps is multiplied by NaN before the
    backward pass. ``LLMTRAIN_TEST_CRASH_AT_STEP=k``: the process ends with ``os._exit(1)`` before
    step k, on the first attempt only (TORCHELASTIC_RESTART_COUNT unset or 0).
    """

    nan_steps: frozenset = frozenset()
    crash_step: Optional[int] = None

    @classmethod
    def from_env(cls) -> "InjectedFaults":
        nan_steps = os.environ.get(NAN_STEPS_ENV, "")
        crash_step = os.environ.get(CRASH_STEP_ENV)
        return cls(nan_steps=frozenset(int(step) for step in nan_steps.split(",") if step.strip()),
                   crash_step=int(crash_step) if crash_step else None)

    def poisons(self, step: int, runtime: Runtime) -> bool:
        return step in self.nan_steps and runtime.rank == runtime.world_size - 1

    def crash_before(self, step: int, runtime: Runtime) -> None:
        if (step == self.crash_step and runtime.rank == runtime.world_size - 1
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            print(f"[rank {runtime.rank}] {CRASH_STEP_ENV}: crashing before step {step}", file=sys.stderr, flush=True)
            os._exit(1)


def _stop_reason(job: Fit, state: TrainState, time_over: Optional[bool] = None) -> str:
    """The first stop condition that holds, in words; empty while training should go on.

    ``time_over``: the ranks' agreed --train.max_time vote, where the caller has one (else a collective here).
    """
    horizon = job.horizon
    if horizon.max_steps is not None and state.step >= horizon.max_steps:
        return f"reached --train.max_steps {horizon.max_steps}"
    if horizon.max_tokens is not None and state.tokens >= horizon.max_tokens:
        return f"reached --train.max_tokens {horizon.max_tokens}"
    if horizon.epochs is not None and job.train_loader.epoch >= horizon.epochs:
        return f"reached --train.epochs {horizon.epochs}"
    if horizon.max_time is not None and time_over is not None:
        if time_over:
            return f"reached --train.max_time {horizon.max_time}s"
    elif horizon.max_time is not None:
        # Ranks must agree, or one would wait forever for the others' next collective.
        over = torch.tensor([float(state.elapsed_s >= horizon.max_time)], device=job.runtime.device)
        if job.runtime.all_reduce(over, op="max").item() > 0:
            return f"reached --train.max_time {horizon.max_time}s"
    return ""


def validate(job: Fit) -> float:
    """The validation loss, then the ``after_validation`` hook (all ranks: a sharded forward is a collective)."""
    loss = _validation_loss(job)
    if job.after_validation is not None:
        text = job.after_validation()
        if text and job.console is not None:
            job.console.print(text)  # a no-op on ranks other than 0
    return loss


@torch.no_grad()
def _validation_loss(job: Fit) -> float:
    """Token-weighted mean loss over ``eval.max_iters`` validation batches of every rank."""
    job.model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=job.runtime.device)
    for index, batch in enumerate(job.val_loader):
        if index >= job.eval.max_iters:
            break
        input_ids = batch["input_ids"].to(job.runtime.device)
        labels = batch["labels"].to(job.runtime.device)
        with job.precision.autocast(job.runtime.device, job.autocast_enabled):
            totals[0] += job.model(input_ids, labels=labels).double()
        totals[1] += (labels != IGNORE_INDEX).sum()
    job.runtime.all_reduce(totals)
    job.model.train()
    return (totals[0] / totals[1].clamp(min=1)).item()


def _step_metrics(job: Fit, state: TrainState, loss: float, lr: float, grad_norm: float,
                  tokens_per_sec: float) -> dict:
    per_device = tokens_per_sec / job.runtime.world_size
    mfu = None
    if job.flops_per_token and job.peak_flops_per_device:
        mfu = per_device * job.flops_per_token / job.peak_flops_per_device
    remaining = max(0, job.horizon.total_steps - state.step)
    seconds_per_step = state.elapsed_s / max(1, state.step)
    return {"step": state.step, "tokens": state.tokens, "epoch": job.train_loader.epoch, "loss": loss,
            "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_device": per_device, "mfu": mfu, "peak_memory_gb": peak_memory_gb(job.runtime.device),
            "elapsed_s": state.elapsed_s, "eta_s": remaining * seconds_per_step}


def _log(job: Fit, metrics: dict, console: Console, line: Optional[str] = None) -> None:
    if not job.runtime.is_main:
        return
    for logger in job.loggers:
        logger.log(metrics)
    if line is not None:
        console.print(line)
    else:
        console.update(metrics, metrics["step"])


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or this process's peak resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux
