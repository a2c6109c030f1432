"""Apply data parallelism to a plain ``GPT``, from outside, in one fixed order.

    activation checkpointing (each Block) → compile (each Block) → fully_shard(each Block) → fully_shard(root)

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
    model, info = parallelize(model, runtime=runtime, strategy=strategy, fsdp=fsdp, precision=precision,
                              num_nodes=num_nodes, compile=compile)
    materialize(model, runtime.device, seed, cpu_offload=info.cpu_offload)
    # then: llmtrain.checkpoint.weights.load_weights(model, dir) for initial weights; the optimizer over model.parameters();
    # Fit(..., autocast_enabled=info.autocast_enabled)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from llmtrain.distributed.runtime import Runtime
from llmtrain.train.precision import Precision

ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
Strategy = Literal["auto", "ddp", "fsdp"]
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
STRATEGIES = ("auto", "ddp", "fsdp")


@dataclass
class FSDPArgs:
    """How FSDP shards and wraps the model (``--fsdp.*``)."""

    sharding_strategy: Optional[ShardingStrategy] = None
    """FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD (DDP). None: HYBRID_SHARD on several nodes, else FULL_SHARD."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of storing them."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory."""
    state_dict_type: Literal["full", "sharded"] = "full"
    """Checkpoint format: `full` (rank 0 writes model.safetensors) or `sharded` (every rank writes its shard)."""
    skip_gradient_sync: bool = True
    """Reduce gradients only after the last micro-batch of a step: less communication, but under FSDP each
    rank holds unsharded gradients during accumulation. Applies to DDP too."""
    async_save: bool = False
    """Write sharded checkpoints in a background thread: training waits only while the shards are copied to
    host memory (one more copy of model and optimizer state there). A checkpoint counts only once its
    write has finished, so a kill during it leaves none that resume picks. Needs state_dict_type sharded."""

    def __post_init__(self) -> None:
        if self.sharding_strategy is not None and self.sharding_strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"--fsdp.sharding_strategy {self.sharding_strategy!r} must be one of "
                             f"{', '.join(SHARDING_STRATEGIES)} (or null for the default)")
        if self.state_dict_type not in ("full", "sharded"):
            raise ValueError(f"--fsdp.state_dict_type {self.state_dict_type!r} must be `full` or `sharded`")
        if self.async_save and self.state_dict_type != "sharded":
            raise ValueError("--fsdp.async_save true needs --fsdp.state_dict_type sharded (a full checkpoint is "
                             "gathered and written by rank 0 alone)")


@dataclass
class ParallelInfo:
    """What :func:`parallelize` did, for the recipe's log line and for ``Fit``."""

    wrapper: Literal["none", "ddp", "fsdp"]
    """The data-parallel wrapper applied (none in a single process)."""
    sharding_strategy: Optional[str]
    """The resolved user-facing strategy, e.g. HYBRID_SHARD (None in a single process)."""
    mesh: Any = None
    """The DeviceMesh: 1-D ("shard",) / ("replicate",), or 2-D ("replicate", "shard") for HYBRID_SHARD."""
    mesh_shape: str = "single process"
    """The mesh in words, e.g. "replicate 2 × shard 2"."""
    autocast_enabled: bool = True
    """False when FSDP's mixed-precision policy already casts, so fit() must not autocast too."""
    cpu_offload: bool = False
    """Parameters live on the CPU; pass this to :func:`materialize`."""
    activation_checkpointing: bool = False
    compiled: bool = False

    def describe(self) -> str:
        parts = [self.wrapper if self.wrapper != "none" else "no data-parallel wrapper"]
        if self.sharding_strategy:
            parts.append(self.sharding_strategy)
        parts.append(f"mesh {self.mesh_shape}")
        parts += [name for name, on in (("activation checkpointing", self.activation_checkpointing),
                                        ("compiled blocks", self.compiled), ("CPU offload", self.cpu_offload)) if on]
        return ", ".join(parts)


# ------------------------------------------------------------------------------------------ mesh
def resolve_sharding_strategy(strategy: Strategy, fsdp: FSDPArgs, world_size: int, num_nodes: int) -> Optional[str]:
    """The strategy the run uses, or None when there is nothing to parallelise (one process)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategy {strategy!r} must be one of {', '.join(STRATEGIES)}")
    if strategy == "ddp":
        if fsdp.sharding_strategy not in (None, "NO_SHARD"):
            raise ValueError(f"--strategy ddp contradicts --fsdp.sharding_strategy {fsdp.sharding_strategy}; "
                             "use --strategy fsdp for sharding, or drop --fsdp.sharding_strategy")
        chosen = "NO_SHARD"
    else:
        chosen = fsdp.sharding_strategy or ("HYBRID_SHARD" if num_nodes > 1 else "FULL_SHARD")
    if world_size == 1:
        return None
    if chosen == "NO_SHARD" and fsdp.cpu_offload:
        raise ValueError("--fsdp.cpu_offload needs a sharded strategy; DDP (NO_SHARD) keeps every weight on the "
                         "device. Use --fsdp.sharding_strategy FULL_SHARD, or drop --fsdp.cpu_offload")
    return chosen


def build_mesh(world_size: int, num_nodes: int, strategy: str, device_type: str):
    """The data-parallel DeviceMesh for ``strategy``.

    HYBRID_SHARD: 2-D ("replicate", "shard") of shape (num_nodes, world_size / num_nodes): ranks on
    one node (consecutive ranks, as torchrun and SLURM number them) form a shard group, and each
    parameter shard is replicated across nodes. NO_SHARD: 1-D ("replicate",). Otherwise 1-D ("shard",).
    """
    from torch.distributed.device_mesh import init_device_mesh

    if num_nodes < 1 or world_size % num_nodes != 0:
        raise ValueError(f"world size {world_size} is not divisible by --num_nodes {num_nodes}; every node "
                         "must run the same number of processes (--devices)")
    if strategy == "HYBRID_SHARD":
        return init_device_mesh(device_type, (num_nodes, world_size // num_nodes),
                                mesh_dim_names=("replicate", "shard"))
    name = "replicate" if strategy == "NO_SHARD" else "shard"
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=(name,))


def describe_mesh(mesh) -> str:
    """ "replicate 2 × shard 2" """
    return " × ".join(f"{name} {size}" for name, size in zip(mesh.mesh_dim_names, mesh.mesh.shape))


# ----------------------------------------------------------------------------------- parallelize
def parallelize(model: nn.Module, *, runtime: Runtime, strategy: Strategy = "auto", fsdp: Optional[FSDPArgs] = None,
                precision: Precision = Precision("32-true"), num_nodes: int = 1,
                compile: bool = False) -> tuple[nn.Module, ParallelInfo]:
    """Apply activation checkpointing, compile and the data-parallel wrapper to ``model``, in that order.

    ``model`` is a plain ``GPT`` (on the meta device, or already materialised), with its weights in
    ``precision.param_dtype``. Returns the model to train (the same object under FSDP, a DDP wrapper
    under DDP) and a :class:`ParallelInfo`. A meta model must then go through :func:`materialize`.
    """
    fsdp = fsdp or FSDPArgs()
    sharding = resolve_sharding_strategy(strategy, fsdp, runtime.world_size, num_nodes)
    if fsdp.activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    info = ParallelInfo(wrapper="none", sharding_strategy=sharding, cpu_offload=False,
                        activation_checkpointing=fsdp.activation_checkpointing, compiled=compile)
    if sharding is None:
        return model, info
    info.mesh = build_mesh(runtime.world_size, num_nodes, sharding, runtime.device.type)
    info.mesh_shape = describe_mesh(info.mesh)
    if sharding == "NO_SHARD":
        info.wrapper = "ddp"
        return apply_ddp(model, runtime), info
    info.wrapper = "fsdp"
    info.cpu_offload = fsdp.cpu_offload
    # NOTE: the policy casts parameters for compute and keeps fp32 master weights, so autocast is redundant.
    info.autocast_enabled = not precision.is_mixed
    apply_fsdp(model, info.mesh, reshard_after_forward=sharding != "SHARD_GRAD_OP", precision=precision,
               cpu_offload=fsdp.cpu_offload)
    return model, info


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every Block's forward in backward (non-reentrant ``torch.utils.checkpoint``).

    The Block's class is swapped for a subclass whose forward is checkpointed, so parameter names
    and state-dict keys stay exactly as they were (a wrapper module would add a prefix).
    """
    for block in model.blocks:
        block.__class__ = _checkpointed_class(type(block))


@functools.lru_cache(maxsize=None)
def _checkpointed_class(block_class: type) -> type:
    if getattr(block_class, "_activation_checkpointed", False):
        return block_class

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(block_class.forward, self, *args, use_reentrant=False, **kwargs)

    return type(f"Checkpointed{block_class.__name__}", (block_class,),
                {"forward": forward, "_activation_checkpointed": True, "__module__": block_class.__module__})


def apply_compile(model: nn.Module) -> None:
    """Compile each Block on its own: every block has the same code, so one graph serves all."""
    for block in model.blocks:
        block.compile()


def apply_fsdp(model: nn.Module, mesh, *, reshard_after_forward: bool, precision: Precision,
               cpu_offload: bool) -> None:
    """``fully_shard`` each Block, then the root (embedding, final norm, head: tied weights stay in one group)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy()
    if precision.is_mixed:
        mp_policy = MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32)
    # NOTE: pinned memory needs an accelerator; on a CPU-only machine pinning fails.
    offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    options = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    # The root's parameters are needed first in backward, so they stay gathered after forward.
    fully_shard(model, reshard_after_forward=False, **options)


def apply_ddp(model: nn.Module, runtime: Runtime) -> nn.Module:
    """Wrap in DistributedDataParallel. A meta model gets (uninitialised) storage first: DDP needs real tensors."""
    from torch.nn.parallel import DistributedDataParallel

    if _has_meta_tensors(model):
        model.to_empty(device=runtime.device)
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    # The only buffers are the RoPE tables, equal on every rank: no need to broadcast them each step.
    return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


# ----------------------------------------------------------------------------------- materialize
def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside a DDP wrapper or a torch.compile'd module (FSDP2 shards in place: nothing to unwrap)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
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
            for module in gpt.modules():
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = torch.empty_like(buffer, device=device)
    rng_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), torch.no_grad(), _FullSizeInit():
        torch.manual_seed(seed)
        gpt.init_weights()
        if after_init is not None:  # e.g. LoRA adapters, which the model itself does not know
            after_init(gpt)
    return model


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
