"""How long a run lasts: the schedule length and every stop condition the user set.

:func:`plan_horizon` turns ``--train.max_steps``, ``--train.max_tokens`` and ``--train.epochs`` into the step count
of the learning-rate schedule (:mod:`llmtrain.train.schedule`); :class:`llmtrain.train.stop.StopPolicy` stops the run
at the first of them, or at ``--train.max_time``. A length the flags give is never capped by a default one: a recipe
fills in its default length only where the flags set none (:func:`llmtrain.recipes.hub.with_default_length`), and
:meth:`Horizon.describe` prints the length a run starts with and the limits it will not reach.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Optional

from llmtrain.args import TrainArgs


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
    limits: dict[str, int] = field(default_factory=dict)
    """The last step of each stop condition that sizes the run (:func:`step_limits`), set_by's the smallest."""
    samples_per_step: Optional[int] = None
    samples_per_epoch: Optional[int] = None
    tokens_per_step: Optional[int] = None

    def describe(self) -> str:
        """The run's length as it starts: ``training 200 steps = 52.5 epochs of 61 samples (--train.max_steps
        200)``, and the limits that come later, so a cap the user did not expect is read before the run."""
        if self.samples_per_epoch and self.samples_per_step:
            epochs = self.total_steps * self.samples_per_step / self.samples_per_epoch
            size = f"{epochs:.3g} epoch{'' if epochs == 1 else 's'} of {self.samples_per_epoch:,} samples"
        else:
            size = f"{self.total_steps * (self.tokens_per_step or 0):,} tokens"
        later = [f"{flag} (step {step:,})" for flag, step in self.limits.items() if flag != self.set_by]
        why = f"{self.set_by}, which ends it before {' and '.join(later)}" if later else self.set_by
        if self.max_time is not None:
            why += f"; --train.max_time {self.max_time:g}s may stop it sooner"
        return f"training {self.total_steps:,} steps = {size} ({why})"


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
                   max_tokens=train.max_tokens, epochs=train.epochs, max_time=train.max_time, set_by=set_by,
                   limits=limits, samples_per_step=train.global_batch_size, samples_per_epoch=samples_per_epoch,
                   tokens_per_step=tokens_per_step)
