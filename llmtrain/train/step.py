"""One optimizer step: :class:`TrainStep` over a step's micro-batches, and the model's passes it runs.

A step gathers ``grad_accum_steps`` micro-batches, counts their target tokens over every data-parallel rank, and
scales each micro-batch's summed loss by that count, so padding, accumulation and the number of ranks never change
the gradient. :class:`ModelPasses` runs the model's forward and backward passes (under pipeline parallelism
``Fit.pipeline`` takes its place); the strategy (:mod:`llmtrain.train.strategy`) syncs, clips and steps.

Host-device synchronisation. The step's target-token count travels to the device asynchronously from pinned
memory. The host numbers' sums come back the same way (:class:`HostSums`), and the host reads them after the
step, once the device has run that opening all-reduce: this waits for the step before to finish on the
device, never for this one, so the host stays at most one step ahead of the device, which is all the
run-ahead that hiding kernel launches needs. (On a CPU the sums are in host memory at once.) Where the skip of a
non-finite step is decided, and whether that reads the device, see :mod:`llmtrain.train.nonfinite`.

NOTE: these numbers went over a gloo group of their own for a while, which waits for no device. On
several GPU nodes that made every step pay a TCP all-reduce across the nodes (through the interface
GLOO_SOCKET_IFNAME names), beside the NCCL one the step makes anyway. Now a step's collectives are
all on the run's device: NCCL on GPUs, gloo only for a CPU run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

from llmtrain.loss import IGNORE_INDEX
from llmtrain import callbacks
from llmtrain.moe import moe_layers
from llmtrain.train.experts import set_step_aux_scale

if TYPE_CHECKING:
    from llmtrain.train.loop import Fit
    from llmtrain.train.strategy import Strategy


PHASES = {phase: f"llmtrain.{phase}" for phase in ("data", "forward", "backward", "optimizer")}
"""The profiler's labels of a step's phases (``--profile`` traces show them; scripts/profile_step.py sums them):
waiting for the micro-batches, the model's forward (loss included), its backward (gradient sync included) and the
strategy's step (clipping, optimizer step and zero_grad)."""


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
        self.has_moe = bool(moe_layers(job.model))

    def __call__(self, step: int, micro_batches: list[dict], host_numbers: list[float]) -> StepResult:
        """Train one step; ``host_numbers`` (what this rank's host knows) are summed over the ranks on the way."""
        job = self.job
        target_tokens, host_sums = self.counts(micro_batches, host_numbers)
        # Each rank's loss is its share of (sum over the step's tokens) / (token count of the step);
        # DDP, FSDP and DeepSpeed average gradients over ranks, hence the factor data_parallel_size.
        loss_scale = job.runtime.data_parallel_size / target_tokens.clamp(min=1).float()
        if self.has_moe:  # the balancing losses: a mean over this rank's micro-batches (llmtrain.train.experts)
            set_step_aux_scale(self.strategy, len(micro_batches), job.runtime.device)
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
