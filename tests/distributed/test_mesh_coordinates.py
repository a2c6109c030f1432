"""A rank's place in its plan comes from the plan's DeviceMesh alone (``ParallelPlan.coordinates``): here every rank of
several layouts, each under torch's fake process group in this process, against the layout the plan documents,
``pp × dp_replicate × dp_shard × tp`` with tp innermost, and the nodes numbered one after the other."""

from __future__ import annotations

import pytest

from llmtrain.args import FSDPArgs, TrainArgs
from llmtrain.distributed.parallel_plan import ParallelPlan, global_rank
from llmtrain.distributed.runtime import Runtime
from llmtrain.recipes.simulate import fake_world


def plan_of(devices: int, nodes: int, *, tp: int = 1, pp: int = 1, sharding: str | None = None,
            strategy: str = "auto") -> ParallelPlan:
    data_parallel = devices * nodes // (tp * pp)
    return ParallelPlan.resolve(devices=devices, num_nodes=nodes, precision="32-true", accelerator="cpu",
                                train=TrainArgs(global_batch_size=data_parallel * pp, micro_batch_size=1),
                                strategy=strategy, fsdp=FSDPArgs(sharding_strategy=sharding), tp=tp, pp=pp)


LAYOUTS = {
    "fsdp 4": plan_of(4, 1),
    "ddp 2": plan_of(2, 1, strategy="ddp"),
    "hsdp 2 nodes of 2": plan_of(2, 2),
    "tp 2 × fsdp 2": plan_of(4, 1, tp=2),
    "pp 2 × tp 2, no wrapper": plan_of(4, 1, tp=2, pp=2),
    "pp 2 × hsdp 2 × 2 × tp 2": plan_of(4, 4, tp=2, pp=2, sharding="HYBRID_SHARD"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_rank_finds_its_place_on_the_mesh(name):
    plan = LAYOUTS[name]
    tp, dp = plan.tp, plan.data_parallel_size
    for rank in range(plan.world_size):
        with fake_world(rank, plan.world_size):
            runtime = Runtime.simulated(plan, rank)
        expected = dict(data_parallel_rank=rank // tp % dp, data_parallel_size=dp, tp_rank=rank % tp, tp_size=tp,
                        pp_rank=rank // (dp * tp), pp_size=plan.pp)
        found = {key: getattr(runtime, key) for key in expected}
        assert found == expected, f"{name}, rank {rank}"
        assert runtime.mesh is not None
        assert plan.first_rank_of_stage(runtime.pp_rank) <= rank < plan.first_rank_of_stage(runtime.pp_rank) + dp * tp
        node, local_rank = plan.node_and_local_rank(rank)
        assert (global_rank(node, local_rank, plan.devices), runtime.local_rank) == (rank, local_rank)


def test_without_a_mesh_every_rank_is_a_data_parallel_rank_of_its_own():
    """One process, and DeepSpeed (which groups the ranks itself), have no mesh; a plan that splits the model needs
    its mesh to place a rank."""
    assert plan_of(1, 1).coordinates(None, 0) == dict(data_parallel_rank=0, data_parallel_size=1, tp_rank=0,
                                                      tp_size=1, pp_rank=0, pp_size=1)
    zero = plan_of(4, 1, strategy="deepspeed_stage_1")
    assert zero.build_mesh() is None
    assert zero.coordinates(None, 3) == dict(data_parallel_rank=3, data_parallel_size=4, tp_rank=0, tp_size=1,
                                             pp_rank=0, pp_size=1)
    with pytest.raises(ValueError, match="build the mesh"):
        LAYOUTS["tp 2 × fsdp 2"].coordinates(None, 1)
