"""Expert parallelism: each MoE block's routed experts split over the ``ep`` ranks, tokens sent to them and back.

The MoE block (:mod:`llmtrain.moe`) routes its tokens and hands its experts the rows sorted by expert with the count
of each, ``experts(rows, tokens_per_expert)``. Here that call becomes, on every ``ep`` rank:

1. an all-to-all of the counts: each rank learns how many rows every other rank sends to each of its experts;
2. an all-to-all of the rows (uneven splits): the rows of expert ``e`` go to the rank that holds it;
3. the received rows regrouped by local expert (they arrive grouped by sender), the local experts' products
   (:func:`llmtrain.moe.expert_products` on this rank's slice of the 3-D weights), the regrouping undone;
4. the all-to-all back, in the reverse splits, so that each rank has its own rows' outputs in its own order.

The row all-to-alls are torch's differentiable functional collective: backward sends the gradients back the same
way. The three expert weights become DTensors ``Shard(0)`` over the ``ep`` mesh dimension (experts are dim 0), so
DCP saves and reloads them at any other ``ep`` (resharding) and FSDP shards each rank's experts further over
``dp_shard_mod_ep`` (:func:`llmtrain.distributed.parallelize.apply_fsdp`). The block stays free of parallelism:
the experts' class is swapped for a subclass whose forward does the above, as activation checkpointing swaps a
Block's, so parameter names and state-dict keys do not change.

Expert parallelism borrows its ranks from the data-parallel shard: the ``ep`` ranks see different tokens, so every
expert's gradient is the sum over the tokens of all of them, and FSDP's averaging of the experts must divide by
the whole data-parallel size, not by the ranks that shard one expert (``apply_fsdp`` sets the divide factor).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from llmtrain.moe import GroupedExperts, expert_products, moe_layers

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def apply_expert_parallel(model: nn.Module, ep_mesh) -> None:
    """Split the routed experts of every MoE block of ``model`` over the 1-D ``ep_mesh``, in place.

    Works on the meta device (materialise later) or on real weights (each rank keeps its slice; no communication).
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    for _, moe in moe_layers(model):
        experts = moe.experts
        if experts.gate_proj.size(0) % ep_mesh.size():
            raise ValueError(f"{experts.gate_proj.size(0)} experts do not split over {ep_mesh.size()} ranks")
        for name in EXPERT_WEIGHTS:
            weight = getattr(experts, name)
            # src_data_rank=None: every rank holds the same full tensor (or a meta one); each keeps its slice.
            sharded = distribute_tensor(weight.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
        experts.__class__ = _expert_parallel_class(type(experts))
        experts.ep_group = ep_mesh.get_group()
    # NOTE: FSDP then splits each rank's experts over dp_shard_mod_ep, an order of mesh dimensions that DTensor cannot
    # gather in one all-gather: each full checkpoint and final/ warned, once per mesh and rank, that it takes two
    # (about reductions, which a gather has none of). Each tensor still crosses the network once, as a dense one.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@functools.lru_cache(maxsize=None)
def _expert_parallel_class(experts_class: type) -> type:
    if issubclass(experts_class, ExpertParallelExperts):
        return experts_class
    return type(f"ExpertParallel{experts_class.__name__}", (ExpertParallelExperts, experts_class),
                {"__module__": experts_class.__module__})


class ExpertParallelExperts(GroupedExperts):
    """The forward of routed experts split over ``ep_group`` (set by :func:`apply_expert_parallel`)."""

    ep_group = None

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        group = self.ep_group
        ep = group.size()
        with record_function("moe.all_to_all"):
            received = torch.empty_like(tokens_per_expert)
            dist.all_to_all_single(received, tokens_per_expert, group=group)
            # (sender, local expert): rows each rank sends to each of this rank's experts
            received = received.view(ep, -1)
            send_splits = tokens_per_expert.view(ep, -1).sum(dim=1).tolist()
            recv_splits = received.sum(dim=1).tolist()
            rows = all_to_all_single_autograd(x, recv_splits, send_splits, group)
        local_counts = received.sum(dim=0)
        # Rows arrive grouped by sender, then by expert; the products want them grouped by expert (stable: by sender
        # within an expert, each sender's rows in its own order).
        local_expert = torch.arange(received.size(1), device=x.device).repeat(ep)
        order = local_expert.repeat_interleave(received.flatten().to(x.device)).argsort(stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        with record_function("moe.expert_products"):
            out = expert_products(rows[order], local_counts, *(_local(getattr(self, name)) for name in EXPERT_WEIGHTS),
                                  self.approximate, self.grouped)
        with record_function("moe.all_to_all"):
            # NOTE: waited for here, not at the combine's first use of it: the same on the CPU (nothing to overlap)
            # and on a GPU (a stream wait), and the wait is then this span's time, not the combine's.
            return wait_tensor(all_to_all_single_autograd(out[inverse], send_splits, recv_splits, group))


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight: the local part of a DTensor (FSDP has gathered its shard dimension)."""
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight
