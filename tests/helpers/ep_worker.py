"""Multi-process harness for tests/distributed/test_expert_parallel.py: expert-parallel scenarios on real gloo ranks.

``dist_worker.launch(4, "four+two", workdir, script=ep_worker.SCRIPT)`` starts the ranks; each runs the suite's
scenarios one after another in the same process group ("two" on the first 2 ranks, in a group of their own:
WORLD_SIZES), and rank 0 saves the results. The single-process references
call :func:`train` in the test process. The training itself is tp_worker's, on a mixture-of-experts model.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch

import dist_worker
import pp_worker
import tp_worker
from llmtrain.args import FSDPArgs
from llmtrain.config import Config
from llmtrain.distributed.runtime import Runtime

SCRIPT = Path(__file__)


def moe_config(**overrides) -> Config:
    """moe-debug shrunk: 2 layers of width 64, 8 experts of width 32 (top 2), a 256-token vocabulary, the
    load-balancing loss on (its gradient weighs each micro-batch as the token loss does, so one process accumulating 8
    micro-batches and 2 ranks accumulating 4 each must agree with it too)."""
    fields = dict(n_layer=2, n_embd=64, n_head=4, n_query_groups=2, intermediate_size=64, moe_intermediate_size=32,
                  vocab_size=256, block_size=32, router_aux_loss_coef=0.05)
    return Config.from_name("moe-debug", **{**fields, **overrides})


def train(world_size: int = 1, *, model: Optional[dict] = None, **options) -> dict:
    """tp_worker.train of the shrunk moe-debug (``model``: fields changed) on the given layout (``ep=``, ``tp=``,
    ...), with where the experts are.

    NOTE: one process (the reference) computes with one thread, as each rank does: a router's top-k can flip between
    two nearly tied experts on float32 rounding, and another thread count rounds the matmuls otherwise.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tp_worker.train(world_size, config=moe_config(**(model or {})), report=_expert_placements, **options)
    finally:
        torch.set_num_threads(threads)


def _expert_placements(model: torch.nn.Module) -> dict:
    """The first MoE's gate_proj: its mesh's dimension names and placements, this rank's local shape, and the ranks
    of this rank's group along each dimension."""
    from torch.distributed.tensor import DTensor

    from llmtrain.moe import moe_layers

    weight = moe_layers(model)[0][1].experts.gate_proj
    if not isinstance(weight, DTensor):
        return {"expert_placements": {"local_shape": tuple(weight.shape)}}
    mesh = weight.device_mesh
    return {"expert_placements": {"mesh": mesh.mesh_dim_names, "placements": [str(p) for p in weight.placements],
                                  "local_shape": tuple(weight.to_local().shape),
                                  "groups": {name: mesh[name].mesh.tolist() for name in mesh.mesh_dim_names}}}


# ------------------------------------------------------------------------------------ suites
FEW_EXPERTS = dict(n_expert=2)
"""Fewer experts per ep rank (1) than ranks to FSDP-shard them over (2): FSDP splits each expert's rows instead.
Both experts take every token (top 2), so no routing choice can flip on float32 rounding: with top 1, step 8's loss
came out 1e-3 apart (steps 1 to 7 equal to 1e-7), as one token moving to the other expert would make it."""


def suite_two(runtime: Runtime, workdir: Path) -> dict:
    return {"ep2": train(2, ep=2, out_dir=workdir / "ep2_full", checkpoint_format="full"),
            # backward runs each block's forward again, all-to-alls included
            "ep2_checkpointed": train(2, ep=2, fsdp=FSDPArgs(activation_checkpointing=True))}


def suite_four(runtime: Runtime, workdir: Path) -> dict:
    saved = workdir / "ep2_fsdp"
    return {
        # FSDP over 4 ranks for every other weight; the experts split over 2 and FSDP-sharded over the other 2
        "ep2_fsdp": train(4, ep=2, out_dir=saved),
        # the checkpoint of step 4 at ep 2, into ep 4: DCP reshards the experts
        "ep4_resume": train(4, ep=4, resume_from=saved / "step-00000004"),
        "ep2_few_experts": train(4, ep=2, model=FEW_EXPERTS),
        # 2 "nodes" of 2 under HYBRID_SHARD: each node's 2 ranks split the experts, the nodes replicate them
        "ep2_hsdp": train(4, ep=2, num_nodes=2),
        # tensor parallelism on the attention, the MoE whole on both tp ranks, its experts split over the 2 dp ranks
        "ep2_tp2": train(4, ep=2, tp=2),
        # 2 pipeline stages of one block, each block's experts split over the stage's 2 data-parallel ranks
        "ep2_pp2": pp_worker.train(runtime, pp=2, schedule="1f1b", ep=2, config=moe_config()),
    }


SUITES = {"two": suite_two, "four": suite_four}
WORLD_SIZES = {"two": 2, "four": 4}

if __name__ == "__main__":
    dist_worker.worker_main(sys.argv[1], Path(sys.argv[2]), suites=SUITES, world_sizes=WORLD_SIZES)
