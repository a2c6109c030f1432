"""DeepSpeed's engine around llmtrain's model and optimizer, and the strategy ``fit()`` drives it through.

The recipe builds the model as for one process (:func:`llmtrain.recipes.build.build_model` with the plan's
``deepspeed`` wrapper applies activation checkpointing and compile, then nothing more), builds its torch
optimizer, and hands both to :func:`initialize`. The engine partitions optimizer state, gradients and (stage 3)
parameters over the ranks, casts for bf16 or fp16 and keeps fp32 master weights.

Under stage 3 the recipe builds the model partitioned instead (:func:`llmtrain_deepspeed.build.build_partitioned_model`,
under ``deepspeed.zero.Init``), and the engine takes its parameters as they are.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import warnings

import torch

from llmtrain.distributed.runtime import Runtime
from llmtrain.model import CausalSelfAttention
from llmtrain.train.loop import Fit
from llmtrain.train.nonfinite import NonFiniteSteps
from llmtrain.train.strategy import Strategy


def import_deepspeed(device_type: str):
    """``deepspeed``, set up for a training run: on a CPU its accelerator is the CPU (it would look for a GPU), and
    it logs only warnings (llmtrain prints the run's own lines)."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    # DeepSpeed's ZeRO calls torch's all_gather_into_tensor / reduce_scatter_tensor, which torch 2.13 marks as
    # deprecated, once per step and rank: the run's own output would drown in them.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated")
    if device_type == "cpu":
        # NOTE: DeepSpeed compiles a shared-memory all-reduce (C++, about a minute on the first run) as its CPU
        # backend starts; it serves only inference_all_reduce, which training never calls.
        # (``deepspeed.comm.torch`` as an attribute is torch itself: the module is taken from sys.modules.)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    return deepspeed


def connect(runtime: Runtime):
    """``deepspeed``, with its communication set up on the process group llmtrain created (gloo on a CPU, NCCL on
    GPUs): what ``deepspeed.zero.Init`` and the engine need."""
    deepspeed = import_deepspeed(runtime.device.type)
    backend = "gloo" if runtime.device.type == "cpu" else "nccl"
    # NOTE: the engine asserts LOCAL_RANK is set, which a launcher does; one process (--devices 1) runs unlaunched.
    # On GPUs DeepSpeed also takes it for the index of this rank's GPU (set_device(LOCAL_RANK), its ZeRO buffers),
    # which it is not where a SLURM task sees only its own GPUs (local rank 3 on GPU 0, runtime.gpu_index): it is
    # told the GPU this rank took.
    if runtime.device.type == "cuda":
        os.environ["LOCAL_RANK"] = str(runtime.device.index)
    os.environ.setdefault("LOCAL_RANK", str(runtime.local_rank))
    # NOTE: the default process group exists already (Runtime); DeepSpeed wraps it instead of creating one.
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    return deepspeed


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict, runtime: Runtime):
    """The DeepSpeed engine over ``model`` and ``optimizer`` (a torch optimizer), on the process group llmtrain
    created. The engine is what the loop then calls as the model."""
    deepspeed = connect(runtime)
    # ZeRO-2 fills its reduce buckets in the order gradients become ready, which must be the same on every rank:
    # attention keeps its modules' order (CausalSelfAttention.fuse_projections).
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.fuse_projections = False
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


class DeepSpeedStrategy(Strategy):
    """The :class:`~llmtrain.train.strategy.Strategy` of a DeepSpeed run: ``job.model`` is the engine.

    The loop's loss is already divided by the step's target tokens, so backward does not divide it by the
    accumulation steps again; the engine is told which micro-batch ends the step, reduces the gradients there,
    and at ``step()`` clips, steps (or skips a step whose gradient norm is NaN or inf, backing the fp16 loss
    scale off), and zeroes the gradients.
    """

    def __init__(self, job: Fit) -> None:
        self.engine = job.model
        self.device = job.runtime.device
        self.skips = EngineSkips(job)

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        self.engine.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss  # the engine applies the fp16 loss scale inside backward

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        skipped_before = self.engine.skipped_steps
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        stepped = self.engine.skipped_steps == skipped_before
        self.skips.last_counts = not stepped and self._counts_toward_limit()
        return (torch.tensor(norm, device=self.device), torch.tensor(stepped, device=self.device))

    def _counts_toward_limit(self) -> bool:
        """An fp16 overflow counts only once the loss scale is down to its floor (the scaler's search, as
        :func:`llmtrain.train.nonfinite._skip_update`); in bf16 and fp32 every skipped step counts."""
        if not self.engine.fp16_enabled():
            return True
        return float(getattr(self.engine.optimizer, "cur_scale", 1.0)) <= 1.0


class EngineSkips(NonFiniteSteps):
    """The engine decides on the host whether a step is applied; this reports the skipped ones."""

    def __init__(self, job: Fit) -> None:
        super().__init__(job)
        self.last_counts = False

    def record(self, step: int, tokens: int, epoch: float, grad_norm: torch.Tensor) -> None:
        norm = float(grad_norm)
        if math.isfinite(norm):
            self._finite(step)
        else:
            self._report(step, tokens, epoch, norm, counts=self.last_counts)
