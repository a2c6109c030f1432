"""Will the run fit its devices, and what layout would: the check before any rank builds the model, and the
search for flags and a tensor × pipeline split whose memory estimate (:mod:`llmtrain.plan.memory`) fits a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from llmtrain.args import DryRunArgs
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.flops import gpu_memory_bytes
from llmtrain.plan.memory import MemoryEstimate, estimate_memory, state_bytes

USABLE_MEMORY_FRACTION = 0.9
"""Share of a GPU's memory a plan may fill: the CUDA context, NCCL's buffers and the allocator's fragmentation take
the rest. An assumed margin, not a measured one: check a plan close to it with a few steps before a long job."""


@dataclass(frozen=True)
class Suggestion:
    """A layout that fits: the flags to add, its plan and its memory per device."""

    flags: str
    plan: ParallelPlan
    memory: MemoryEstimate


def gpu_name(dry: DryRunArgs, plan: ParallelPlan) -> Optional[str]:
    """The GPU the plan is for: --dry_run.gpu, else this machine's first GPU; None for a plan on CPU."""
    if dry.gpu is not None:
        return dry.gpu
    return torch.cuda.get_device_name(0) if plan.device_type == "cuda" and torch.cuda.is_available() else None


def device_memory_bytes(dry: DryRunArgs, plan: ParallelPlan) -> Optional[int]:
    """Memory of the GPU the plan is for (:func:`gpu_name`); None on CPU or for a GPU of unknown size."""
    name = gpu_name(dry, plan)
    if name is None:
        return None
    return gpu_memory_bytes(name) if dry.gpu is not None else torch.cuda.get_device_properties(0).total_memory


def check_state_fits(config: Config, plan: ParallelPlan, dry: DryRunArgs, *, source: str,
                     trainable_parameters: Optional[int] = None, quantize: Optional[str] = None) -> None:
    """Refuse a model whose weights, gradients and optimizer state on one device (the pipeline rank that holds
    the most, after this plan's sharding) and RoPE tables exceed that device, before any rank builds it.

    A GPU's whole memory counts (the launcher holds no CUDA context to ask for its free memory); on the CPU, the
    host's available memory is shared by the plan's processes on this node. Activations are left out: the check
    refuses what cannot fit at all; the dry run says what fits comfortably.
    """
    from llmtrain.memory import CONFIG_FIX, check_fits, host_available_bytes, rope_cache_bytes

    state = max(sum(state_bytes(config, plan, rank, trainable_parameters=trainable_parameters, quantize=quantize))
                for rank in range(plan.pp))
    capacity = device_memory_bytes(dry, plan)
    where = f"one {gpu_name(dry, plan)}"
    if capacity is None:
        capacity = host_available_bytes() // plan.devices
        where = "this machine's memory" + (f", shared by {plan.devices} ranks" if plan.devices > 1 else "")
    check_fits(config, needed=state + rope_cache_bytes(config), available=capacity, where=where, source=source,
               fix=f"{CONFIG_FIX}, or shard it over more devices (--devices, --num_nodes, --strategy fsdp; --dry_run "
                   "says what fits)")


def fits(memory: MemoryEstimate, capacity: int) -> bool:
    return memory.total <= USABLE_MEMORY_FRACTION * capacity


def model_splits(devices: int, world: int) -> list[tuple[int, int]]:
    """(tp, pp) pairs to try, the smallest split first and, among equal ones, tensor parallelism before pipeline:
    tp divides a node's devices (at most 8: its collectives need one node's links), pp divides the ranks left."""
    tps = [tp for tp in range(1, min(devices, 8) + 1) if devices % tp == 0]
    pairs = [(tp, pp) for tp in tps for pp in range(1, world // tp + 1) if (world // tp) % pp == 0]
    return sorted(pairs, key=lambda pair: (pair[0] * pair[1], pair[1]))


def expert_splits(config: Config, plan: ParallelPlan) -> list[int]:
    """Expert-parallel degrees to try with ``plan``, smallest first: 1, and for a mixture of experts under FSDP each
    ep above 1 that divides both ``n_expert`` and the plan's ``dp_shard`` (the ranks ep is taken from)."""
    if not config.is_moe or plan.wrapper != "fsdp":
        return [1]
    return [ep for ep in range(1, plan.dp_shard + 1) if plan.dp_shard % ep == 0 and config.n_expert % ep == 0]


def with_expert_parallel(plan: ParallelPlan, ep: int) -> ParallelPlan:
    """``plan`` with its routed experts split over ``ep`` ranks of its data-parallel shard."""
    # NOTE: the plan is already resolved; expert_splits keeps to what ParallelPlan.resolve(ep=...) and check_model
    # allow (FSDP, ep dividing n_expert and dp_shard).
    return replace(plan, ep=ep)


SYNC_EVERY_MICRO_BATCH = "--fsdp.skip_gradient_sync false"
"""The remedy for gradients kept whole through accumulation: reduce-scatter them after every micro-batch."""


def suggest_layout(config: Config, plan: ParallelPlan, *, seq_len: int, train: Any, fsdp: Any,
                   capacity: int) -> tuple[str, Optional[Suggestion]]:
    """A layout that fits ``capacity`` bytes (a DDP run's with FSDP in DDP's place, named in the flags): first,
    where the run keeps its gradients whole through accumulation, the same layout with them reduce-scattered
    after every micro-batch; then the first layout of :func:`model_splits` that fits with the run's other flags,
    each split of a mixture of experts tried with each expert-parallel degree of :func:`expert_splits` (ep before
    tensor or pipeline parallelism: ep splits no block's work, and gathers ``1 / ep`` of each block's experts).

    If none does, the flags that lower memory are added one after another (those gradients, activation
    checkpointing, micro batch 1 and then its accumulated gradients reduce-scattered after each micro-batch,
    FULL_SHARD instead of HYBRID_SHARD, twice the nodes, CPU offload) until one does.
    Returns (the flags added before the split, empty if none were needed; the suggestion, None if nothing fits
    even then).
    """
    remedies = [("", train, fsdp, plan.num_nodes)]
    if plan.wrapper == "ddp":
        # NOTE: DDP keeps every state whole on every rank and splits nothing; the splits put FSDP in its place
        # (_resolve_split), which the suggestion must then name.
        sharding = "HYBRID_SHARD" if plan.num_nodes > 1 else "FULL_SHARD"
        fsdp = replace(fsdp, sharding_strategy=sharding)
        remedies = [(f"--strategy fsdp --fsdp.sharding_strategy {sharding}", train, fsdp, plan.num_nodes)]
    own_skip_sync = fsdp.skip_gradient_sync  # what a pipeline split keeps (see the NOTE below)
    if plan.grad_sync_only_last and plan.wrapper == "fsdp":
        # The accumulated gradients are whole on every rank; sharding them after each micro-batch costs only
        # communication, which overlaps the backward: tried first, before any split. (DDP's are whole either way.)
        fsdp = replace(fsdp, skip_gradient_sync=False)
        flag = SYNC_EVERY_MICRO_BATCH
        candidate = _resolve_split(config, plan, seq_len=seq_len, train=train, fsdp=fsdp, num_nodes=plan.num_nodes,
                                   tp=1, pp=1)
        memory = estimate_memory(config, candidate, seq_len=seq_len) if candidate is not None else None
        if memory is not None and fits(memory, capacity):
            return "", Suggestion(flag, candidate, memory)
        remedies.append((flag, train, fsdp, plan.num_nodes))
    if not fsdp.activation_checkpointing:
        fsdp = replace(fsdp, activation_checkpointing=True)
        remedies.append(("--fsdp.activation_checkpointing true", train, fsdp, plan.num_nodes))
    if plan.batch.micro_batch_size > 1:
        train = replace(train, micro_batch_size=1)
        remedies.append(("--train.micro_batch_size 1", train, fsdp, plan.num_nodes))
        if fsdp.skip_gradient_sync and plan.wrapper in ("fsdp", "ddp"):
            # A smaller micro batch accumulates: the sync skipped, FSDP would keep the gradients whole through it.
            fsdp = replace(fsdp, skip_gradient_sync=False)
            remedies.append((SYNC_EVERY_MICRO_BATCH, train, fsdp, plan.num_nodes))
    if plan.sharding_strategy == "HYBRID_SHARD":
        fsdp = replace(fsdp, sharding_strategy="FULL_SHARD")
        remedies.append(("--fsdp.sharding_strategy FULL_SHARD", train, fsdp, plan.num_nodes))
    remedies.append((f"--num_nodes {2 * plan.num_nodes}", train, fsdp, 2 * plan.num_nodes))
    remedies.append(("--fsdp.cpu_offload true", train, replace(fsdp, cpu_offload=True), 2 * plan.num_nodes))
    return _first_fitting_split(config, plan, remedies, own_skip_sync, seq_len=seq_len, capacity=capacity)


def _first_fitting_split(config: Config, plan: ParallelPlan, remedies: list[tuple[str, Any, Any, int]],
                         own_skip_sync: bool, *, seq_len: int, capacity: int) -> tuple[str, Optional[Suggestion]]:
    """:func:`suggest_layout`'s search: each remedy's flags added to those before it, every split of
    :func:`model_splits` tried with them; the first that fits, with the flags added."""
    added = []
    for flag, train, fsdp, num_nodes in remedies:
        added += [flag] if flag else []
        for tp, pp in model_splits(plan.devices, plan.devices * num_nodes):
            # NOTE: --pp_size refuses --fsdp.skip_gradient_sync false (its schedule reduces once per step anyway), so a
            # pipeline split is tried, and suggested, without that remedy.
            flags = [remedy for remedy in added if remedy != SYNC_EVERY_MICRO_BATCH] if pp > 1 else added
            candidate = _resolve_split(config, plan, seq_len=seq_len, train=train, num_nodes=num_nodes, tp=tp, pp=pp,
                                       fsdp=replace(fsdp, skip_gradient_sync=own_skip_sync) if pp > 1 else fsdp)
            if candidate is None:
                continue
            fitting = []
            for ep in expert_splits(config, candidate):
                chosen = with_expert_parallel(candidate, ep) if ep > 1 else candidate
                memory = estimate_memory(config, chosen, seq_len=seq_len)
                if fits(memory, capacity):
                    fitting.append((ep, chosen, memory))
            if fitting:
                ep, chosen, memory = _preferred_expert_split(fitting, plan.devices)
                sizes = (("ep_size", ep), ("tp_size", tp), ("pp_size", pp))
                split = " ".join(f"--{name} {size}" for name, size in sizes if size > 1)
                return " ".join(flags), Suggestion(split, chosen, memory)
    return " ".join(added), None


def _preferred_expert_split(fitting: list[tuple[int, ParallelPlan, MemoryEstimate]],
                            devices: int) -> tuple[int, ParallelPlan, MemoryEstimate]:
    """Of the expert-parallel degrees that fit one split (ep ascending), the largest whose all-to-all stays within a
    node (ep × tp ranks of a node's ``devices``): each doubling of ep halves the experts FSDP gathers and
    reduce-scatters per step, while the all-to-all's volume grows only from (ep - 1)/ep to (2·ep - 1)/(2·ep) of the
    same rows. A split that fits only with ep across nodes takes the smallest such ep."""
    within = [entry for entry in fitting if entry[0] * entry[1].tp <= devices]
    return within[-1] if within else fitting[0]


def _resolve_split(config: Config, plan: ParallelPlan, *, seq_len: int, train: Any, fsdp: Any, num_nodes: int,
                   tp: int, pp: int) -> Optional[ParallelPlan]:
    """The plan with these flags and this split, or None where they do not go together (the model does not divide,
    the batch gives the pipeline too few micro-batches, DDP)."""
    if fsdp.sharding_strategy == "NO_SHARD":
        fsdp = replace(fsdp, sharding_strategy=None)  # DDP does not compose with a split; FSDP is the alternative
    try:
        candidate = ParallelPlan.resolve(devices=plan.devices, num_nodes=num_nodes, train=train, fsdp=fsdp,
                                         precision=plan.precision, device_type=plan.device_type, tp=tp, pp=pp,
                                         strict_batch=False)
        candidate.check_model(config, seq_len)
    except ValueError:
        return None
    return candidate if candidate.batch_problem is None else None
