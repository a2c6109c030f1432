"""The parallel plan: how a run is laid out over processes, resolved once from the flags.

:meth:`ParallelPlan.resolve` turns ``--devices``, ``--num_nodes``, ``--strategy``, ``--fsdp.*``, the batch
flags and ``--precision`` into one frozen object, and every bad combination into one ``ValueError`` that
names the flag and the fix. It is pure arithmetic: it runs in the launching process before any worker
starts (and, under torchrun or srun, in every rank before the process group exists), in ``--dry_run`` on a
laptop, and in ``llmtrain benchmark``. Everything downstream reads the plan and derives nothing again:
the launcher (world size), :func:`llmtrain.distributed.parallelize.parallelize` (wrapper, mesh, offload),
the memory estimate, the dry run and ``fit()`` (the batch plan).

The mesh has four named dimensions, outermost first::

    pp × dp_replicate × dp_shard × tp

``dp_replicate × dp_shard`` is the data-parallel size. FULL_SHARD and SHARD_GRAD_OP shard over every rank
(``dp_shard = world``); HYBRID_SHARD replicates across nodes and shards within one (``dp_replicate =
num_nodes``); NO_SHARD (DDP) replicates everywhere. Tensor and pipeline degrees are 1 until llmtrain grows
tensor and pipeline parallelism; the plan already checks that they divide the world.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Optional

import torch

from llmtrain.args import BatchDefaults, BatchPlan, FSDPArgs, TrainArgs, batch_plan
from llmtrain.train.precision import Precision, resolve_precision

Wrapper = Literal["none", "ddp", "fsdp"]
DeviceType = Literal["cpu", "cuda"]
STRATEGIES = ("auto", "ddp", "fsdp")
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelPlan:
    """One run's layout: processes, mesh dimensions, data-parallel wrapper, batch plan and precision."""

    devices: int
    """Processes per node."""
    num_nodes: int
    dp_replicate: int
    """Ranks that hold the same parameter shard (across nodes under HYBRID_SHARD; every rank under DDP)."""
    dp_shard: int
    """Ranks a parameter is split over (1 without FSDP)."""
    wrapper: Wrapper
    """The data-parallel wrapper: none (one process), ddp or fsdp."""
    sharding_strategy: Optional[str]
    """FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD; None without a wrapper."""
    batch: BatchPlan
    precision: Precision
    device_type: DeviceType
    tp: int = 1
    pp: int = 1
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    """FSDP keeps parameters, gradients and optimizer state in host memory (applied only under FSDP)."""
    grad_sync_only_last: bool = False
    """Gradients are reduced only after the last micro-batch of a step (only with a wrapper and accumulation)."""
    batch_problem: Optional[str] = None
    """Why the batch does not divide (only a dry run's plan, resolved with ``strict_batch=False``, has one)."""

    # ------------------------------------------------------------------------------------ questions
    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is split over: what divides each rank's parameters, gradients and moments."""
        return self.dp_shard

    @property
    def uses_process_group(self) -> bool:
        """Several processes, or FSDP on one (``--strategy fsdp --devices 1``, e.g. for CPU offload on a GPU)."""
        return self.world_size > 1 or self.wrapper != "none"

    @property
    def reshard_after_forward(self) -> bool:
        return self.sharding_strategy != "SHARD_GRAD_OP"

    @property
    def mixed_precision_policy(self) -> bool:
        """FSDP casts parameters for compute itself, so fit() must not autocast as well."""
        return self.wrapper == "fsdp" and self.precision.is_mixed

    def mesh_shape(self) -> dict[str, int]:
        """The mesh dimensions larger than one, outermost first (for FSDP: at least ``dp_shard``)."""
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        shape = {name: size for name, size in sizes.items() if size > 1}
        if not shape and self.wrapper == "fsdp":
            shape = {"dp_shard": 1}
        if not shape and self.wrapper == "ddp":
            shape = {"dp_replicate": 1}
        return shape

    def build_mesh(self):
        """The named DeviceMesh of this plan (needs the process group); None without a wrapper."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = self.mesh_shape()
        if self.wrapper == "none" or not shape:
            return None
        return init_device_mesh(self.device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))

    def describe_mesh(self) -> str:
        """ "replicate 2 × shard 2" """
        words = {"pp": "pipeline", "dp_replicate": "replicate", "dp_shard": "shard", "tp": "tensor"}
        return " × ".join(f"{words[name]} {size}" for name, size in self.mesh_shape().items())

    def describe(self) -> str:
        """The run's one-line layout, e.g. "fsdp, FULL_SHARD, mesh shard 2 | world 2, micro batch 8, ...". """
        layout = ("no data-parallel wrapper, one process" if self.wrapper == "none" else
                  f"{self.wrapper}, {self.sharding_strategy}, mesh {self.describe_mesh()}")
        extras = [name for name, on in (("activation checkpointing", self.activation_checkpointing),
                                        ("CPU offload", self.cpu_offload)) if on]
        batch = (f"micro batch {self.batch.micro_batch_size}, global batch {self.batch.global_batch_size}, "
                 f"grad accumulation {self.batch.grad_accum_steps}" if self.batch_problem is None else
                 "batch does not divide")
        return " | ".join([", ".join([layout, *extras]), f"world {self.world_size}, {batch}",
                           f"{self.devices} per node × {self.num_nodes} node{'s' * (self.num_nodes > 1)} on "
                           f"{self.device_type}", f"precision {self.precision.describe()}"])

    # ------------------------------------------------------------------------------------ resolving
    @classmethod
    def resolve(cls, *, devices: int, num_nodes: int, train: TrainArgs, precision: Precision | str,
                strategy: str = "auto", fsdp: Optional[FSDPArgs] = None, accelerator: str = "auto",
                device_type: Optional[DeviceType] = None, strict_batch: bool = True,
                batch_defaults: BatchDefaults = BatchDefaults(), gpu: Optional[str] = None) -> "ParallelPlan":
        """Check the flags against each other and lay the run out; a bad combination raises ``ValueError``.

        ``device_type`` overrides what ``accelerator`` resolves to on this machine (the dry run plans for
        GPUs it does not have, ``gpu`` names the one it plans for). With ``strict_batch=False`` a batch that
        does not divide is recorded in ``batch_problem`` instead of raised, so that the dry run can still print
        the rest of the plan. ``batch_defaults`` fill the batch sizes the flags leave unset.
        """
        fsdp = fsdp or FSDPArgs()
        if devices < 1 or num_nodes < 1:
            raise ValueError(f"--devices {devices} and --num_nodes {num_nodes} must both be at least 1")
        if strategy not in STRATEGIES:
            raise ValueError(f"--strategy {strategy!r} must be one of {', '.join(STRATEGIES)}")
        device_type = device_type or resolve_device_type(accelerator)
        if not isinstance(precision, Precision):
            precision = resolve_precision(precision, device_type, gpu=gpu)
        world = devices * num_nodes
        wrapper, sharding = _wrapper(strategy, fsdp, world, num_nodes)
        _check_single_process_flags(wrapper, fsdp, strategy)
        if fsdp.cpu_offload and wrapper != "fsdp":
            raise ValueError("--fsdp.cpu_offload needs a sharded strategy; DDP (NO_SHARD) keeps every weight on the "
                             "device. Use --fsdp.sharding_strategy FULL_SHARD, or drop --fsdp.cpu_offload")
        dp_replicate, dp_shard = _data_parallel_dims(sharding, world, num_nodes)
        batch, batch_problem = _batch(train, dp_replicate * dp_shard, strict_batch, batch_defaults)
        plan = cls(devices=devices, num_nodes=num_nodes, dp_replicate=dp_replicate, dp_shard=dp_shard,
                   wrapper=wrapper, sharding_strategy=sharding, batch=batch, precision=precision,
                   device_type=device_type, activation_checkpointing=fsdp.activation_checkpointing,
                   cpu_offload=fsdp.cpu_offload, batch_problem=batch_problem)
        plan.check_mesh()
        syncs_once = fsdp.skip_gradient_sync and wrapper != "none" and plan.batch.grad_accum_steps > 1
        return replace(plan, grad_sync_only_last=syncs_once)

    def check_mesh(self) -> None:
        """The mesh dimensions multiply to the world size, and each divides what it splits."""
        for name in MESH_DIMS:
            if getattr(self, name) < 1:
                raise ValueError(f"mesh dimension {name} is {getattr(self, name)}; every dimension must be at least 1")
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ValueError(f"the mesh pp {self.pp} × dp_replicate {self.dp_replicate} × dp_shard {self.dp_shard} × "
                             f"tp {self.tp} = {product} ranks, but --devices {self.devices} × --num_nodes "
                             f"{self.num_nodes} start {self.world_size}")
        if self.tp > 1 and self.devices % self.tp:
            raise ValueError(f"tensor parallelism of degree {self.tp} must fit in one node of {self.devices} devices")


def _batch(train: TrainArgs, data_parallel_size: int, strict: bool,
           defaults: BatchDefaults) -> tuple[BatchPlan, Optional[str]]:
    try:
        return batch_plan(train, data_parallel_size, defaults=defaults), None
    except ValueError as error:
        if strict:
            raise
        return batch_plan(train, data_parallel_size, strict=False, defaults=defaults), str(error)


def resolve_device_type(accelerator: str, *, here: bool = True) -> DeviceType:
    """``auto`` is cuda when this machine sees a GPU; ``gpu`` is cuda. ``here``: cuda must be visible now."""
    if accelerator not in ("auto", "cpu", "cuda", "gpu"):
        raise ValueError(f"--accelerator {accelerator!r} must be auto, cpu, cuda or gpu")
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cpu":
        return "cpu"
    if here and not torch.cuda.is_available():
        raise ValueError(f"--accelerator {accelerator}: this machine sees no CUDA device; use --accelerator cpu or "
                         "auto, or check CUDA_VISIBLE_DEVICES and the driver")
    return "cuda"


def _wrapper(strategy: str, fsdp: FSDPArgs, world: int, num_nodes: int) -> tuple[Wrapper, Optional[str]]:
    """The data-parallel wrapper and the user-facing sharding strategy."""
    if strategy == "ddp":
        if fsdp.sharding_strategy not in (None, "NO_SHARD"):
            raise ValueError(f"--strategy ddp contradicts --fsdp.sharding_strategy {fsdp.sharding_strategy}; "
                             "use --strategy fsdp for sharding, or drop --fsdp.sharding_strategy")
        if world == 1:
            raise ValueError("--strategy ddp needs several processes (DDP averages gradients across them); pass "
                             "--devices 2 or more, or drop --strategy")
        return "ddp", "NO_SHARD"
    if fsdp.sharding_strategy == "HYBRID_SHARD" and num_nodes == 1:
        raise ValueError("--fsdp.sharding_strategy HYBRID_SHARD replicates across nodes and shards within each, so it "
                         "needs --num_nodes 2 or more; on one node use FULL_SHARD (the default)")
    if world == 1 and strategy == "auto":
        return "none", None
    chosen = fsdp.sharding_strategy or ("HYBRID_SHARD" if num_nodes > 1 else "FULL_SHARD")
    if chosen == "NO_SHARD":
        if strategy == "fsdp":
            raise ValueError("--strategy fsdp contradicts --fsdp.sharding_strategy NO_SHARD (that is DDP); "
                             "use --strategy ddp, or another --fsdp.sharding_strategy")
        if world == 1:
            raise ValueError("--fsdp.sharding_strategy NO_SHARD (DDP) needs several processes; pass --devices 2 or "
                             "more, or drop the flag")
        return "ddp", "NO_SHARD"
    return "fsdp", chosen


def _check_single_process_flags(wrapper: Wrapper, fsdp: FSDPArgs, strategy: str) -> None:
    """With one process and no wrapper, an FSDP flag would be accepted and ignored: refuse it instead."""
    if wrapper != "none":
        return
    defaults = FSDPArgs()
    ignored = [f"--fsdp.{name} {getattr(fsdp, name)}" for name in ("sharding_strategy", "cpu_offload",
                                                                    "skip_gradient_sync")
               if getattr(fsdp, name) != getattr(defaults, name)]
    if ignored:
        raise ValueError(f"{', '.join(ignored)} needs --devices 2 or more: one process uses no data-parallel wrapper, "
                         "so it would do nothing. Or pass --strategy fsdp to run FSDP on one device (e.g. to offload "
                         "to the CPU on a GPU), or drop the flag")


def _data_parallel_dims(sharding: Optional[str], world: int, num_nodes: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for a sharding strategy: the one place the shard size is worked out."""
    if sharding is None:
        return 1, 1
    if sharding == "NO_SHARD":
        return world, 1
    if sharding == "HYBRID_SHARD":
        return num_nodes, world // num_nodes
    return 1, world
