"""Learning-rate schedule: linear warmup, then cosine (or linear) decay to ``min_lr``.

The rate is a pure function of the step, so resuming needs only the step counter.
"""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, base_lr: float, warmup_steps: int, total_steps: int, min_lr: float,
          decay: str = "cosine") -> float:
    """Learning rate for optimizer step ``step`` (0-based: the rate used for the first update is step 0).

    Warmup rises linearly so that step ``warmup_steps - 1`` uses the full ``base_lr``. Decay runs from
    the end of warmup to ``total_steps``, where the rate reaches ``min_lr``; after that it stays there.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if decay == "constant":
        return base_lr
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if decay == "linear":
        scale = 1.0 - progress
    elif decay == "cosine":
        scale = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr decay {decay!r}; use cosine, linear or constant")
    return min_lr + (base_lr - min_lr) * scale


def check_min_lr(min_lr: float, base_lr: float, decay: str = "cosine") -> None:
    """A decay never climbs: refuse a ``min_lr`` above the optimizer's rate (``recipes.prepare.prepare`` checks the
    flags with this before any worker starts)."""
    if decay != "constant" and min_lr > base_lr:
        raise ValueError(f"--train.min_lr {min_lr:g} is above the learning rate {base_lr:g} (--optimizer.lr): the "
                         f"rate would rise as it decays. Set --train.min_lr to at most {base_lr:g} (0 decays to zero)")


class WarmupDecaySchedule:
    """Sets every param group's lr from :func:`lr_at`, scaled to that group's own base rate."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                 min_lr: float, decay: str = "cosine") -> None:
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr = min_lr
        self.decay = decay
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        check_min_lr(min_lr, optimizer.param_groups[0]["initial_lr"], decay)

    def set_step(self, step: int) -> float:
        """Set the rates for optimizer step ``step`` and return the first group's rate."""
        for group in self.optimizer.param_groups:
            base = group["initial_lr"]
            # NOTE: min_lr is absolute for the main group; other groups keep the same ratio.
            group_min = self.min_lr * base / self.optimizer.param_groups[0]["initial_lr"]
            group["lr"] = lr_at(step, base_lr=base, warmup_steps=self.warmup_steps,
                                total_steps=self.total_steps, min_lr=group_min, decay=self.decay)
        return self.optimizer.param_groups[0]["lr"]
