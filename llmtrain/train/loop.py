"""``fit()``: the one training loop that every recipe calls.

A step gathers ``grad_accum_steps`` micro-batches, counts their target tokens over every
data-parallel rank, and scales each micro-batch's summed loss by that count, so padding,
accumulation and the number of ranks never change the gradient.

The parts, one job each: :class:`TrainStep` (one optimizer step over the micro-batches),
:class:`ModelPasses` (the model's forward and backward passes; under pipeline parallelism ``Fit.pipeline``
takes its place), :class:`Strategy` (what the data-parallel engine owns: gradient sync, backward, clipping
and the gradient norm, the optimizer step and zero_grad; :class:`TorchStrategy` for torch's own DDP and
FSDP, ``llmtrain_deepspeed`` for DeepSpeed), :class:`NonFiniteSteps` (what a NaN or inf gradient norm
does), :class:`LogInterval` (the numbers of a log line), :class:`StopPolicy` (when to stop and when to
save); :class:`Trainer` drives them. Code from outside the loop (--profile's profiler, a test's fault
injector) hooks in through :mod:`llmtrain.callbacks`.

Faults. The numbers each rank's host knows as a step starts (its input tokens, a stop vote for SIGTERM
or SIGUSR1 received, see :mod:`llmtrain.signals`, and a ``--train.max_time`` vote) ride in the
all-reduce of the step's target-token count, the one collective that opens every step, so the ranks
agree to stop after the same step without a collective of their own; on a signal they checkpoint and
raise ``Preempted`` (exit 75). A step whose global gradient norm is NaN or inf (a NaN loss makes NaN
gradients) changes nothing: no optimizer step, gradients zeroed, the fp16 loss scale backed off; it is
logged, and ``--train.max_nonfinite_steps`` of them in a row stop the run. The norm is already reduced
over all ranks (the DDP gradients are, the FSDP norm is all-reduced by clipping), so every rank decides
alike.

Host-device synchronisation. Optimizers that take ``found_inf`` (fused Adam/AdamW, the default,
without an fp16 loss scaler) never wait for a step to finish between log, eval and checkpoint steps:
the optimizer skips a non-finite step on the device (its step counter too), the loss sums mask it
out, and the norms of the steps since the last read are read together at the next log or checkpoint
step, where skipped steps are logged with their step numbers and ``--train.max_nonfinite_steps`` is
enforced (before any save, so the limit still holds at every checkpoint; a skipped step leaves the
weights finite anyway; no checkpoint is written while such skips run on, see :class:`Rewind`). Any
other optimizer must be told on the host whether to step, so once per step, after clipping, the host
reads whether the norm is finite: the step's only synchronisation. Either way the step's target-token
count travels to the device asynchronously from pinned memory.
The host numbers' sums come back the same way (:class:`HostSums`), and the host reads them after the
step, once the device has run that opening all-reduce: this waits for the step before to finish on the
device, never for this one, so the host stays at most one step ahead of the device, which is all the
run-ahead that hiding kernel launches needs. (On a CPU the sums are in host memory at once.)

NOTE: these numbers went over a gloo group of their own for a while, which waits for no device. On
several GPU nodes that made every step pay a TCP all-reduce across the nodes (through the interface
GLOO_SOCKET_IFNAME names), beside the NCCL one the step makes anyway. Now a step's collectives are
all on the run's device: NCCL on GPUs, gloo only for a CPU run.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import shlex
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from llmtrain.args import BatchPlan, EvalArgs, TrainArgs
from llmtrain.checkpoint.checkpointer import NonFiniteWeightsError
from llmtrain.flops import real_tokens
from llmtrain.distributed.grad_norm import clip_grad_norm_
from llmtrain.distributed.runtime import Runtime
from llmtrain.loss import IGNORE_INDEX
from llmtrain import callbacks
from llmtrain.train.loggers import Console
from llmtrain.precision import Precision
from llmtrain.train.schedule import WarmupDecaySchedule
from llmtrain.signals import PREEMPTED_EXIT_CODE, Preempted, StopRequest, catch_stop_signals

PHASES = {phase: f"llmtrain.{phase}" for phase in ("data", "forward", "backward", "optimizer")}
"""The profiler's labels of a step's phases (``--profile`` traces show them; scripts/profile_step.py sums them):
waiting for the micro-batches, the model's forward (loss included), its backward (gradient sync included) and the
strategy's step (clipping, optimizer step and zero_grad)."""


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
    set_by: str = ""
    """The stop condition that sets total_steps, as its flag (`--train.max_steps 300`), for messages."""


def step_limits(train: TrainArgs, tokens_per_step: int, samples_per_epoch: Optional[int]) -> dict[str, int]:
    """The last step of each stop condition that sizes the run, keyed by its flag (`--train.max_steps 300`).

    --train.epochs counts only once the data's size is known; --train.max_time never does.
    """
    limits = {}
    if train.max_steps is not None:
        limits[f"--train.max_steps {train.max_steps}"] = train.max_steps
    if train.max_tokens is not None:
        limits[f"--train.max_tokens {train.max_tokens}"] = max(1, math.ceil(train.max_tokens / tokens_per_step))
    if train.epochs is not None and samples_per_epoch is not None:
        steps = max(1, math.ceil(train.epochs * samples_per_epoch / train.global_batch_size))
        limits[f"--train.epochs {train.epochs:g}"] = steps
    return limits


def plan_horizon(train: TrainArgs, tokens_per_step: int, samples_per_epoch: Optional[int]) -> Horizon:
    """Turn max_steps / max_tokens / epochs into a step count for the LR schedule.

    The schedule ends at the earliest limit; max_time alone cannot size a schedule.
    """
    if train.epochs is not None and samples_per_epoch is None:
        raise ValueError("--train.epochs needs a dataset with a known size; use --train.max_steps instead")
    limits = step_limits(train, tokens_per_step, samples_per_epoch)
    if not limits:
        what = "--train.max_time alone does not size the learning-rate schedule" if train.max_time else (
            "no stop condition was given")
        raise ValueError(f"{what}; set --train.max_steps, --train.max_tokens or --train.epochs")
    set_by, total = min(limits.items(), key=lambda limit: limit[1])
    if train.lr_warmup_fraction is not None:
        warmup = int(train.lr_warmup_fraction * total)
    else:
        warmup = train.lr_warmup_steps or 0
    if warmup > total:
        warnings.warn(f"--train.lr_warmup_steps {warmup} is longer than the whole run ({total} steps): the "
                      "learning rate never reaches its peak", stacklevel=2)
    return Horizon(total_steps=total, warmup_steps=warmup, max_steps=train.max_steps,
                   max_tokens=train.max_tokens, epochs=train.epochs, max_time=train.max_time, set_by=set_by)


def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Skip the gradient all-reduce on micro-batches that are not the step's last, where the wrapper allows; under
    SHARD_GRAD_OP keep the gathered weights until then too."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        if getattr(model, "holds_weights_through_accumulation", False):  # SHARD_GRAD_OP (parallelize.apply_fsdp)
            model.set_reshard_after_backward(enabled)  # gathered once per step, not once per micro-batch
        return contextlib.nullcontext()
    if not enabled and hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


@dataclass
class Rewind:
    """Where a diverging run goes back to: its last good checkpoint, and the command that resumes it with a lower
    learning rate.

    No checkpoint is written while a streak of non-finite steps is open (:attr:`NonFiniteSteps.streak_open`). A
    checkpoint is good once a step after it had a finite gradient norm: its weights gave one. NOTE: that its own
    step was finite is not enough. Weights can grow huge over finite steps until the next gradient is inf; a
    resume recomputes that gradient from the same weights and data, at any learning rate, and fails again.
    --train.keep_last spares the last good checkpoint, and a run that stops diverging sets the newer ones aside
    (llmtrain.recipes.run), so --resume auto picks it.
    """

    checkpoint: Optional[Path] = None
    """The last good checkpoint; at the start, the one the run resumed (None for a fresh run)."""
    command: list[str] = field(default_factory=list)
    """The run's command line (``llmtrain`` and its arguments, as typed); empty where unknown."""
    on_good: Optional[Callable[[Any], Any]] = None
    """Called on every rank with a checkpoint once it is known to be good (the checkpointer prunes what
    --train.keep_last no longer keeps)."""
    newest: Optional[tuple[int, Any]] = None
    """(step, directory) of the newest checkpoint while it is not known to be good."""

    def saved(self, step: int, checkpoint: Any) -> None:
        self.newest = (step, checkpoint)

    def finite(self, step: int) -> None:
        """Step ``step`` had a finite gradient norm: the newest checkpoint, if written before it, is good."""
        if self.newest is not None and step > self.newest[0]:
            self._good()

    def ended(self) -> None:
        """The run ended with no streak open: its newest checkpoint, the model it hands over, counts as good."""
        if self.newest is not None:
            self._good()

    def _good(self) -> None:
        self.checkpoint, self.newest = self.newest[1], None
        if self.on_good is not None:
            self.on_good(self.checkpoint)

    REPLACED_FLAGS = ("--resume", "--optimizer.lr", "--optimizer.init_args.lr", "--train.min_lr",
                      "--initial_checkpoint_dir")
    """What the advised command sets itself (a resume cannot also start from --initial_checkpoint_dir)."""

    def advice(self, lr: float, min_lr: float) -> str:
        """The last good checkpoint, and the exact command that resumes it at a tenth of the peak rate ``lr``."""
        lower = lr / 10
        flags = [*(["--resume", str(self.checkpoint)] if self.checkpoint is not None else []),
                 "--optimizer.lr", f"{lower:g}", *(["--train.min_lr", f"{lower:g}"] if min_lr > lower else [])]
        if self.command:
            command = shlex.join([*_without_flags(self.command, self.REPLACED_FLAGS), *flags])
        else:
            command = f"the run's command with {shlex.join(flags)} in place of its own of these flags"
        if self.checkpoint is None:
            return f"No good checkpoint was written before it; start again with a lower learning rate: {command}"
        return f"The last good checkpoint is {self.checkpoint}; resume from it with a lower learning rate: {command}"


def _without_flags(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` less the flags ``names`` and their values (``--flag value`` and ``--flag=value``)."""
    out, index = [], 0
    while index < len(argv):
        name = argv[index].split("=", 1)[0]
        if name in names:
            index += 1 if "=" in argv[index] else 2
        else:
            out.append(argv[index])
            index += 1
    return out


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
    """Writes a training checkpoint for the given state (all ranks call it), sparing ``rewind.checkpoint`` from
    --train.keep_last; returns its directory."""
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
    callbacks: list[callbacks.Callback] = field(default_factory=list)
    """This run's own callbacks (--profile's profiler), called before those installed in the process."""
    pp_mesh: Any = None
    """The pipeline dimension of the mesh under pipeline parallelism (the gradient norm sums over it), else None."""
    pipeline: Any = None
    """Under pipeline parallelism, the :class:`llmtrain.distributed.pipeline.Pipeline` that runs this rank's stages
    (forward, backward and validation losses in place of ``model(...)``); None otherwise."""
    strategy: Optional[Callable[["Fit"], "Strategy"]] = None
    """Builds the run's :class:`Strategy` from this job; None: :class:`TorchStrategy` (one process, DDP, FSDP)."""
    rewind: Rewind = field(default_factory=Rewind)
    """The last good checkpoint and the run's command line, for the messages of a diverging run."""


def fit(job: Fit) -> TrainState:
    """Train until the first stop condition, validating, logging and checkpointing on the way.

    Raises :class:`~llmtrain.signals.Preempted` (exit code 75) after writing a checkpoint when
    SIGTERM or SIGUSR1 reached any rank (none while non-finite steps run on: :class:`Rewind`), and
    :class:`NonFiniteError` after ``--train.max_nonfinite_steps`` skipped steps in a row, at the end of a run
    whose last steps were skipped, or when the weights hold NaN or inf.
    """
    with catch_stop_signals() as stop_request:
        hooks = callbacks.Callbacks([])
        try:
            hooks = callbacks.active(*job.callbacks)
            return Trainer(job, stop_request, hooks).train()
        except (Preempted, NonFiniteError):  # every rank raises these alike, so every rank can still wait
            if job.wait_for_checkpoint is not None:
                job.wait_for_checkpoint()
            raise
        finally:
            hooks.on_fit_end()  # before the console closes: a profiler prints its table
            if job.console is not None:
                job.console.close()
            for logger in job.loggers:
                logger.close()


class Trainer:
    """One ``fit()``: builds its parts once, then drives them step after step until a stop condition holds."""

    def __init__(self, job: Fit, stop_request: StopRequest, hooks: callbacks.Callback) -> None:
        self.job = job
        job.console = job.console or Console(job.horizon.total_steps, job.state.step, enabled=job.runtime.is_main)
        self.hooks = hooks
        self.hooks.on_fit_start(job)
        self.schedule = WarmupDecaySchedule(job.optimizer, warmup_steps=job.horizon.warmup_steps,
                                            total_steps=job.horizon.total_steps, min_lr=job.train.min_lr,
                                            decay=job.train.lr_decay)
        self.strategy = (job.strategy or TorchStrategy)(job)
        self.skips = self.strategy.skips
        self.train_step = TrainStep(job, self.strategy, self.hooks)
        self.interval = LogInterval(job)
        self.stops = StopPolicy(job, stop_request)

    def train(self) -> TrainState:
        job, state = self.job, self.job.state
        if job.runtime.device.type == "cuda" and hasattr(job.train_loader, "pin_memory"):
            job.train_loader.pin_memory = True  # prefetched batches arrive pinned: their copies do not block
        batches = iter(job.train_loader)
        if job.eval.initial_validation and job.val_loader is not None and state.step == 0:
            with self.interval.paused():
                _validate_and_log(job)
        job.model.train()
        while not (reason := self.stops.reason()):
            self.hooks.on_step_start(state.step + 1)
            lr = self.schedule.set_step(state.step)
            micro_batches = self.interval.fetch(batches, job.plan.grad_accum_steps)
            # One rank of each data-parallel shard counts its batch (Runtime.counts_batch), so sums count each once.
            input_tokens = sum(batch["input_ids"].numel() for batch in micro_batches) * job.runtime.counts_batch
            result = self.train_step(state.step + 1, micro_batches, [input_tokens, *self.stops.votes()])
            state.step += 1
            job.console.advance(state.step)
            step_tokens = self.stops.after_step(result.host_sums.read())
            state.tokens += step_tokens
            self.interval.add(result, step_tokens, micro_batches)
            self.skips.record(state.step, state.tokens, job.train_loader.epoch, result.grad_norm)
            self._after_step(lr, result.grad_norm)
            self.hooks.on_step_end(state.step)
        return self._finish(reason)

    def _after_step(self, lr: float, grad_norm: torch.Tensor) -> None:
        """What falls on this step: the report of skipped steps, the log line, validation, a checkpoint."""
        job, step = self.job, self.job.state.step
        log_now, save_now = step % job.train.log_interval == 0, self.stops.save_due()
        if log_now or save_now:
            self.skips.settle()  # before a save: the limit on skipped steps holds at every checkpoint
        if log_now:
            self.interval.log(lr, grad_norm)
        if job.val_loader is not None and step % job.eval.interval == 0:
            with self.interval.paused():  # validation is no part of the training throughput
                _validate_and_log(job)
        if save_now:
            self.stops.save(self.skips)

    def _finish(self, reason: str) -> TrainState:
        """On a stop signal, a checkpoint and Preempted; otherwise the final validation, checkpoint and model."""
        job, state = self.job, self.job.state
        self.skips.settle()  # before any save below, and so that every skipped step is logged
        state.stop_reason = reason
        job.console.print(f"stopping after step {state.step}: {reason}")
        if reason == self.stops.signal:
            if self.stops.save(self.skips):
                job.console.print(f"checkpoint of step {state.step} written; exit code {PREEMPTED_EXIT_CODE}: run "
                                  "the same command with --resume auto to continue")
            else:
                job.console.print(f"exit code {PREEMPTED_EXIT_CODE}: --resume auto continues from the newest "
                                  "checkpoint written")
            raise Preempted(state.step, self.stops.request.name)
        if self.skips.streak_open:
            raise NonFiniteError(f"the run reached its end ({reason}) in a streak of {self.skips.in_a_row} steps whose "
                                 "gradient norm was NaN or inf, so it wrote neither a checkpoint nor final/: the model "
                                 f"may be diverging. {resume_advice(job)}")
        if job.eval.final_validation and job.val_loader is not None and state.step % job.eval.interval != 0:
            _validate_and_log(job)
        self.stops.save(self.skips)
        job.save_final(state)
        job.rewind.ended()
        return state


# ------------------------------------------------------------------------------------ the step
@dataclass
class StepResult:
    """What one optimizer step leaves on the device for the log; none of it has been read."""

    loss_sum: torch.Tensor
    """This rank's summed token losses over the step's micro-batches (fp32, not scaled)."""
    target_tokens: torch.Tensor
    """Target tokens of the step over all ranks."""
    stepped: torch.Tensor
    """Whether the optimizer stepped (bool; False for a skipped non-finite step)."""
    grad_norm: torch.Tensor
    """The global gradient norm before clipping."""
    host_sums: "HostSums"
    """The host numbers the step was given, summed over all ranks."""


class TrainStep:
    """One optimizer step: forward and backward over the micro-batches, then the strategy's clipping and step.

    Each micro-batch's loss is its summed token losses over the target tokens of the whole step (all
    micro-batches, all ranks): padding, accumulation and the number of ranks never change the gradient.
    """

    def __init__(self, job: Fit, strategy: "Strategy", hooks: callbacks.Callback) -> None:
        self.job, self.strategy, self.hooks = job, strategy, hooks
        self.passes = model_passes(job, strategy)

    def __call__(self, step: int, micro_batches: list[dict], host_numbers: list[float]) -> StepResult:
        """Train one step; ``host_numbers`` (what this rank's host knows) are summed over the ranks on the way."""
        job = self.job
        target_tokens, host_sums = self.counts(micro_batches, host_numbers)
        # Each rank's loss is its share of (sum over the step's tokens) / (token count of the step);
        # DDP, FSDP and DeepSpeed average gradients over ranks, hence the factor data_parallel_size.
        loss_scale = job.runtime.data_parallel_size / target_tokens.clamp(min=1).float()
        loss_sum = self.forward_backward(step, micro_batches, loss_scale)
        with torch.profiler.record_function(PHASES["optimizer"]):
            grad_norm, stepped = self.strategy.step()
        return StepResult(loss_sum, target_tokens, stepped, grad_norm, host_sums)

    def counts(self, micro_batches: list[dict], host_numbers: list[float]) -> tuple[torch.Tensor, "HostSums"]:
        """The step's target tokens and ``host_numbers``, each summed over all ranks in the step's one
        collective before the forward, on the run's device (nothing is read here)."""
        local = sum((batch["labels"] != IGNORE_INDEX).sum() for batch in micro_batches)  # a host tensor
        local = local * self.job.runtime.counts_batch
        numbers = torch.cat([local.to(torch.float64).reshape(1), torch.tensor(host_numbers, dtype=torch.float64)])
        counts = _to_device(numbers, self.job.runtime.device)
        self.job.runtime.all_reduce(counts)
        return counts[0], HostSums(counts[1:])

    def forward_backward(self, step: int, micro_batches: list[dict], loss_scale: torch.Tensor) -> torch.Tensor:
        """Accumulate the gradients of the micro-batches; returns their summed token losses (not scaled)."""

        def on_loss(loss: torch.Tensor) -> torch.Tensor:  # what backward starts from
            return self.strategy.scale_loss(self.hooks.on_loss(step, loss))

        return self.passes.forward_backward(micro_batches, loss_scale, on_loss)


def model_passes(job: Fit, strategy: Optional["Strategy"] = None) -> "ModelPasses":
    """How this run's model computes losses: ``job.pipeline`` under pipeline parallelism, else the model itself
    (``strategy`` syncs and runs its backward passes; validation, which has none, needs no strategy)."""
    return job.pipeline if job.pipeline is not None else ModelPasses(job, strategy)


class Strategy:
    """What the data-parallel engine owns in a step: gradient sync, backward, clipping and the gradient norm, the
    optimizer step (or its skip) and zero_grad. The loop calls only these, whatever the engine.

    ``skips`` is the :class:`NonFiniteSteps` that reports the steps this strategy skipped.
    """

    skips: "NonFiniteSteps"

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        """Entered around each micro-batch's forward and backward; ``last``: the step's last micro-batch."""
        raise NotImplementedError

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward starts from (an fp16 loss scale applied, where this strategy scales outside backward)."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip, step the optimizer unless the gradient norm is NaN or inf, zero the gradients; returns (the global
        gradient norm before clipping, whether the optimizer stepped), neither of them read."""
        raise NotImplementedError


class TorchStrategy(Strategy):
    """torch's own engine: one process, DDP, FSDP, and tensor and pipeline parallelism beside them."""

    def __init__(self, job: Fit) -> None:
        self.job = job
        self.params = [p for p in job.model.parameters() if p.requires_grad]
        self.max_norm = job.train.max_norm if job.train.max_norm is not None else float("inf")
        self.skips = NonFiniteSteps.for_job(job)

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        return gradient_sync(self.job.model, last or not self.job.grad_sync_only_last)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.job.scaler.scale(loss) if self.job.scaler else loss

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        job = self.job
        if job.scaler:
            job.scaler.unscale_(job.optimizer)
        # An optimizer that skips non-finite steps itself also scales the gradients as it reads them.
        in_optimizer = job.optimizer if isinstance(self.skips, SkipOnDevice) else None
        grad_norm = clip_grad_norm_(self.params, self.max_norm, pp_mesh=job.pp_mesh, optimizer=in_optimizer)
        stepped = self.skips.step(grad_norm)
        job.optimizer.zero_grad(set_to_none=True)
        return grad_norm.detach(), stepped


class ModelPasses:
    """The forward and backward passes of a model that each rank runs whole (or FSDP-sharded) on its micro-batches.

    :class:`llmtrain.distributed.pipeline.Pipeline` has the same two methods for a model cut into pipeline stages.
    """

    def __init__(self, job: Fit, strategy: Optional[Strategy] = None) -> None:
        self.job, self.strategy = job, strategy

    def forward_backward(self, micro_batches: list[dict], loss_scale: torch.Tensor,
                         on_loss: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Backward from ``on_loss(summed token losses × loss_scale)`` of each micro-batch in turn; returns the summed
        token losses of all of them (not scaled)."""
        job = self.job
        loss_sum = torch.zeros((), device=job.runtime.device)
        for index, batch in enumerate(micro_batches):
            input_ids = batch["input_ids"].to(job.runtime.device, non_blocking=True)
            labels = batch["labels"].to(job.runtime.device, non_blocking=True)
            with self.strategy.accumulating(last=index == len(micro_batches) - 1):
                with job.precision.autocast(job.runtime.device, job.autocast_enabled), \
                        torch.profiler.record_function(PHASES["forward"]):
                    token_loss_sum = job.model(input_ids, labels=labels)  # chunked: no full fp32 logits
                with torch.profiler.record_function(PHASES["backward"]):
                    self.strategy.backward(on_loss(token_loss_sum * loss_scale))
            loss_sum += token_loss_sum.detach()
        return loss_sum

    @torch.no_grad()
    def loss_sum(self, batches: list[dict]) -> torch.Tensor:
        """The summed token losses of ``batches``, forward only."""
        job = self.job
        total = torch.zeros((), dtype=torch.float64, device=job.runtime.device)
        for batch in batches:
            input_ids = batch["input_ids"].to(job.runtime.device)
            labels = batch["labels"].to(job.runtime.device)
            with job.precision.autocast(job.runtime.device, job.autocast_enabled):
                total += job.model(input_ids, labels=labels).double()
        return total


class HostSums:
    """Sums of host numbers that an all-reduce left on the device, on their way back to the host.

    On a GPU they are copied to pinned memory behind the all-reduce without waiting; :meth:`read` then
    waits only until the device has run that copy, not for what was queued after it.
    """

    def __init__(self, sums: torch.Tensor) -> None:
        self.ready: Optional[torch.cuda.Event] = None
        self.host = sums
        if sums.device.type == "cuda":
            self.host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            self.host.copy_(sums, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def read(self) -> list[float]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.numpy().tolist()  # host memory: a NumPy view, no device read


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``, copied without waiting for the device to finish its queue."""
    if device.type == "cuda":
        # NOTE: a copy from pageable memory blocks until the GPU has drained its queue (a host-device sync).
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


# ------------------------------------------------------------------------- non-finite steps
class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a NaN or inf gradient norm."""

    exit_status = 1
    """Told in one line (llmtrain.errors): the run stopped itself with a reason; its checkpoints are sound."""


class NonFiniteSteps:
    """What a step whose global gradient norm is NaN or inf does: nothing to the weights or the optimizer
    state; it is logged, and ``--train.max_nonfinite_steps`` of them in a row raise :class:`NonFiniteError`.

    The loop calls ``step(grad_norm)`` in place of ``optimizer.step()``, ``record(...)`` once the step's
    counters are known, and ``settle()`` at log and checkpoint steps and at the end, which reports the
    skips not yet reported and enforces the limit. :meth:`for_job` picks where the skip is decided
    (module docstring): on the device (:class:`SkipOnDevice`) or on the host (:class:`SkipOnHost`).
    """

    def __init__(self, job: Fit) -> None:
        self.job = job
        self.in_a_row = 0
        """Skipped steps in a row that count toward the limit."""

    @property
    def streak_open(self) -> bool:
        """Whether the steps settled last were skipped, counting toward the limit, with no finite step since: no
        checkpoint is written then (:meth:`StopPolicy.save`). fp16 overflows, the loss scale's search, open none."""
        return self.in_a_row > 0

    def _finite(self, step: int) -> None:
        """Step ``step``'s gradient norm was finite: the streak, if any, is closed."""
        self.in_a_row = 0
        self.job.rewind.finite(step)

    @staticmethod
    def for_job(job: Fit) -> "NonFiniteSteps":
        return SkipOnDevice(job) if _skips_on_device(job.optimizer, job.scaler) else SkipOnHost(job)

    def step(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """Step the optimizer unless ``grad_norm`` is NaN or inf; returns whether it stepped (a device bool)."""
        raise NotImplementedError

    def record(self, step: int, tokens: int, epoch: float, grad_norm: torch.Tensor) -> None:
        """The counters after step ``step``, for the report if it was skipped."""
        raise NotImplementedError

    def settle(self) -> None:
        """Report the skipped steps recorded and not yet reported; raise NonFiniteError after too many in a row."""

    def _report(self, step: int, tokens: int, epoch: float, grad_norm: float, counts: bool) -> None:
        """Log a skipped step (a console line, a metrics row with ``skipped`` 1); stop after too many in a row."""
        self.in_a_row += counts
        limit = self.job.train.max_nonfinite_steps
        _log(self.job, {"step": step, "tokens": tokens, "epoch": epoch, "grad_norm": grad_norm, "skipped": 1,
                        "elapsed_s": self.job.state.elapsed_s},
             line=f"step {step} | skipped: the gradient norm is {grad_norm}, no update "
                  f"({self.in_a_row} in a row; --train.max_nonfinite_steps {limit})")
        if self.in_a_row >= limit:
            raise NonFiniteError(
                f"the gradient norm was NaN or inf in {limit} optimizer steps in a row (steps "
                f"{step - limit + 1}-{step}; --train.max_nonfinite_steps {limit}), so training stopped; no checkpoint "
                f"was written during them. {resume_advice(self.job)} (or lengthen the warmup, or look at the data of "
                "these steps)")


def resume_advice(job: Fit) -> str:
    """:meth:`Rewind.advice` at this run's peak learning rate (the schedule's base) and --train.min_lr."""
    return job.rewind.advice(job.optimizer.param_groups[0]["initial_lr"], job.train.min_lr)


def _skips_on_device(optimizer: torch.optim.Optimizer, scaler: Optional[torch.amp.GradScaler]) -> bool:
    """Whether the optimizer skips a step itself given ``found_inf`` (as for GradScaler: fused Adam, AdamW, SGD).

    With an fp16 scaler the loop keeps the host decision: the scale is backed off on every rank alike.
    """
    return scaler is None and bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class SkipOnDevice(NonFiniteSteps):
    """The optimizer skips a non-finite step itself (``found_inf``), its step counter too: no read until settle()."""

    def __init__(self, job: Fit) -> None:
        super().__init__(job)
        self.unread: list[tuple] = []  # (step, tokens, epoch, grad norm) of the steps whose norm is unread

    def step(self, grad_norm: torch.Tensor) -> torch.Tensor:
        finite = torch.isfinite(grad_norm)
        self.job.optimizer.found_inf = (~finite).float()
        self.job.optimizer.step()
        return finite

    def record(self, step: int, tokens: int, epoch: float, grad_norm: torch.Tensor) -> None:
        self.unread.append((step, tokens, epoch, grad_norm))

    def settle(self) -> None:
        if not self.unread:
            return
        norms = torch.stack([record[3] for record in self.unread]).tolist()  # all the norms in one read
        records, self.unread = self.unread, []
        for (step, tokens, epoch, _), norm in zip(records, norms):
            if math.isfinite(norm):
                self._finite(step)
            else:
                self._report(step, tokens, epoch, norm, counts=True)


class SkipOnHost(NonFiniteSteps):
    """The host reads whether the norm is finite and steps or not: one read per step, the step's only one.

    With an fp16 loss scaler a skip backs the scale off, the same on every rank.
    """

    def __init__(self, job: Fit) -> None:
        super().__init__(job)
        self.finite = True  # whether the last step's norm was finite
        self.counts = False  # whether the last step, skipped, counts toward the limit

    def step(self, grad_norm: torch.Tensor) -> torch.Tensor:
        job, scaler = self.job, self.job.scaler
        finite = torch.isfinite(grad_norm)
        # NOTE: the step's one host-device synchronisation (module docstring). The norm is already
        # reduced over all ranks, so every rank takes the same decision without another collective.
        self.finite = bool(finite)
        if not self.finite:
            self.counts = _skip_update(scaler)
        elif scaler:
            scaler.step(job.optimizer)
            scaler.update()
        else:
            job.optimizer.step()
        return finite

    def record(self, step: int, tokens: int, epoch: float, grad_norm: torch.Tensor) -> None:
        if self.finite:
            self._finite(step)
        else:
            self._report(step, tokens, epoch, float(grad_norm), counts=self.counts)


def _skip_update(scaler: Optional[torch.amp.GradScaler]) -> bool:
    """Leave weights and optimizer state alone (the caller zeroes the gradients); back the fp16 loss scale off.

    Returns whether the step counts toward --train.max_nonfinite_steps. NOTE: with fp16 an overflow is
    how the scaler finds its scale, so it counts only once the scale is below 1 and can no longer be
    blamed. The scale is set here, the same on every rank, rather than from each rank's own inf check.
    """
    if scaler is None:
        return True
    scale = scaler.get_scale()
    scaler.update(scale * scaler.get_backoff_factor())
    return scale < 1.0


# ------------------------------------------------------------------------------------ logging
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

    def log(self, lr: float, grad_norm: torch.Tensor) -> None:
        """Log the mean loss and throughput since the last log (if any step was taken); start the next interval."""
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
            _log(job, metrics)
        self._restart()


# ------------------------------------------------------------------------ stopping and saving
class StopPolicy:
    """When the run stops and when it saves: the horizon's limits, --train.max_time, stop signals, the save interval.

    As each step starts, every rank votes (:meth:`votes`: a stop signal received, see
    :mod:`llmtrain.signals`, and whether --train.max_time runs out during the step); the votes ride
    in the step's opening all-reduce with the input tokens, so after the step every rank knows the same
    sums (:meth:`after_step`) and every rank stops after the same step.
    """

    def __init__(self, job: Fit, request: StopRequest) -> None:
        self.job, self.request = job, request
        self.signal = ""
        """Why some rank asked to stop, once the ranks have agreed on it."""
        self.last_saved_step = job.state.step or None
        self.started, self.elapsed_at_start = time.perf_counter(), job.state.elapsed_s
        self.last_step_s = 0.0
        max_time = job.horizon.max_time
        # A resumed run can be out of time before its first step; every rank read the same elapsed time.
        self.time_over = max_time is not None and job.state.elapsed_s >= max_time

    def votes(self) -> list[float]:
        """This rank's votes as a step starts: a stop signal received; --train.max_time passed by the step's end
        (were it as long as the last step), so that the run stops after the step in which the time runs out."""
        max_time = self.job.horizon.max_time
        runs_out = max_time is not None and self._elapsed() + self.last_step_s >= max_time
        return [float(self.request.requested), float(runs_out)]

    def after_step(self, sums: list[float]) -> int:
        """Advance the clock and take the ranks' summed numbers (input tokens, then the votes); returns the
        step's input tokens over all ranks."""
        state = self.job.state
        elapsed = self._elapsed()
        self.last_step_s, state.elapsed_s = elapsed - state.elapsed_s, elapsed
        tokens, stop_votes, time_votes = sums
        self.time_over = time_votes > 0
        if stop_votes > 0:
            self.signal = f"got {self.request.name}" if self.request.requested else "another rank got a stop signal"
        return int(tokens)

    def _elapsed(self) -> float:
        return self.elapsed_at_start + time.perf_counter() - self.started

    def reason(self) -> str:
        """The first stop condition that holds, in words; empty while training should go on."""
        horizon, state = self.job.horizon, self.job.state
        if horizon.max_steps is not None and state.step >= horizon.max_steps:
            return f"reached --train.max_steps {horizon.max_steps}"
        if horizon.max_tokens is not None and state.tokens >= horizon.max_tokens:
            return f"reached --train.max_tokens {horizon.max_tokens}"
        if horizon.epochs is not None and self.job.train_loader.epoch >= horizon.epochs:
            return f"reached --train.epochs {horizon.epochs}"
        if self.time_over:
            return f"reached --train.max_time {horizon.max_time}s"
        return self.signal

    def save_due(self) -> bool:
        interval = self.job.train.save_interval
        return bool(interval and self.job.state.step % interval == 0)

    def save(self, skips: "NonFiniteSteps") -> bool:
        """Write a training checkpoint of this step (all ranks call it), unless one is written already; returns
        whether this step has one. None is written while a non-finite streak is open (the model may be diverging,
        and a good checkpoint must not be pruned for it): every rank knows the streak alike, from all-reduced norms.
        """
        job, state = self.job, self.job.state
        if skips.streak_open:
            job.console.print(f"step {state.step} | no checkpoint: the last {skips.in_a_row} steps' gradient "
                              f"norm was NaN or inf (the last good checkpoint: {job.rewind.checkpoint or 'none'})")
            return False
        if self.last_saved_step != state.step:
            try:
                job.rewind.saved(state.step, job.save_checkpoint(state))
            except NonFiniteWeightsError as error:  # every rank raises it: its check all-reduces
                raise NonFiniteError(f"{error}. {resume_advice(job)}") from None
            self.last_saved_step = state.step
        return True


# --------------------------------------------------------------------------------- validation
def _validate_and_log(job: Fit) -> None:
    """Validate (every rank), log the loss, and put the model back in training mode."""
    state = job.state
    val_loss = validate(job)
    _log(job, {"step": state.step, "tokens": state.tokens, "val_loss": val_loss,
               "val_ppl": math.exp(min(val_loss, 50))}, line=f"step {state.step} | val_loss {val_loss:.4f}")
    job.model.train()


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
    batches = list(itertools.islice(job.val_loader, job.eval.max_iters))
    totals = torch.zeros(2, dtype=torch.float64, device=job.runtime.device)
    totals[0] = model_passes(job).loss_sum(batches).double()
    totals[1] = sum(int((batch["labels"] != IGNORE_INDEX).sum()) for batch in batches)
    totals *= job.runtime.counts_batch  # one rank of each data-parallel shard counts (Runtime.counts_batch)
    job.runtime.all_reduce(totals)
    job.model.train()
    return (totals[0] / totals[1].clamp(min=1)).item()


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


def _log(job: Fit, metrics: dict, line: Optional[str] = None) -> None:
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
