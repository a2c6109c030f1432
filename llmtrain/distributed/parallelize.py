"""Apply the parallel plan to a plain ``GPT``, from outside, in one fixed order.

    tensor parallelism (llmtrain.distributed.tensor_parallel) → expert parallelism (expert_parallel) →
    activation checkpointing (each Block) → compile (each Block) →
    fully_shard(embedding, each Block, [final norm, head]) → fully_shard(root)

The user names a sharding strategy they know; it maps onto PyTorch's wrappers:

    FULL_SHARD     fully_shard, reshard_after_forward=True       (ZeRO-3)
    SHARD_GRAD_OP  fully_shard, reshard_after_forward=False      (ZeRO-2-like: params stay gathered until backward)
    HYBRID_SHARD   fully_shard on a 2-D mesh: replicate across nodes, shard within a node
    NO_SHARD       DistributedDataParallel (also ``--strategy ddp``)

The model may be built on the meta device; :func:`materialize` then allocates each rank's shard
and initialises it so that the sharded model equals, bit for bit, a model initialised with the same
seed in a single process. A recipe does::

    with torch.device("meta"):
        model = GPT(config).to(precision.param_dtype)
    model.max_seq_length = seq_len
    plan = ParallelPlan.resolve(devices=..., num_nodes=..., train=..., precision=..., strategy=..., fsdp=...)
    model = parallelize(model, plan, device=runtime.device, compile=compile)
    materialize(model, runtime.device, seed, cpu_offload=plan.cpu_offload)
    # then: llmtrain.checkpoint.weights.load_weights(model, dir) for initial weights; the optimizer over model.parameters();
    # Fit(..., autocast_enabled=not plan.mixed_precision_policy)

Which wrapper and mesh a run gets is decided by :class:`llmtrain.distributed.parallel_plan.ParallelPlan`;
this module only applies it.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from llmtrain.args import canonical_checkpointing, checkpointed_every
from llmtrain.distributed.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from llmtrain.distributed.parallel_plan import ParallelPlan, data_parallel_mesh
from llmtrain.distributed.tensor_parallel import apply_tensor_parallel
from llmtrain.float8 import convert_to_float8
from llmtrain.kernel_device import kernel_device_type
from llmtrain.model import transformer_blocks
from llmtrain.moe import keep_expert_products_eager, moe_layers
from llmtrain.precision import Precision


def parallelize(model: nn.Module, plan: ParallelPlan, *, device: torch.device, compile: bool = False,
                mesh=None) -> nn.Module:
    """Apply tensor parallelism, activation checkpointing, compile and the plan's data-parallel wrapper to
    ``model``, in that order (FSDP over the mesh's data-parallel dimensions only).

    ``model`` is a plain ``GPT`` or a pipeline stage (on the meta device, or already materialised), with its
    weights in ``plan.precision.param_dtype``. ``mesh``: the plan's mesh, when the caller built it already
    (the stages of one pipeline rank share it). Returns the model to train: the same object under FSDP
    (which shards in place) or without a wrapper, a DDP wrapper under DDP. A meta model must then go through
    :func:`materialize`. The process group must exist when the plan has a wrapper.
    """
    if mesh is None and plan.uses_process_group:
        mesh = plan.build_mesh()
    if plan.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=plan.sequence_parallel)
    if plan.float8:
        convert_to_float8(model, plan.float8, fsdp_float8_all_gather=float8_all_gather(plan))
    expert_mesh = plan.expert_mesh(mesh)
    if expert_mesh is not None:
        apply_expert_parallel(model, expert_mesh["ep"])
    if plan.activation_checkpointing:
        apply_activation_checkpointing(model, plan.activation_checkpointing)
    if compile:
        apply_compile(model)
    if plan.wrapper in ("none", "deepspeed"):  # DeepSpeed's engine wraps the model later (llmtrain_deepspeed)
        return model
    if plan.wrapper == "ddp":
        return apply_ddp(model, device)
    apply_fsdp(model, data_parallel_mesh(mesh), reshard_after_forward=plan.reshard_after_forward,
               precision=plan.precision, cpu_offload=plan.cpu_offload, one_host=plan.num_nodes == 1,
               expert_mesh=expert_data_parallel_mesh(expert_mesh))
    model.gathers_float8_weights = float8_all_gather(plan)  # read by the strategy after each optimizer step
    return model


def float8_all_gather(plan: ParallelPlan) -> bool:
    """Whether FSDP gathers float8 weights in float8 (tensorwise scaling with sharded parameters): then the step
    computes their scales after each optimizer step (llmtrain.float8.precompute_scales)."""
    return plan.float8 == "tensorwise" and plan.wrapper == "fsdp" and plan.shard_size > 1


def expert_data_parallel_mesh(expert_mesh):
    """The ranks that hold the same routed experts, which FSDP shards them over: ``dp_shard_mod_ep`` of the plan's
    expert mesh (with ``dp_replicate`` under HSDP); None without expert parallelism."""
    if expert_mesh is None:
        return None
    names = tuple(name for name in ("dp_replicate", "dp_shard_mod_ep") if name in expert_mesh.mesh_dim_names)
    return expert_mesh[names] if len(names) > 1 else expert_mesh[names[0]]


def apply_activation_checkpointing(model: nn.Module, mode: str = "full") -> None:
    """Recompute Blocks' activations in backward (non-reentrant ``torch.utils.checkpoint``), as ``mode`` says:

    - ``full``: every Block keeps only its input; its whole forward runs again in backward.
    - ``selective:N``: every Nth Block (layer index 0, N, 2N, ...) as in ``full``; the others keep everything.
    - ``op``: every Block, under torch's selective checkpoint policy: the outputs of matmuls and attention
      (and of tensor parallelism's reduce-scatters and all-reduces) are kept, the cheap operators between them are run
      again. Most of the recomputation of ``full`` (its matmuls) is gone; the norms', RoPE's and the MLP
      activation's tensors are what it saves.

    A Block's class is swapped for a subclass whose forward is checkpointed, so parameter names and state-dict
    keys stay exactly as they were (a wrapper module would add a prefix). A pipeline stage's Blocks count by
    their layer index in the whole model, so a stage checkpoints what the whole model would. A Block already
    checkpointed stays as it is.
    """
    mode = canonical_checkpointing(mode)
    every = checkpointed_every(mode)
    if not every:
        return
    blocks = model.blocks
    indexed = ([(int(key), block) for key, block in blocks.items()] if isinstance(blocks, nn.ModuleDict) else
               list(enumerate(transformer_blocks(model))))
    for index, block in indexed:
        if index % every == 0:
            block.__class__ = _checkpointed_class(type(block), per_op=mode == "op")


@functools.lru_cache(maxsize=None)
def _checkpointed_class(block_class: type, per_op: bool) -> type:
    if getattr(block_class, "_activation_checkpointed", False):
        return block_class
    options = {"context_fn": _keep_matmuls_and_attention} if per_op else {}

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(block_class.forward, self, *args, use_reentrant=False, **options,
                                                 **kwargs)

    return type(f"{'OpCheckpointed' if per_op else 'Checkpointed'}{block_class.__name__}", (block_class,),
                {"forward": forward, "_activation_checkpointed": True, "__module__": block_class.__module__})


@functools.lru_cache(maxsize=None)
def _kept_operators() -> frozenset:
    """The operators whose outputs ``op`` checkpointing keeps: the matmuls, every attention kernel torch's SDPA
    may pick (CPU, flash, memory-efficient, cuDNN), and tensor parallelism's reduce-scatters and all-reduces (so
    that backward does not run them again)."""
    names = [("aten", "mm"), ("aten", "addmm"), ("aten", "bmm"), ("aten", "baddbmm"),
             ("aten", "_scaled_dot_product_flash_attention_for_cpu"), ("aten", "_scaled_dot_product_flash_attention"),
             ("aten", "_scaled_dot_product_efficient_attention"), ("aten", "_scaled_dot_product_cudnn_attention"),
             ("_c10d_functional", "reduce_scatter_tensor"), ("_c10d_functional", "all_reduce")]
    return frozenset(getattr(getattr(torch.ops, space), name).default for space, name in names
                     if hasattr(getattr(torch.ops, space), name))


def _keep_matmuls_and_attention():
    kept = _kept_operators()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_compile(model: nn.Module) -> None:
    """Compile each Block on its own: every block has the same code, so one graph serves all."""
    keep_expert_products_eager()
    for block in transformer_blocks(model):
        block.compile()


def apply_fsdp(model: nn.Module, mesh, *, reshard_after_forward: bool, precision: Precision,
               cpu_offload: bool, one_host: bool, expert_mesh=None) -> None:
    """``fully_shard`` the embedding, each Block and [final norm, head] as units of their own, then the root.

    A pipeline stage lacks some of them (None): it shards those it has. Under expert parallelism (``expert_mesh``:
    :func:`expert_data_parallel_mesh`) each block's routed experts are a unit of their own first, sharded over the
    ranks that hold the same experts; their gradients are averaged over the whole data-parallel ``mesh`` all the
    same (each expert saw the tokens of every ``ep`` rank: :mod:`llmtrain.distributed.expert_parallel`).

    Each unit is gathered only while it computes, so the embedding is not held whole through the forward
    and the head not from the forward's start. Tied embeddings are one weight in two places, which must
    sit in one unit: then embedding, final norm and head stay together in the root's.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy()
    if precision.is_mixed:
        mp_policy = MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32)
    # NOTE: pinned memory is for copies to a GPU, and pinning creates a CUDA context: a CPU run (even on a GPU
    # node, --accelerator cpu) pins nothing.
    pin_memory = mesh.device_type == "cuda"
    offload_policy = CPUOffloadPolicy(pin_memory=pin_memory) if cpu_offload else OffloadPolicy()
    options = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    # NOTE: getattr: a head with LoRA adapters (--lora_head) has no weight of its own, and is never tied.
    tied = model.wte is not None and getattr(model.lm_head, "weight", None) is model.wte.weight
    if model.wte is not None and not tied:
        fully_shard(model.wte, reshard_after_forward=reshard_after_forward, **options)
    for block in transformer_blocks(model):
        for _, moe in moe_layers(block) if expert_mesh is not None else ():
            fully_shard(moe.experts, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=_expert_placement(moe.experts, expert_mesh),
                        **{**options, "mesh": expert_mesh})
            moe.experts.set_gradient_divide_factor(float(mesh.size()))
            # NOTE: a divide factor other than the group's size is NCCL's PREMUL_SUM, which gloo lacks: sum, then
            # divide (one pass over the experts' gradient shards), on every backend alike. Not where the shard
            # dimension has one rank, which reduce-scatters nothing: torch 2.13 divides the gradient by the factor
            # there and again after the sum (by 4 at ep 2 on 2 ranks, caught by the parity test; under HSDP too).
            if expert_mesh.size(expert_mesh.ndim - 1) > 1:
                moe.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    # NOTE: the head (and the root, which holds it when tied) is the first thing backward needs, right
    # after the forward; resharding it there would only gather it again at once.
    if model.lm_head is not None and not tied:
        fully_shard([model.norm_f, model.lm_head], reshard_after_forward=False, **options)
    fully_shard(model, reshard_after_forward=False, **options)
    # SHARD_GRAD_OP holds each unit's weights gathered from its forward to its backward; the loop holds them on through
    # a step's micro-batches (llmtrain.train.strategy.gradient_sync) instead of resharding and gathering them again.
    model.holds_weights_through_accumulation = not reshard_after_forward
    # NOTE: kernel_device_type: a simulated GPU rank (--dry_run.simulate) runs on a CPU mesh, but as the GPU run would.
    on_cpu = kernel_device_type(mesh.device_type) == "cpu"
    if on_cpu and _fsdp_overlap_enabled():
        overlap_all_gathers(model)
    if on_cpu and one_host:
        from llmtrain.distributed import shared_memory

        if shared_memory.enabled():
            share_host_memory(model, mesh.get_group(mesh.ndim - 1))
        else:
            reduce_scatter_by_all_reduce(model)


def _expert_placement(experts: nn.Module, expert_mesh) -> Optional[Callable]:
    """FSDP's placement for one rank's routed experts: their dim 0 (whole experts) when the ranks that share them
    divide their count, else dim 1 (each expert's rows; ParallelPlan.check_model makes sure that divides), as
    torchtitan does when there are more of those ranks than experts."""
    from torch.distributed.tensor import Shard

    local_experts = experts.gate_proj.to_local().size(0)
    if local_experts % expert_mesh.size(expert_mesh.ndim - 1) == 0:
        return None
    return lambda parameter: Shard(1)


def _fsdp_overlap_enabled() -> bool:
    value = os.environ.get("LLMTRAIN_FSDP_OVERLAP", "1")
    if value not in ("0", "1"):
        raise ValueError(f"LLMTRAIN_FSDP_OVERLAP={value!r}: use 1 (the default: overlap FSDP's all-gathers on the CPU) "
                         "or 0 (FSDP's own behaviour)")
    return value == "1"


def overlap_all_gathers(model: nn.Module) -> None:
    """On the CPU (gloo), all-gather the next Block's weights while this one computes.

    FSDP2 overlaps an all-gather with compute through CUDA streams; on the CPU it has none and gathers each unit
    when its forward (or backward) starts, waiting for it. Here every unit's all-gather is asynchronous (gloo moves
    the bytes in its own threads) and issued one unit ahead: in forward, the embedding asks for Block 0 and each
    Block for the next; in backward, each Block for the one before it. ``LLMTRAIN_FSDP_OVERLAP=0`` leaves FSDP's own
    behaviour, for an A/B (BENCHMARKS.md, "2 processes against 1").
    """
    from torch.distributed.fsdp import FSDPModule

    units = [unit for unit in (model.wte, *transformer_blocks(model)) if isinstance(unit, FSDPModule)]
    for unit, following in zip(units, units[1:]):
        unit.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([unit])
    model._set_unshard_async_op(True)


# Gradient buffers from this size up reduce-scatter as an all-reduce between 2 processes on one CPU host (below).
ALL_REDUCE_SCATTER_MIN_BYTES = 8 * 2**20


def _all_reduce_scatter():
    """The reduce-scatter of :func:`reduce_scatter_by_all_reduce`."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter  # NOTE: private in torch

    class AllReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                     async_op: bool = False):
            if (async_op or group.size() != 2
                    or input_tensor.numel() * input_tensor.element_size() < ALL_REDUCE_SCATTER_MIN_BYTES):
                return super().__call__(output_tensor, input_tensor, group, op, async_op)
            dist.all_reduce(input_tensor, op=op, group=group)
            shard = input_tensor.numel() // group.size()
            output_tensor.copy_(input_tensor.narrow(0, group.rank() * shard, shard).view_as(output_tensor))
            return None

    return AllReduceScatter()


def reduce_scatter_by_all_reduce(model: nn.Module) -> None:
    """On one CPU host (gloo), FSDP units of 2 processes reduce-scatter large gradient buffers as an all-reduce that
    keeps this rank's slice: where shared memory is off (``LLMTRAIN_HOST_COLLECTIVES=0``), and where it cannot be
    had (:func:`share_host_memory` falls back to it).

    gloo's reduce-scatter of a large buffer is slower there than its all-reduce of it, although the all-reduce moves
    more (both averaging, as FSDP asks): 41 against 31 ms for a pythia-160m Block's 27 MiB, 237 against 161 ms for
    its 147 MiB embedding, 12 against 9 ms at 7.6 MiB; the two are even at 3.8 MiB (``bench/ab/gloo_collectives.py``).
    More processes, or a network between them, were not measured: those keep gloo's reduce-scatter. The all-reduce
    runs in place on FSDP's reduce-scatter input, a buffer FSDP frees right after: no memory more.
    """
    comm = _all_reduce_scatter()
    for unit in _shard_group_units(model):
        unit.set_custom_reduce_scatter(comm)


def share_host_memory(model: nn.Module, group) -> None:
    """On one CPU host, FSDP units all-gather and reduce-scatter within ``group`` (the mesh's shard dimension) through
    shared memory instead of gloo's loopback sockets (``llmtrain.distributed.shared_memory``); where the group cannot
    share memory, gloo's all-gather and :func:`reduce_scatter_by_all_reduce`'s reduction."""
    from llmtrain.distributed.shared_memory import HostAllGather, HostReduceScatter

    all_gather, reduce_scatter = HostAllGather(group), HostReduceScatter(group, fallback=_all_reduce_scatter())
    for unit in _shard_group_units(model):
        unit.set_custom_all_gather(all_gather)
        unit.set_custom_reduce_scatter(reduce_scatter)


def _shard_group_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units of ``model`` sharded over the plan's shard dimension: all but expert-parallel experts (sharded
    over fewer ranks, with FSDP's own collectives)."""
    from torch.distributed.fsdp import FSDPModule

    return [unit for unit in model.modules()
            if isinstance(unit, FSDPModule) and not isinstance(unit, ExpertParallelExperts)]


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """Wrap in DistributedDataParallel. A meta model gets (uninitialised) storage first: DDP needs real tensors."""
    from torch.nn.parallel import DistributedDataParallel

    if _has_meta_tensors(model):
        model.to_empty(device=device)
    device_ids = [device.index] if device.type == "cuda" else None
    # The only buffers are the RoPE tables, equal on every rank: no need to broadcast them each step (DDP still
    # broadcasts them once, here; materialize() recomputes them on every rank after).
    return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)


# ----------------------------------------------------------------------------------- materialize
def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside a DDP wrapper, DeepSpeed's engine or a torch.compile'd module (FSDP2 shards in place: nothing
    to unwrap)."""
    while True:
        if isinstance(getattr(model, "module", None), nn.Module):  # DDP, DeepSpeed: the model is their .module
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile of the whole model
            model = model._orig_mod
        else:
            return model


def materialize(model: nn.Module, device: torch.device, seed: int, *, cpu_offload: bool = False,
                after_init: Optional[Callable[[nn.Module], None]] = None) -> nn.Module:
    """Allocate a meta (or to_empty'd) model on ``device`` and initialise it with ``init_weights()`` under ``seed``.

    Works before or after :func:`parallelize`. Under FSDP every rank allocates only its shard, and
    each initialiser runs on the full-size parameter (one parameter at a time) before the rank
    keeps its slice; so the result equals, bit for bit, ``torch.manual_seed(seed); init_weights()``
    on an unsharded model in one process, at any world size and mesh. Floating-point weights are
    drawn in float32 and then cast to the parameter dtype, as ``build_model`` does.
    With ``cpu_offload`` the parameters stay on the CPU while buffers go to ``device``.
    """
    device = torch.device(device)
    gpt = unwrap(model)
    if _has_meta_tensors(gpt):
        gpt.to_empty(device=torch.device("cpu") if cpu_offload else device)
        if cpu_offload:
            for module in _buffer_owners(gpt):
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = torch.empty_like(buffer, device=device)
    if _simulated():
        return model  # fake tensors (--dry_run.simulate) have no values to draw
    rng_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), torch.no_grad(), _FullSizeInit():
        torch.manual_seed(seed)
        gpt.init_weights()
        if after_init is not None:  # e.g. LoRA adapters, which the model itself does not know
            after_init(gpt)
    return model


def _simulated() -> bool:
    """Whether tensors are being made fake here (``--dry_run.simulate``, :mod:`llmtrain.recipes.simulate`)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


def _buffer_owners(model: nn.Module) -> list[nn.Module]:
    """The modules that hold ``model``'s buffers: its own, and a pipeline rank's stages, whose RoPE tables live
    outside its module tree (:class:`llmtrain.distributed.pipeline.PipelineParts`)."""
    return [*model.modules(), *getattr(model, "stages", [])]


def _has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


# In-place methods that overwrite a tensor without reading it.
_OVERWRITING_METHODS = {getattr(torch.Tensor, name) for name in (
    "normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_",
    "fill_", "zero_")}


class _FullSizeInit(TorchFunctionMode):
    """Run initialisers of sharded (DTensor) or low-precision parameters on a full-size float32 tensor.

    NOTE: a DTensor initialiser would draw each shard from the same RNG stream start, so every rank
    would get the first values of the stream; and drawing in bf16 gives other numbers than drawing in
    fp32 and rounding. Here the full parameter is drawn exactly as in one process (same RNG calls,
    same order), and each rank copies out its own slice. Only one full parameter exists at a time.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        overwrites = func in _OVERWRITING_METHODS or _is_public_initializer(func)
        if not (overwrites and isinstance(target, torch.Tensor) and _needs_full_size(target)):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor, distribute_tensor

        full = torch.empty(target.shape, dtype=_draw_dtype(target.dtype), device=_local(target).device)
        if args:
            func(full, *args[1:], **kwargs)
        else:
            func(**{**kwargs, "tensor": full})
        if isinstance(target, DTensor):
            # src_data_rank=None: every rank computed the same full tensor, so slicing needs no communication.
            full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        _local(target).copy_(full)
        return target


def _is_public_initializer(func) -> bool:
    """nn.init.normal_, nn.init.ones_, ...: they overwrite their tensor argument."""
    name = getattr(func, "__name__", "")
    return getattr(func, "__module__", None) == "torch.nn.init" and name.endswith("_") and not name.startswith("_")


def _needs_full_size(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor) or _draw_dtype(tensor.dtype) != tensor.dtype


def _draw_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point and dtype.itemsize < 4 else dtype


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
