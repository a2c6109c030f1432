"""``fit()``: the one training loop that every recipe calls.

The parts, one job each, each in a module of its own: :class:`~llmtrain.train.step.TrainStep` (one optimizer step
over the micro-batches, the loss scaled by the step's target tokens over all ranks) and
:class:`~llmtrain.train.step.ModelPasses` (the model's forward and backward passes; under pipeline parallelism
``Fit.pipeline`` takes its place) in :mod:`llmtrain.train.step`; :class:`~llmtrain.train.strategy.Strategy` (what
the data-parallel engine owns: gradient sync, backward, clipping and the gradient norm, the optimizer step and
zero_grad; :class:`~llmtrain.train.strategy.TorchStrategy` for torch's own DDP and FSDP, ``llmtrain_deepspeed``
for DeepSpeed) in :mod:`llmtrain.train.strategy`, the extension API;
:class:`~llmtrain.train.nonfinite.NonFiniteSteps` (what a NaN or inf gradient norm does) and
:class:`~llmtrain.train.nonfinite.Rewind` (where a diverging run goes back to) in :mod:`llmtrain.train.nonfinite`;
:class:`~llmtrain.train.metrics.LogInterval` (the numbers of a log line) in :mod:`llmtrain.train.metrics`;
:class:`~llmtrain.train.stop.StopPolicy` (when to stop and when to save) in :mod:`llmtrain.train.stop`; the run's
length (:class:`~llmtrain.train.horizon.Horizon`) in :mod:`llmtrain.train.horizon`. :class:`Trainer` drives them;
validation lives here. Code from outside the loop (--profile's profiler, a test's fault injector) hooks in through
:mod:`llmtrain.callbacks`.

Faults. The ranks agree to stop after the same step without a collective of their own (their votes ride in the
all-reduce that opens every step: :mod:`llmtrain.train.stop`); on a signal they checkpoint and raise ``Preempted``
(exit 75). A step whose global gradient norm is NaN or inf changes nothing, and ``--train.max_nonfinite_steps`` of
them in a row stop the run (:mod:`llmtrain.train.nonfinite`).

Host-device synchronisation: a step reads nothing from the device, except, for an optimizer that cannot skip a
non-finite step itself, whether its gradient norm is finite (:mod:`llmtrain.train.nonfinite`); the host numbers'
sums come back asynchronously (:mod:`llmtrain.train.step`), so the host stays at most one step ahead of the device.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch

from llmtrain.args import BatchPlan, EvalArgs, TrainArgs
from llmtrain.config import Config
from llmtrain.distributed.runtime import Runtime
from llmtrain.loss import IGNORE_INDEX
from llmtrain import callbacks
from llmtrain.train.experts import ExpertBalance
from llmtrain.train.horizon import Horizon
from llmtrain.train.loggers import Console
from llmtrain.train.metrics import LogInterval, log_metrics
from llmtrain.train.nonfinite import NonFiniteError, Rewind, resume_advice
from llmtrain.precision import Precision
from llmtrain.train.schedule import WarmupDecaySchedule
from llmtrain.signals import PREEMPTED_EXIT_CODE, Preempted, StopRequest, catch_stop_signals
from llmtrain.train.step import TrainStep, model_passes
from llmtrain.train.stop import StopPolicy
from llmtrain.train.strategy import TorchStrategy

if TYPE_CHECKING:
    from llmtrain.train.strategy import Strategy


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
    """Builds the run's :class:`~llmtrain.train.strategy.Strategy` from this job; None:
    :class:`~llmtrain.train.strategy.TorchStrategy` (one process, DDP, FSDP)."""
    rewind: Rewind = field(default_factory=Rewind)
    """The last good checkpoint and the run's command line, for the messages of a diverging run."""
    config: Optional[Config] = None
    """The architecture, for a mixture of experts' settings (:mod:`llmtrain.train.experts`); None reads the MoE
    layers from the model (one process)."""


def fit(job: Fit) -> TrainState:
    """Train until the first stop condition, validating, logging and checkpointing on the way.

    Raises :class:`~llmtrain.signals.Preempted` (exit code 75) after writing a checkpoint when SIGTERM or
    SIGUSR1 reached any rank (none while non-finite steps run on: :class:`~llmtrain.train.nonfinite.Rewind`), and
    :class:`~llmtrain.train.nonfinite.NonFiniteError` after ``--train.max_nonfinite_steps`` skipped steps in a row,
    at the end of a run whose last steps were skipped, or when the weights hold NaN or inf.
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
        self.experts = ExpertBalance(job)
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
            self.experts.after_step()
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
            self.interval.log(lr, grad_norm, self.experts.interval_metrics())
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


def _validate_and_log(job: Fit) -> None:
    """Validate (every rank), log the loss, and put the model back in training mode."""
    state = job.state
    val_loss = validate(job)
    log_metrics(job, {"step": state.step, "tokens": state.tokens, "val_loss": val_loss,
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
