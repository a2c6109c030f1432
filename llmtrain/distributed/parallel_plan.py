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

``tp`` (``--tp_size``) and ``pp`` (``--pp_size``) split the model; the ranks left, ``world / (tp × pp)``, are
the data-parallel ranks, ``dp_replicate × dp_shard`` of them. FULL_SHARD and SHARD_GRAD_OP shard over all of
them; HYBRID_SHARD shards within a node and replicates across nodes; NO_SHARD (DDP) replicates everywhere.
Tensor parallelism is innermost, so its ranks are neighbours on one node (its collectives run every layer);
the pipeline is outermost (it sends one activation per micro-batch and stage).

Expert parallelism (``--ep_size``) adds no ranks: as torchtitan's, it borrows them from the data-parallel shard.
For the routed experts of an MoE the ``dp_shard`` dimension is read as two, ``dp_shard_mod_ep × ep``
(:meth:`ParallelPlan.expert_mesh`): each expert lives on one ``ep`` rank and is FSDP-sharded over the
``dp_shard_mod_ep`` ranks that hold the same experts; every other weight is sharded over all of ``dp_shard``.
The ``ep`` ranks are neighbours within ``dp_shard`` (inner), so its all-to-alls stay on a node when they can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal, Optional, Union, get_args

import torch

from llmtrain.args import BatchDefaults, BatchPlan, FSDPArgs, TrainArgs, batch_plan
from llmtrain.precision import Precision, resolve_precision

Wrapper = Literal["none", "ddp", "fsdp", "deepspeed"]
DeviceType = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class ZeroSettings:
    """What DeepSpeed's ZeRO shards and offloads (``--strategy deepspeed_*`` or ``--deepspeed.config``)."""

    stage: int
    """1: optimizer state sharded over the data-parallel ranks; 2: and gradients; 3: and parameters."""
    offload_optimizer: bool = False
    """The optimizer state (fp32 master weights and moments) and its step live in host memory."""
    offload_parameters: bool = False
    """Stage 3: the parameter shards live in host memory too."""

    def describe(self) -> str:
        offloaded = [what for what, on in (("optimizer", self.offload_optimizer),
                                           ("parameters", self.offload_parameters)) if on]
        return f"ZeRO stage {self.stage}" + (f", {' and '.join(offloaded)} offloaded to the CPU" if offloaded else "")


DEEPSPEED_STRATEGIES = {
    "deepspeed_stage_1": ZeroSettings(1),
    "deepspeed_stage_2": ZeroSettings(2),
    "deepspeed_stage_2_offload": ZeroSettings(2, offload_optimizer=True),
    "deepspeed_stage_3": ZeroSettings(3),
    "deepspeed_stage_3_offload": ZeroSettings(3, offload_optimizer=True, offload_parameters=True),
}
"""Lightning's strategy names; plain ``deepspeed`` takes the stage from ``--deepspeed.config``."""
StrategyName = Literal["auto", "ddp", "fsdp", "deepspeed", "deepspeed_stage_1", "deepspeed_stage_2",
                       "deepspeed_stage_2_offload", "deepspeed_stage_3", "deepspeed_stage_3_offload"]
"""``--strategy``: torch's own data parallelism, or DeepSpeed ZeRO (extensions/deepspeed)."""
STRATEGIES = get_args(StrategyName)
assert set(STRATEGIES) == {"auto", "ddp", "fsdp", "deepspeed", *DEEPSPEED_STRATEGIES}
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
"""``--pp_schedule``: the order a pipeline rank runs its micro-batches' forwards and backwards in."""
PIPELINE_SCHEDULES = get_args(PipelineSchedule)
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
EXPERT_MESH_DIMS = ("dp_shard_mod_ep", "ep")
"""What the expert weights see ``dp_shard`` as: the ranks that shard one expert, and the ranks the experts are split
over (inner)."""


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
    """Tensor-parallel degree (``--tp_size``): ranks one block's heads and MLP are split over."""
    pp: int = 1
    """Pipeline stages' ranks (``--pp_size``)."""
    ep: int = 1
    """Expert-parallel degree (``--ep_size``): each MoE block's routed experts are split over ``ep`` ranks, taken
    from the data-parallel shard (``ep`` divides ``dp_shard``), with an all-to-all that sends each token to its
    experts' rank. Non-expert weights stay sharded over ``dp_shard``; expert weights over ``dp_shard / ep``."""
    sequence_parallel: bool = False
    """Under tensor parallelism, norms and the residual stream are split over the sequence."""
    pp_schedule: Optional[str] = None
    """gpipe, 1f1b or interleaved_1f1b under pipeline parallelism, else None."""
    pp_virtual_stages: int = 1
    """Pipeline stages per pipeline rank (more than one only for interleaved_1f1b)."""
    activation_checkpointing: Union[bool, str] = False
    """False, "full", "selective:N" or "op" (``--fsdp.activation_checkpointing``, in llmtrain.args' spelling)."""
    cpu_offload: bool = False
    """FSDP keeps parameters, gradients and optimizer state in host memory (applied only under FSDP)."""
    grad_sync_only_last: bool = False
    """Gradients are reduced only after the last micro-batch of a step (only with a wrapper and accumulation)."""
    zero: Optional[ZeroSettings] = None
    """DeepSpeed's ZeRO settings when the wrapper is ``deepspeed`` (llmtrain_deepspeed), else None."""
    float8: Optional[str] = None
    """``--float8``: tensorwise or rowwise float8 training of the blocks' linear layers (llmtrain.float8), or None."""
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
    def pp_stages(self) -> int:
        """Pipeline stages in all: ``pp × pp_virtual_stages`` (1 without pipeline parallelism)."""
        return self.pp * self.pp_virtual_stages

    @property
    def pp_microbatches(self) -> int:
        """Micro-batches each optimizer step sends through the pipeline: the accumulation steps."""
        return self.batch.grad_accum_steps

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is split over: what divides each rank's parameters, gradients and moments."""
        return self.dp_shard

    @property
    def uses_process_group(self) -> bool:
        """Several processes, or FSDP on one (``--strategy fsdp --devices 1``, e.g. for CPU offload on a GPU)."""
        return self.world_size > 1 or self.wrapper != "none"

    @property
    def splits_model(self) -> bool:
        """Tensor or pipeline parallelism: ranks hold different parts of the model."""
        return self.tp > 1 or self.pp > 1

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP frees a unit's gathered weights after its forward (FULL_SHARD, HYBRID_SHARD without a pipeline).

        NOTE: not under pipeline parallelism, as torchtitan: a stage runs every micro-batch's forward and backward in
        one step, and resharding after each forward would all-gather its weights again for every micro-batch. The
        schedule keeps them gathered through the step's backwards too, and reshards after the last.
        """
        return self.sharding_strategy != "SHARD_GRAD_OP" and self.pp == 1

    @property
    def mixed_precision_policy(self) -> bool:
        """FSDP or DeepSpeed casts parameters for compute itself, so fit() must not autocast as well."""
        return self.wrapper in ("fsdp", "deepspeed") and self.precision.is_mixed

    def mesh_shape(self) -> dict[str, int]:
        """The mesh dimensions larger than one, outermost first (a data-parallel wrapper gets at least one
        data-parallel dimension, of size 1 if need be: ``dp_shard`` for FSDP, ``dp_replicate`` for DDP)."""
        if self.wrapper == "deepspeed":  # DeepSpeed groups the ranks itself: no DeviceMesh
            return {}
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        keep = {name for name, size in sizes.items() if size > 1}
        if self.sharding_strategy == "HYBRID_SHARD":  # both, even of size 1: a 1-D mesh would shard across nodes
            keep |= {"dp_replicate", "dp_shard"}
        if self.wrapper != "none" and not keep & {"dp_replicate", "dp_shard"}:
            keep.add("dp_shard" if self.wrapper == "fsdp" else "dp_replicate")
        return {name: size for name, size in sizes.items() if name in keep}

    def build_mesh(self):
        """The named DeviceMesh of this plan (needs the process group); None for one process without a wrapper.

        Its sub-meshes: :func:`data_parallel_mesh`, ``mesh["tp"]``, ``mesh["pp"]`` (those larger than one).
        """
        from torch.distributed.device_mesh import init_device_mesh

        shape = self.mesh_shape()
        if not shape:
            return None
        return init_device_mesh(self.device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))

    def coordinates(self, mesh, rank: int) -> dict[str, int]:
        """Rank ``rank``'s place: read from ``mesh``, the plan's mesh (:meth:`build_mesh`) as this rank holds it, as
        :func:`mesh_coordinates` names it.

        Without a mesh (one process, or DeepSpeed, which groups the ranks itself) every rank is a data-parallel rank
        of its own; a plan that splits the model over several ranks needs its mesh to tell them apart.
        """
        if mesh is not None:
            return mesh_coordinates(mesh)
        if self.splits_model or not 0 <= rank < self.data_parallel_size:
            raise ValueError(f"rank {rank} of a plan with mesh {self.describe_mesh()}: its place is the mesh's to "
                             "tell; build the mesh (ParallelPlan.build_mesh) first")
        return _coordinates(data_parallel_rank=rank, data_parallel_size=self.data_parallel_size)

    @property
    def expert_shard_size(self) -> int:
        """Ranks one routed expert's weights are FSDP-sharded over: ``dp_shard / ep`` (``dp_shard_mod_ep``)."""
        return self.dp_shard // self.ep

    def expert_mesh(self, mesh):
        """The plan's ``mesh`` as the routed experts see it: its ``dp_shard`` dimension unflattened into
        ``dp_shard_mod_ep × ep`` (:data:`EXPERT_MESH_DIMS`), the other dimensions as they are; None when ``ep`` is 1.

        It shares ``mesh``'s ranks (the same root mesh); its two new dimensions get process groups of their own, made
        once per mesh (every rank calls this in the same order: parallelize, for each pipeline stage).
        """
        if self.ep == 1 or mesh is None:
            return None
        cached = getattr(mesh, "_llmtrain_expert_mesh", None)
        if cached is None:
            cached = mesh._unflatten("dp_shard", (self.expert_shard_size, self.ep), EXPERT_MESH_DIMS)
            mesh._llmtrain_expert_mesh = cached
        return cached

    def node_and_local_rank(self, rank: int) -> tuple[int, int]:
        """(node, local rank) of ``rank``: the inverse of :func:`global_rank`."""
        return divmod(rank, self.devices)

    def first_rank_of_stage(self, pp_rank: int) -> int:
        """The lowest rank of pipeline rank ``pp_rank``: the pipeline is the mesh's outermost dimension, so each of its
        ranks holds ``world / pp`` consecutive ranks."""
        return pp_rank * self.world_size // self.pp

    def describe_mesh(self) -> str:
        """ "replicate 2 × shard 2" """
        words = {"pp": "pipeline", "dp_replicate": "replicate", "dp_shard": "shard", "tp": "tensor"}
        described = []
        for name, size in self.mesh_shape().items():
            described.append(f"{words[name]} {size}")
            if name == "dp_shard" and self.ep > 1:
                described[-1] += f" (experts: shard {self.expert_shard_size} × expert {self.ep})"
        return " × ".join(described)

    def describe(self) -> str:
        """The run's one-line layout, e.g. "fsdp, FULL_SHARD, mesh shard 2 | world 2, micro batch 8, ...". """
        layout = ("no data-parallel wrapper, one process" if self.wrapper == "none" else
                  f"{self.wrapper}, {self.sharding_strategy}, mesh {self.describe_mesh()}")
        if self.wrapper == "none" and self.splits_model:
            layout = f"no data-parallel wrapper, mesh {self.describe_mesh()}"
        if self.zero is not None:
            layout = f"deepspeed, {self.zero.describe()} over {self.data_parallel_size} rank(s)"
        extras = [name for name, on in ((f"expert parallel {self.ep}", self.ep > 1),
                                        ("sequence parallel", self.sequence_parallel),
                                        (f"pipeline schedule {self.pp_schedule}"
                                         + (f" × {self.pp_virtual_stages} stages per rank"
                                            if self.pp_virtual_stages > 1 else ""), self.pp > 1),
                                        (f"activation checkpointing {self.activation_checkpointing}",
                                         self.activation_checkpointing),
                                        ("CPU offload", self.cpu_offload),
                                        (f"float8 {self.float8}", self.float8)) if on]
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
                batch_defaults: BatchDefaults = BatchDefaults(), gpu: Optional[str] = None, tp: int = 1,
                pp: int = 1, sequence_parallel: Optional[bool] = None, pp_schedule: Optional[str] = None,
                pp_virtual_stages: Optional[int] = None, zero: Optional[ZeroSettings] = None,
                float8: Optional[str] = None, ep: int = 1) -> "ParallelPlan":
        """Check the flags against each other and lay the run out; a bad combination raises ``ValueError``.

        ``device_type`` overrides what ``accelerator`` resolves to on this machine (the dry run plans for
        GPUs it does not have, ``gpu`` names the one it plans for). With ``strict_batch=False`` a batch that
        does not divide is recorded in ``batch_problem`` instead of raised, so that the dry run can still print
        the rest of the plan. ``batch_defaults`` fill the batch sizes the flags leave unset. ``tp``, ``pp``,
        ``sequence_parallel``, ``pp_schedule`` and ``pp_virtual_stages`` are ``--tp_size``,
        ``--tp_sequence_parallel``, ``--pp_size``, ``--pp_schedule`` and ``--pp_virtual_stages``; ``ep``
        ``--ep_size`` (whether the model has experts to split is :meth:`check_model`'s). ``zero``: the
        ZeRO settings a ``--deepspeed.config`` file holds (which a named ``deepspeed_*`` strategy must agree with).
        ``float8``: ``--float8``, checked against the device, the precision and the layout.
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
        _check_float8(float8, device_type=device_type, precision=precision, gpu=gpu, strategy=strategy, tp=tp)
        split = _model_split(tp, pp, sequence_parallel, pp_schedule, pp_virtual_stages, devices, world)
        if ep < 1:
            raise ValueError(f"--ep_size {ep} must be at least 1 (1: every rank holds every expert)")
        if ep > 1 and strategy.startswith("deepspeed"):
            raise ValueError(f"--ep_size {ep} with --strategy {strategy}: DeepSpeed's ZeRO here shards every weight "
                             "alike and has no expert-parallel groups; use --strategy fsdp (or auto) with --ep_size, "
                             "or drop --ep_size")
        if strategy.startswith("deepspeed"):
            return cls._resolve_deepspeed(strategy, zero, devices=devices, num_nodes=num_nodes, train=train,
                                          precision=precision, fsdp=fsdp, device_type=device_type, split=split,
                                          strict_batch=strict_batch, batch_defaults=batch_defaults,
                                          accelerator=accelerator)
        if zero is not None:
            raise ValueError(f"--deepspeed.config is for --strategy deepspeed or deepspeed_stage_N, not --strategy "
                             f"{strategy}: pass one of those, or drop --deepspeed.config")
        if fsdp.cpu_offload and device_type == "cpu":
            raise ValueError(_offload_on_cpu("--fsdp.cpu_offload true", accelerator, "Drop --fsdp.cpu_offload"))
        dp_world = data_parallel_ranks(world, tp, pp)
        wrapper, sharding = _wrapper(strategy, fsdp, dp_world, num_nodes)
        _check_wrapper_flags(wrapper, fsdp, strategy, world, tp, pp)
        dp_replicate, dp_shard = _data_parallel_dims(sharding, dp_world, num_nodes, devices // tp)
        batch, batch_problem = _batch(train, dp_replicate * dp_shard, strict_batch, batch_defaults)
        _check_expert_parallel(ep, wrapper, dp_shard, split)
        plan = cls(devices=devices, num_nodes=num_nodes, dp_replicate=dp_replicate, dp_shard=dp_shard,
                   wrapper=wrapper, sharding_strategy=sharding, batch=batch, precision=precision,
                   device_type=device_type, activation_checkpointing=fsdp.activation_checkpointing,
                   cpu_offload=fsdp.cpu_offload, batch_problem=batch_problem, float8=float8, ep=ep,
                   **split)
        plan.check_mesh()
        return plan._with_pipeline_and_sync(pp_schedule, fsdp, strict_batch)

    def _with_pipeline_and_sync(self, pp_schedule: Optional[str], fsdp: FSDPArgs,
                                strict_batch: bool) -> "ParallelPlan":
        """This plan with its pipeline schedule settled against its micro-batches (``pp_schedule``: the one asked
        for, if any), and with when gradients are reduced (``--fsdp.skip_gradient_sync``)."""
        plan = self
        if pp_schedule is None and plan.pp > 1 and plan.pp_microbatches < plan.pp:
            # NOTE: 1F1B needs a micro-batch per stage in flight; with fewer (no overlap to gain either way) the
            # default falls back to GPipe, which runs any count. Asked for by name, 1f1b is refused below.
            plan = replace(plan, pp_schedule="gpipe")
        if plan.batch_problem is None:
            problem = plan.pipeline_batch_problem()
            if problem and strict_batch:
                raise ValueError(problem)
            plan = replace(plan, batch_problem=problem)
        # NOTE: a pipeline schedule turns gradient sync off for all but the last micro-batch itself.
        pp = plan.pp
        if pp > 1 and plan.wrapper != "none" and not fsdp.skip_gradient_sync:
            raise ValueError(f"--fsdp.skip_gradient_sync false: under --pp_size {pp} the pipeline schedule reduces the "
                             "gradients once per step, after its last micro-batch, and would ignore the flag; drop it")
        syncs_once = (fsdp.skip_gradient_sync and plan.wrapper != "none" and plan.batch.grad_accum_steps > 1
                      and pp == 1)
        return replace(plan, grad_sync_only_last=syncs_once)

    @classmethod
    def _resolve_deepspeed(cls, strategy: str, zero: Optional[ZeroSettings], *, devices: int, num_nodes: int,
                           train: TrainArgs, precision: Precision, fsdp: FSDPArgs, device_type: DeviceType,
                           split: dict, strict_batch: bool, batch_defaults: BatchDefaults,
                           accelerator: str) -> "ParallelPlan":
        """A DeepSpeed ZeRO plan: every rank a data-parallel one; the flags it cannot honour refused by name."""
        named = DEEPSPEED_STRATEGIES.get(strategy)
        if named is None and zero is None:
            raise ValueError("--strategy deepspeed takes its ZeRO stage from --deepspeed.config FILE; pass one, or name "
                             f"the stage: --strategy {' | '.join(DEEPSPEED_STRATEGIES)}")
        if named is not None and zero is not None and zero != named:
            raise ValueError(f"--strategy {strategy} means {named.describe()}, but --deepspeed.config says "
                             f"{zero.describe()}: pass --strategy deepspeed to take the file's settings, or change it")
        zero = zero or named
        if device_type == "cpu" and (zero.offload_optimizer or zero.offload_parameters):
            if named is not None and named.offload_optimizer:
                raise ValueError(_offload_on_cpu(f"--strategy {strategy}", accelerator,
                                                 f"Use --strategy deepspeed_stage_{zero.stage}"))
            raise ValueError(_offload_on_cpu("--deepspeed.config's zero_optimization offload", accelerator,
                                             'Set the "device" of its offload_optimizer and offload_param to "none"'))
        if split["tp"] > 1 or split["pp"] > 1:
            raise ValueError(f"--strategy {strategy} is data parallelism (ZeRO) alone: drop --tp_size and --pp_size, "
                             "or use --strategy fsdp for tensor and pipeline parallelism")
        defaults = FSDPArgs()
        ignored = [f"--fsdp.{name} {getattr(fsdp, name)}" for name in ("sharding_strategy", "cpu_offload",
                                                                        "state_dict_type", "skip_gradient_sync",
                                                                        "async_save")
                   if getattr(fsdp, name) != getattr(defaults, name)]
        if ignored:
            raise ValueError(f"{', '.join(ignored)} configures FSDP, which --strategy {strategy} does not use: DeepSpeed "
                             "shards by its ZeRO stage, offloads with the *_offload strategies, reduces gradients once "
                             "per step and writes its own checkpoints. Drop the flag")
        if precision.name in ("bf16-true", "16-true"):
            raise ValueError(f"--precision {precision.name}: DeepSpeed always keeps an fp32 master copy of the weights "
                             f"in its optimizer, which is {precision.name.replace('-true', '-mixed')}; pass that, or "
                             "32-true")
        if precision.name == "16-mixed" and device_type == "cpu":
            raise ValueError(f"--precision 16-mixed with --strategy {strategy}: DeepSpeed's CPU accelerator has no fp16; "
                             "on a CPU pass --precision bf16-mixed or 32-true")
        world = devices * num_nodes
        batch, batch_problem = _batch(train, world, strict_batch, batch_defaults)
        return cls(devices=devices, num_nodes=num_nodes, dp_replicate=1, dp_shard=world, wrapper="deepspeed",
                   sharding_strategy=None, batch=batch, precision=precision, device_type=device_type,
                   activation_checkpointing=fsdp.activation_checkpointing, batch_problem=batch_problem, zero=zero,
                   **split)

    def pipeline_batch_problem(self) -> Optional[str]:
        """Why the batch plan's micro-batches do not suit the pipeline schedule, or None."""
        if self.pp == 1:
            return None
        n, how = self.pp_microbatches, (
            f"global batch {self.batch.global_batch_size} / (data-parallel {self.data_parallel_size} × micro batch "
            f"{self.batch.micro_batch_size}) = {self.pp_microbatches} micro-batches per step")
        fix = ("raise --train.global_batch_size or lower --train.micro_batch_size, or use --pp_schedule gpipe")
        if self.pp_schedule == "1f1b" and n < self.pp:
            return f"--pp_schedule 1f1b needs at least --pp_size {self.pp} micro-batches per step, but {how}: {fix}"
        if self.pp_schedule == "interleaved_1f1b" and (n < self.pp or n % self.pp):
            return (f"--pp_schedule interleaved_1f1b needs a multiple of --pp_size {self.pp} micro-batches per "
                    f"step, but {how}: {fix}")
        return None

    def check_model(self, config: Any, seq_len: int) -> None:
        """The model divides as tensor, pipeline and expert parallelism split it; a ``ValueError`` names the flag."""
        if self.tp > 1 and config.qk_norm != "none":
            raise ValueError(f"--tp_size {self.tp}: model {config.name or 'custom'!r} normalises its queries and keys "
                             f"(qk_norm={config.qk_norm!r}), which tensor parallelism does not split yet (each rank "
                             "holds some heads only); drop --tp_size and shard with FSDP")
        if self.ep > 1 and not config.is_moe:
            raise ValueError(f"--ep_size {self.ep} splits the routed experts of a mixture-of-experts model, but model "
                             f"{config.name or 'custom'!r} is dense (n_expert 0): drop --ep_size, or train an MoE")
        if self.ep > 1 and config.n_expert % self.ep:
            sizes = [e for e in range(2, config.n_expert + 1) if config.n_expert % e == 0 and self.dp_shard % e == 0]
            fix = f"use --ep_size {' or '.join(map(str, sizes))}" if sizes else "drop --ep_size"
            raise ValueError(f"--ep_size {self.ep} must divide the {config.n_expert} experts (n_expert) of model "
                             f"{config.name or 'custom'!r}, each rank holding as many: {fix}")
        shard, local = self.expert_shard_size, config.n_expert // self.ep
        if self.ep > 1 and local % shard and (config.moe_intermediate_size % shard or config.n_embd % shard):
            raise ValueError(f"--ep_size {self.ep} leaves {local} expert(s) per rank to FSDP-shard over {shard} ranks "
                             f"(the FSDP shard {self.dp_shard} / --ep_size): neither the experts nor their widths "
                             f"(moe_intermediate_size {config.moe_intermediate_size}, n_embd {config.n_embd}) divide "
                             f"by {shard}; use fewer processes" + (", or a larger --ep_size" if self.ep < config.n_expert else ""))
        if self.tp > 1:
            for what, count in (("attention heads (n_head)", config.n_head),
                                ("key/value heads (n_query_groups)", config.n_query_groups),
                                # an MoE's experts are not split by tensor parallelism (tensor_parallel.py)
                                ("MLP width (intermediate_size)", 0 if config.is_moe else config.intermediate_size),
                                ("vocabulary rows (padded_vocab_size)", config.padded_vocab_size)):
                if count % self.tp:
                    sizes = [t for t in range(1, count + 1) if count % t == 0 and self.devices % t == 0]
                    raise ValueError(f"--tp_size {self.tp} must divide the {count} {what} of model "
                                     f"{config.name or 'custom'!r}; use --tp_size {max(sizes)} or another divisor")
            if self.sequence_parallel and seq_len % self.tp:
                raise ValueError(f"--tp_sequence_parallel splits each sequence over --tp_size {self.tp} ranks, so "
                                 f"--train.max_seq_length {seq_len} must be a multiple of {self.tp}; change it, or "
                                 "pass --tp_sequence_parallel false")
        if self.pp > 1 and config.tie_embeddings:
            raise ValueError(f"--pp_size {self.pp}: model {config.name or 'custom'!r} ties its embedding to its output "
                             "head, one weight that would live on the first and the last pipeline stage at once; "
                             "drop --pp_size (use FSDP or --tp_size), or use a model with untied embeddings")
        if self.pp > 1 and config.n_layer < self.pp_stages:
            raise ValueError(f"--pp_size {self.pp}{self._virtual_words()} makes {self.pp_stages} pipeline stages, "
                             f"more than the {config.n_layer} layers of model {config.name or 'custom'!r}: use at most "
                             f"{config.n_layer} stages")

    def _virtual_words(self) -> str:
        return f" × --pp_virtual_stages {self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else ""

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
            raise ValueError(f"--tp_size {self.tp} must divide --devices {self.devices}: tensor parallelism "
                             "communicates in every layer, so its ranks must share one node")


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


def _offload_on_cpu(what: str, accelerator: str, fix: str) -> str:
    """Why ``what``, an offload to host memory, is refused on a CPU run, and ``fix``."""
    where = ("--accelerator cpu" if accelerator == "cpu" else
             f"--accelerator {accelerator}, and this machine sees no CUDA device")
    return (f"{what} on a CPU run ({where}): offloading keeps training state (parameters, gradients, optimizer "
            "state) in host memory instead of the GPU's, but a CPU run holds all of it in host memory already, so it "
            f"would do nothing. {fix}, or run on GPUs (--accelerator cuda; a dry run plans for one with "
            "--dry_run.gpu NAME)")


def _wrapper(strategy: str, fsdp: FSDPArgs, world: int, num_nodes: int) -> tuple[Wrapper, Optional[str]]:
    """The data-parallel wrapper and the user-facing sharding strategy for ``world`` data-parallel ranks."""
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


def _check_wrapper_flags(wrapper: Wrapper, fsdp: FSDPArgs, strategy: str, world: int, tp: int, pp: int) -> None:
    """The flags that the chosen data-parallel wrapper cannot honour, each refused by name."""
    if wrapper == "ddp" and (tp > 1 or pp > 1):
        raise ValueError(f"--tp_size {tp} and --pp_size {pp} compose with FSDP, not with DDP (NO_SHARD): use "
                         "--strategy fsdp (or auto) and a sharded --fsdp.sharding_strategy")
    _check_single_process_flags(wrapper, fsdp, strategy, world)
    if fsdp.cpu_offload and wrapper != "fsdp":
        raise ValueError("--fsdp.cpu_offload needs a sharded strategy; DDP (NO_SHARD) keeps every weight on the "
                         "device. Use --fsdp.sharding_strategy FULL_SHARD, or drop --fsdp.cpu_offload")


def _check_single_process_flags(wrapper: Wrapper, fsdp: FSDPArgs, strategy: str, world: int) -> None:
    """Without a data-parallel wrapper an FSDP flag would be accepted and ignored: refuse it instead."""
    if wrapper != "none":
        return
    defaults = FSDPArgs()
    ignored = [f"--fsdp.{name} {getattr(fsdp, name)}" for name in ("sharding_strategy", "cpu_offload",
                                                                    "skip_gradient_sync")
               if getattr(fsdp, name) != getattr(defaults, name)]
    if ignored and world > 1:
        raise ValueError(f"{', '.join(ignored)} needs data-parallel ranks: --tp_size × --pp_size take all {world} "
                         "processes, so there is no data-parallel wrapper and it would do nothing. Pass --strategy "
                         "fsdp, add processes, or drop the flag")
    if ignored:
        raise ValueError(f"{', '.join(ignored)} needs --devices 2 or more: one process uses no data-parallel wrapper, "
                         "so it would do nothing. Or pass --strategy fsdp to run FSDP on one device (e.g. to offload "
                         "to the CPU on a GPU), or drop the flag")


def _check_float8(float8: Optional[str], *, device_type: str, precision: Precision, gpu: Optional[str],
                  strategy: str, tp: int) -> None:
    """``--float8`` against the device (float8 tensor cores), the precision (bf16 underneath) and the layout."""
    if float8 is None:
        return
    from llmtrain.float8 import float8_problem

    here = device_type == "cuda" and gpu is None and torch.cuda.is_available()
    problem = float8_problem(float8, device_type=device_type, precision=precision.name, gpu=gpu,
                             capability=torch.cuda.get_device_capability() if here else None)
    if problem is None and strategy.startswith("deepspeed"):
        problem = (f"--float8 {float8} converts the linear layers before FSDP wraps them; DeepSpeed's engine is not "
                   "wired for it: use --strategy fsdp, or drop --float8")
    if problem is None and tp > 1:
        problem = (f"--float8 {float8} with --tp_size {tp}: float8 tensor-parallel layers are not wired; drop "
                   "--tp_size (use FSDP or --pp_size) or --float8")
    if problem is not None:
        raise ValueError(problem)


def _model_split(tp: int, pp: int, sequence_parallel: Optional[bool], schedule: Optional[str],
                 virtual_stages: Optional[int], devices: int, world: int) -> dict:
    """The plan's tensor- and pipeline-parallel fields from their flags, or a ``ValueError`` naming the flag."""
    if tp < 1 or pp < 1:
        raise ValueError(f"--tp_size {tp} and --pp_size {pp} must both be at least 1")
    if world % (tp * pp):
        raise ValueError(f"--tp_size {tp} × --pp_size {pp} = {tp * pp} must divide the {world} processes "
                         "(--devices × --num_nodes); the ranks left over are the data-parallel ones")
    if tp > 1 and devices % tp:
        raise ValueError(f"--tp_size {tp} must divide --devices {devices}: tensor parallelism communicates in every "
                         "layer, so its ranks must share one node")
    if sequence_parallel is not None and tp == 1:
        raise ValueError(f"--tp_sequence_parallel {str(sequence_parallel).lower()} needs --tp_size 2 or more; drop it")
    if schedule is not None and pp == 1:
        raise ValueError(f"--pp_schedule {schedule} needs --pp_size 2 or more; drop it")
    if schedule is not None and schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"--pp_schedule {schedule!r} must be one of {', '.join(PIPELINE_SCHEDULES)}")
    schedule = schedule or ("1f1b" if pp > 1 else None)
    if virtual_stages is not None and schedule != "interleaved_1f1b":
        raise ValueError(f"--pp_virtual_stages {virtual_stages} is for --pp_schedule interleaved_1f1b (with "
                         "--pp_size 2 or more); drop it")
    if virtual_stages is not None and virtual_stages < 2:
        raise ValueError(f"--pp_virtual_stages {virtual_stages}: interleaving needs at least 2 stages per process")
    virtual = (virtual_stages or 2) if schedule == "interleaved_1f1b" else 1
    return dict(tp=tp, pp=pp, sequence_parallel=tp > 1 and sequence_parallel is not False, pp_schedule=schedule,
                pp_virtual_stages=virtual)


def _check_expert_parallel(ep: int, wrapper: Wrapper, dp_shard: int, split: dict) -> None:
    """``--ep_size`` against the data-parallel layout: its ranks are taken from the FSDP shard, which it divides."""
    if ep == 1:
        return
    if wrapper == "ddp":
        raise ValueError(f"--ep_size {ep} splits the experts over ranks of the FSDP shard, but DDP (NO_SHARD) "
                         "replicates every weight: use --strategy fsdp (or auto) with a sharded "
                         "--fsdp.sharding_strategy, or drop --ep_size")
    if dp_shard % ep:
        sizes = [size for size in range(2, dp_shard + 1) if dp_shard % size == 0]
        others = "--tp_size × --pp_size take the other ranks; " if split["tp"] * split["pp"] > 1 else ""
        fix = (f"use --ep_size {' or '.join(map(str, sizes))}" if sizes else
               "add processes (e.g. --devices 2 or more), or drop --ep_size")
        raise ValueError(f"--ep_size {ep} must divide the {dp_shard} rank(s) of the data-parallel shard, from which "
                         f"the expert-parallel ranks are taken ({others}under HYBRID_SHARD the shard is one node's "
                         f"ranks): {fix}")


def _data_parallel_dims(sharding: Optional[str], dp_world: int, num_nodes: int,
                        dp_per_node: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for a sharding strategy: the one place the shard size is worked out.

    ``dp_world`` data-parallel ranks in all, ``dp_per_node`` of a node's ranks in one tensor-parallel slot.
    HYBRID_SHARD shards within a node: over the data-parallel ranks a node holds (fewer when the pipeline
    stages share a node).
    """
    if sharding is None:
        return 1, 1
    if sharding == "NO_SHARD":
        return dp_world, 1
    if sharding == "HYBRID_SHARD":
        shard = math.gcd(dp_world, dp_per_node)
        return dp_world // shard, shard
    return 1, dp_world


def mesh_coordinates(mesh) -> dict[str, int]:
    """This rank's place in a plan's ``mesh``: its data-parallel shard, tensor-parallel and pipeline rank, and their
    sizes (the fields of :class:`~llmtrain.distributed.runtime.Runtime` of those names). Each is a dimension's local
    rank and size (0 and 1 for a dimension the mesh leaves out), as torchtitan's ParallelDims reads them.

    NOTE: the data-parallel rank is this rank's row-major position in the data-parallel sub-mesh (``dp_replicate ×
    dp_shard`` under HSDP), the local rank a flattened dimension would give; flattening one (``_flatten``) would
    create one more process group for nothing else.
    """
    names = mesh.mesh_dim_names or ()
    sizes = {name: 1 for name in MESH_DIMS}
    ranks = {name: 0 for name in MESH_DIMS}
    for name in names:
        sizes[name], ranks[name] = mesh[name].size(), mesh[name].get_local_rank()
    return _coordinates(data_parallel_rank=ranks["dp_replicate"] * sizes["dp_shard"] + ranks["dp_shard"],
                        data_parallel_size=sizes["dp_replicate"] * sizes["dp_shard"], tp_rank=ranks["tp"],
                        tp_size=sizes["tp"], pp_rank=ranks["pp"], pp_size=sizes["pp"])


def _coordinates(*, data_parallel_rank: int, data_parallel_size: int, tp_rank: int = 0, tp_size: int = 1,
                 pp_rank: int = 0, pp_size: int = 1) -> dict[str, int]:
    return dict(data_parallel_rank=data_parallel_rank, data_parallel_size=data_parallel_size, tp_rank=tp_rank,
                tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)


def data_parallel_ranks(world: int, tp: int, pp: int) -> Optional[int]:
    """The ranks left for data parallelism when tensor and pipeline parallelism take ``tp × pp`` of ``world``; None
    when they do not divide it."""
    return None if world % (tp * pp) else world // (tp * pp)


def global_rank(node: int, local_rank: int, devices: int) -> int:
    """The rank of local rank ``local_rank`` on node ``node``, with ``devices`` processes per node.

    Ranks are numbered node by node, as torchrun and the spawning path number them: a node's ranks are consecutive,
    which the mesh needs (tensor-parallel groups and HYBRID_SHARD's shards lie within a node).
    """
    return node * devices + local_rank


def data_parallel_mesh(mesh):
    """The data-parallel dimensions of a plan's mesh (``dp_replicate``, ``dp_shard``, or both for HSDP)."""
    names = tuple(name for name in ("dp_replicate", "dp_shard") if name in (mesh.mesh_dim_names or ()))
    return mesh[names] if len(names) > 1 else mesh[names[0]]
