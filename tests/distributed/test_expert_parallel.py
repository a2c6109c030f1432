"""Expert parallelism (``--ep_size``): the plan and its refusals, and training on real gloo ranks (CPU).

One launch of 4 ranks runs every scenario (ep_worker.py), those of 2 ranks on the first 2; each test checks one claim
against a single process that runs the same code here with the same global batch (micro batch 1: the ranks accumulate
8 / world micro-batches each, the single process 8).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

import dist_worker
import ep_worker
from forked_cli import run_forked
from parity import assert_same_training
from llmtrain.args import FSDPArgs, TrainArgs
from llmtrain.distributed.parallel_plan import ParallelPlan

# The experts' AdamW moments differ from one process's by float32 rounding (their rows are summed in another
# order); as tests/distributed/test_tensor_parallel.py, a real difference moves weights by whole steps of 5e-3.
WEIGHT_RTOL, WEIGHT_ATOL = 1e-4, 5e-5


def _plan(devices: int, ep: int, **options) -> ParallelPlan:
    return ParallelPlan.resolve(devices=devices, num_nodes=options.pop("num_nodes", 1),
                                train=TrainArgs(global_batch_size=16, micro_batch_size=1), precision="32-true",
                                accelerator="cpu", ep=ep, **options)


# ----------------------------------------------------------------------------------------- the plan
def test_the_expert_ranks_come_from_the_fsdp_shard():
    plan = _plan(8, 2)
    assert (plan.dp_shard, plan.ep, plan.expert_shard_size, plan.world_size) == (8, 2, 4, 8)
    assert plan.mesh_shape() == {"dp_shard": 8}  # no rank more: ep is a factor of the shard
    assert plan.describe_mesh() == "shard 8 (experts: shard 4 × expert 2)"
    assert "expert parallel 2" in plan.describe()
    hybrid = _plan(4, 4, num_nodes=2, fsdp=FSDPArgs(sharding_strategy="HYBRID_SHARD"))
    assert hybrid.describe_mesh() == "replicate 2 × shard 4 (experts: shard 1 × expert 4)"
    assert _plan(4, 1).describe_mesh() == "shard 4"


@pytest.mark.parametrize("devices, ep, options, says", [
    (2, 0, {}, "--ep_size 0 must be at least 1"),
    (1, 2, {}, "--ep_size 2 must divide the 1 rank(s) of the data-parallel shard"),
    (4, 3, {}, "--ep_size 3 must divide the 4 rank(s) of the data-parallel shard, from which the expert-parallel "
               "ranks are taken (under HYBRID_SHARD the shard is one node's ranks): use --ep_size 2 or 4"),
    (4, 4, {"tp": 2}, "--ep_size 4 must divide the 2 rank(s) of the data-parallel shard, from which the "
                      "expert-parallel ranks are taken (--tp_size × --pp_size take the other ranks;"),
    (2, 2, {"strategy": "ddp"}, "DDP (NO_SHARD) replicates every weight: use --strategy fsdp"),
    (2, 2, {"strategy": "deepspeed_stage_3"}, "--ep_size 2 with --strategy deepspeed_stage_3"),
])
def test_ep_size_that_does_not_fit_the_layout_is_refused(devices, ep, options, says):
    with pytest.raises(ValueError) as refused:
        _plan(devices, ep, **options)
    assert says in str(refused.value)


def test_ep_size_must_split_the_experts_of_an_moe():
    from llmtrain.config import Config

    with pytest.raises(ValueError, match=r"--ep_size 2 splits the routed experts .* model 'llama-debug' is dense"):
        _plan(2, 2).check_model(Config.from_name("llama-debug"), 64)
    with pytest.raises(ValueError, match=r"--ep_size 4 must divide the 6 experts \(n_expert\) .*: use --ep_size 2"):
        _plan(4, 4).check_model(ep_worker.moe_config(n_expert=6), 64)
    _plan(4, 4).check_model(ep_worker.moe_config(), 64)  # 8 experts, 2 per rank
    # 2 experts at ep 2 over 8 ranks: 1 per ep rank, FSDP-split on its rows over 4 ranks, which 64 and 30 are not
    with pytest.raises(ValueError, match=r"leaves 1 expert\(s\) per rank to FSDP-shard over 4 ranks .*"
                                         r"moe_intermediate_size 30, n_embd 64\) divide by 4; use fewer processes$"):
        _plan(8, 2).check_model(ep_worker.moe_config(n_expert=2, moe_intermediate_size=30), 64)
    _plan(8, 2).check_model(ep_worker.moe_config(n_expert=2), 64)  # widths 32 and 64: split by rows


# ------------------------------------------------------------------------------------- on gloo ranks
@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("expert_parallel")


@pytest.fixture(scope="module")
def single() -> dict:
    return ep_worker.train()


@pytest.fixture(scope="module")
def launched(workdir) -> dict:
    """One launch of 4 ranks: suite "four" on all of them, then "two" on the first 2 in a process group of their own."""
    return dist_worker.launch(4, "four+two", workdir, script=ep_worker.SCRIPT, timeout_s=900)


@pytest.fixture(scope="module")
def two(launched) -> dict:
    return launched["two"]


@pytest.fixture(scope="module")
def four(launched) -> dict:
    return launched["four"]


# (launch, scenario): the mesh it describes, and the shape of the experts' gate_proj one rank holds (None: not asked)
PARITY = {
    # each rank holds 4 of the 8 experts, split on the experts' dimension over the mesh's ep dimension
    ("two", "ep2"): ("shard 2 (experts: shard 1 × expert 2)", (4, 32, 64)),
    ("two", "ep2_checkpointed"): ("shard 2 (experts: shard 1 × expert 2)", (4, 32, 64)),
    # FSDP over 4 ranks for the rest; 4 experts per ep rank, FSDP-sharded over the 2 ranks that hold them: 2 each
    ("four", "ep2_fsdp"): ("shard 4 (experts: shard 2 × expert 2)", (2, 32, 64)),
    # within a node the 2 ranks split the experts; the experts' gradients are all-reduced across the 2 nodes
    ("four", "ep2_hsdp"): ("replicate 2 × shard 2 (experts: shard 1 × expert 2)", (4, 32, 64)),
    # the experts split over the 2 data-parallel ranks of each tensor-parallel rank, whole on both tp ranks
    ("four", "ep2_tp2"): ("shard 2 (experts: shard 1 × expert 2) × tensor 2", (4, 32, 64)),
    # rank 0 holds the first block; its experts split with rank 1
    ("four", "ep2_pp2"): ("pipeline 2 × shard 2 (experts: shard 1 × expert 2)", None),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("launch, scenario", list(PARITY))
def test_expert_parallel_trains_like_one_process(launch, scenario, single, request):
    """Each layout's losses, gradient norms and final weights are one process's with the same global batch."""
    result = request.getfixturevalue(launch)[scenario]
    mesh, local_shape = PARITY[launch, scenario]
    assert result.get("mesh", result.get("mesh_shape")) == mesh
    if local_shape is not None:
        assert result["expert_placements"]["mesh"][-2:] == ("dp_shard_mod_ep", "ep")  # after dp_replicate in HSDP
        assert result["expert_placements"]["local_shape"] == local_shape
    assert_same_training(result, single)
    torch.testing.assert_close(result["weights"], single["weights"], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)


@pytest.mark.multiproc
def test_fewer_experts_per_rank_than_ranks_sharding_them_split_each_expert(four):
    """2 experts at ep 2 over 4 ranks: each ep rank's one expert is FSDP-split on its rows (dim 1) over 2 ranks."""
    result = four["ep2_few_experts"]
    assert result["expert_placements"]["local_shape"] == (1, 16, 64)
    assert result["expert_placements"]["placements"] == ["S(1)", "S(0)"]  # FSDP on rows, ep on experts
    assert_same_training(result, ep_worker.train(model=ep_worker.FEW_EXPERTS))


@pytest.mark.multiproc
def test_the_expert_ranks_are_neighbours_within_the_shard(four):
    """dp_shard 4 read as dp_shard_mod_ep 2 × ep 2, ep inner: rank 0 swaps tokens with rank 1 and shares its experts
    with rank 2 (FSDP); under tp 2 the tensor-parallel ranks stay innermost, so the ep group is ranks 0 and 2."""
    assert four["ep2_fsdp"]["expert_placements"]["groups"] == {"dp_shard_mod_ep": [0, 2], "ep": [0, 1]}
    assert four["ep2_tp2"]["expert_placements"]["groups"] == {"dp_shard_mod_ep": [0], "ep": [0, 2]}


# ------------------------------------------------------------------------------------- checkpoints
@pytest.mark.multiproc
def test_sharded_checkpoint_from_ep2_resumes_at_ep4(four):
    assert four["ep4_resume"]["mesh"] == "shard 4 (experts: shard 1 × expert 4)"
    assert_same_training(four["ep4_resume"], four["ep2_fsdp"], steps=range(5, 9))


@pytest.mark.multiproc
def test_sharded_checkpoint_from_ep2_resumes_in_one_process(four, workdir):
    result = ep_worker.train(resume_from=workdir / "ep2_fsdp" / "step-00000004")
    assert_same_training(result, four["ep2_fsdp"], steps=range(5, 9))
    torch.testing.assert_close(result["weights"], four["ep2_fsdp"]["weights"], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)


@pytest.mark.multiproc
def test_full_checkpoint_from_ep2_resumes_in_one_process(two, workdir):
    result = ep_worker.train(resume_from=workdir / "ep2_full" / "step-00000004")
    assert_same_training(result, two["ep2"], steps=range(5, 9))


@pytest.mark.multiproc
def test_final_weights_written_under_ep_are_the_gathered_experts(four, workdir):
    from llmtrain.checkpoint.weights import load_weights
    from llmtrain.model import GPT

    model = GPT(ep_worker.moe_config())
    load_weights(model, workdir / "ep2_fsdp" / "final")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, four["ep2_fsdp"]["weights"][name]), name


# ----------------------------------------------------------------------------------- the CLI
@pytest.mark.multiproc
def test_pretrain_cli_at_ep2_has_the_losses_of_one_process(tmp_path, dist_env):
    """--ep_size from the command line to the ranks: 2 processes at ep 2 against one, the same global batch."""
    command = ["pretrain", "moe-debug", "--model_config.n_layer", "2", "--data", "BuiltinStories",
               "--data.num_documents", "200", "--data.num_val_documents", "20", "--train.max_steps", "3",
               "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_seq_length", "64",
               "--eval.initial_validation", "false", "--eval.final_validation", "false"]
    layouts = {"ep2": ["--devices", "2", "--ep_size", "2"], "one": ["--devices", "1"]}
    # Each run its own `python -m llmtrain` process, forked from one interpreter that imported the CLI once.
    runs = run_forked([[*command, *layout, "--out_dir", str(tmp_path / name)] for name, layout in layouts.items()],
                      tmp_path / "logs", dist_env, timeout_s=1200, at_once=1)  # a hang guard
    losses, printed = {}, {}
    for name, done in zip(layouts, runs):
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        printed[name] = done.stdout
        with open(tmp_path / name / "metrics.csv") as file:
            losses[name] = torch.tensor([float(row["loss"]) for row in csv.DictReader(file) if row["loss"]])
    assert "mesh shard 2 (experts: shard 1 × expert 2), expert parallel 2 |" in printed["ep2"]
    assert len(losses["one"]) == 3
    torch.testing.assert_close(losses["ep2"], losses["one"], rtol=1e-5, atol=0)
