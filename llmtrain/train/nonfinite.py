"""What a step whose global gradient norm is NaN or inf does, and where a diverging run goes back to.

A NaN loss makes NaN gradients. Such a step changes nothing: no optimizer step, gradients zeroed, the fp16 loss
scale backed off; it is logged, and ``--train.max_nonfinite_steps`` of them in a row stop the run
(:class:`NonFiniteError`). The norm is already reduced over all ranks (the DDP gradients are, the FSDP norm is
all-reduced by clipping), so every rank decides alike. :class:`Rewind` names the last good checkpoint and the
command that resumes it with a lower learning rate.

Host-device synchronisation. Optimizers that take ``found_inf`` (fused Adam/AdamW, the default,
without an fp16 loss scaler) never wait for a step to finish between log, eval and checkpoint steps:
the optimizer skips a non-finite step on the device (its step counter too), the loss sums mask it
out, and the norms of the steps since the last read are read together at the next log or checkpoint
step, where skipped steps are logged with their step numbers and ``--train.max_nonfinite_steps`` is
enforced (before any save, so the limit still holds at every checkpoint; a skipped step leaves the
weights finite anyway; no checkpoint is written while such skips run on, see :class:`Rewind`). Any
other optimizer must be told on the host whether to step, so once per step, after clipping, the host
reads whether the norm is finite: the step's only synchronisation (the rest of the step reads nothing:
:mod:`llmtrain.train.step`).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from llmtrain.train.metrics import log_metrics

if TYPE_CHECKING:
    from llmtrain.train.loop import Fit


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a NaN or inf gradient norm."""

    exit_status = 1
    """Told in one line (llmtrain.errors): the run stopped itself with a reason; its checkpoints are sound."""


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
        checkpoint is written then (:meth:`llmtrain.train.stop.StopPolicy.save`). fp16 overflows, the loss scale's
        search, open none."""
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
        log_metrics(self.job, {"step": step, "tokens": tokens, "epoch": epoch, "grad_norm": grad_norm, "skipped": 1,
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
