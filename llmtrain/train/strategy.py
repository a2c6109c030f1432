"""The extension API of the training loop: :class:`Strategy`, what the data-parallel engine owns in a step.

``fit()`` (:mod:`llmtrain.train.loop`) calls only the methods of :class:`Strategy`, whatever the engine:
gradient sync, backward, clipping and the gradient norm, the optimizer step (or its skip) and zero_grad. A run's
``Fit.strategy`` builds one from the job (:class:`llmtrain.train.loop.Fit`); its ``skips`` is a
:class:`llmtrain.train.nonfinite.NonFiniteSteps` that reports the steps it skipped. :class:`TorchStrategy`, the
reference implementation, is torch's own engine (one process, DDP, FSDP); an extension implements the interface
for another engine (``llmtrain_deepspeed.engine.DeepSpeedStrategy`` for DeepSpeed).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from llmtrain.distributed.grad_norm import clip_grad_norm_
from llmtrain.float8 import precompute_scales
from llmtrain.train.nonfinite import NonFiniteSteps, SkipOnDevice

if TYPE_CHECKING:
    from llmtrain.train.loop import Fit


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
        if getattr(job.model, "gathers_float8_weights", False):  # parallelize: FSDP all-gathers them in float8
            precompute_scales(job.model)
        job.optimizer.zero_grad(set_to_none=True)
        return grad_norm.detach(), stepped


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
