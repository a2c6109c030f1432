"""parallelize(), materialize() and the checkpointers on real gloo process groups (CPU).

One launch of 4 ranks does the multi-process work: 2 of them run every 2-rank scenario in a process group of their
own, then all 4 run the 2-D mesh and the resumes from the 2-rank checkpoints (see dist_worker.py). Each test checks one
claim against a single-process reference that runs the same code in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dist_worker as worker
from parity import assert_same_training
from llmtrain.checkpoint import layout
from llmtrain.config import Config
from llmtrain.args import FSDPArgs, TrainArgs
from llmtrain.checkpoint.resume import checkpoint_format
from llmtrain.checkpoint.state import load_training_state
from llmtrain.checkpoint.weights import load_weights
from llmtrain.distributed import shared_memory
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.distributed.parallelize import apply_activation_checkpointing, materialize, parallelize
from llmtrain.distributed.runtime import Runtime
from llmtrain.model import GPT

# The grad norm exposes any error in gradient averaging (a factor of the world size), which AdamW would hide.


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parallel")


@pytest.fixture(scope="module")
def single() -> dict:
    return worker.train(Runtime())


@pytest.fixture(scope="module")
def launched(workdir) -> dict:
    """One launch of 4 ranks: suite "two" on the first 2 in a process group of their own, then "four" (which resumes
    the checkpoints of "two") on all of them."""
    return worker.launch(4, "two+four", workdir)


@pytest.fixture(scope="module")
def two(launched) -> dict:
    return launched["two"]


@pytest.fixture(scope="module")
def four(launched) -> dict:
    return launched["four"]


def plain_init(config: Config, seed: int, dtype: torch.dtype = torch.float32) -> GPT:
    """The reference: an ordinary model on the CPU, seeded and initialised in this one process."""
    model = GPT(config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model.init_weights()
    return model.to(dtype)


# ------------------------------------------------------------------------------------ parity
@pytest.mark.slow
def test_reference_run_learns(single):
    """Guard: the reference loss really moves, so agreeing on it means something."""
    assert single["losses"][worker.MAX_STEPS] < single["losses"][1] - 0.3


@pytest.mark.parametrize("scenario, wrapper, mesh", [
    ("full_shard", "fsdp", "shard 2"),
    ("shard_grad_op", "fsdp", "shard 2"),
    ("ddp", "ddp", "replicate 2"),
    ("cpu_offload", "fsdp", "shard 2"),
])
@pytest.mark.multiproc
def test_two_ranks_match_single_process(two, single, scenario, wrapper, mesh):
    result = two[scenario]
    assert (result["wrapper"], result["mesh_shape"]) == (wrapper, mesh)
    assert result["grad_accum_steps"] >= 2
    assert_same_training(result, single)


@pytest.mark.multiproc
def test_cpu_offload_scenario_runs_fsdps_offload_policy(two):
    """The flags refuse --fsdp.cpu_offload on a CPU run (it would do nothing); the CPU tests still run FSDP's
    offload path for real, its plan resolved without the flag and given it afterwards (dist_worker.layout)."""
    assert two["cpu_offload"]["offload_policies"] == ["CPUOffloadPolicy"]
    assert two["full_shard"]["offload_policies"] == ["OffloadPolicy"]


@pytest.mark.multiproc
def test_the_dry_runs_shared_memory_figure_is_what_the_slots_took(two):
    """FULL_SHARD on 2 CPU processes maps two slots per kind of collective; the dry run's figure is their total."""
    shared = two["shared_memory_bytes"]
    assert shared["mapped"]["all-gather"] > 0 and shared["mapped"]["reduce-scatter"] > 0
    assert sum(shared["mapped"].values()) == shared["planned"]


@pytest.mark.multiproc
def test_compile_auto_is_one_decision_for_all_ranks(two):
    """A rank compiles only if every rank chose to (rank 0 alone wanting it compiles nowhere)."""
    assert two["compile_votes"] == [False, True]


@pytest.mark.multiproc
def test_embedding_and_head_are_fsdp_units_of_their_own_unless_tied(two):
    blocks = [["blocks.0"], ["blocks.1"]]
    assert two["full_shard"]["fsdp_units"] == [[""], *blocks, ["norm_f", "lm_head"], ["wte"]]
    assert two["init"]["fsdp_units"] == [[""], *blocks]  # tied: embedding, norm and head stay in the root's unit
    assert two["ddp"]["fsdp_units"] == []


@pytest.mark.multiproc
def test_hybrid_shard_on_two_nodes_uses_a_2d_mesh_and_matches(four, single):
    result = four["hsdp"]
    assert result["sharding_strategy"] == "HYBRID_SHARD"  # the default for num_nodes > 1
    assert result["mesh_ndim"] == 2 and result["mesh_shape"] == "replicate 2 × shard 2"
    assert result["grad_accum_steps"] == 2
    assert_same_training(result, single)


@pytest.mark.multiproc
def test_activation_checkpointing_gives_the_same_losses(two):
    assert_same_training(two["activation_checkpointing"], two["full_shard"])


@pytest.mark.multiproc
def test_fused_attention_under_fsdp_gives_the_same_losses(two):
    """One GEMM for q, k and v with RoPE and block attention written out (llmtrain.fused), on the weights FSDP
    gathers: the losses and gradient norms of SDPA and the modules."""
    result = two["fused_attention"]
    micro_batches = worker.MAX_STEPS * result["grad_accum_steps"]
    assert result["fused_calls"] == micro_batches * worker.tiny_config().n_layer
    assert_same_training(result, two["full_shard"])


@pytest.mark.multiproc
def test_per_op_checkpointing_under_fsdp_gives_the_same_losses(two):
    assert_same_training(two["op_checkpointing"], two["full_shard"])


@pytest.mark.multiproc
def test_bf16_mixed_under_fsdp_uses_the_policy_and_stays_close_to_fp32(two, single):
    result = two["bf16_mixed"]
    assert result["autocast_enabled"] is False  # FSDP's MixedPrecisionPolicy casts instead
    assert two["full_shard"]["autocast_enabled"] is True
    losses = torch.tensor(list(result["losses"].values()))
    expected = torch.tensor(list(single["losses"].values()))
    torch.testing.assert_close(losses, expected, rtol=0, atol=0.02)
    assert not torch.equal(losses, expected)  # it really computed in bf16
    # fp32 master weights: the trained weights stay float32.
    assert all(t.dtype == torch.float32 for t in result["weights"].values())


# ------------------------------------------------------------------------------ materialize
@pytest.mark.multiproc
def test_sharded_meta_init_equals_single_process_init_bit_exactly(two, four):
    config = worker.uneven_tied_config()
    expected = plain_init(config, worker.SEED).state_dict()
    for result in (two["init"], four["init"]):
        assert result["tied"], f"lm_head and wte came untied on mesh {result['mesh_shape']}"
        assert sorted(result["weights"]) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(result["weights"][name], tensor), f"{name} differs on mesh {result['mesh_shape']}"


def test_materialize_in_one_process_matches_plain_init_also_in_bf16():
    config = worker.tiny_config()
    for dtype in (torch.float32, torch.bfloat16):
        with torch.device("meta"):
            model = GPT(config).to(dtype)
        materialize(model, torch.device("cpu"), worker.SEED)
        expected = plain_init(config, worker.SEED, dtype)
        for (name, tensor), reference in zip(model.state_dict().items(), expected.state_dict().values()):
            assert tensor.dtype == dtype and torch.equal(tensor, reference), name
        assert model.rope_cos.dtype == torch.float32  # RoPE tables stay float32 (apply_rope casts per use)


# ------------------------------------------------------------------------------- checkpoints
@pytest.mark.multiproc
def test_sharded_checkpoint_layout(two, workdir):
    out_dir = workdir / "two" / "sharded"
    step = out_dir / "step-00000004"
    assert (step / "dcp" / ".metadata").is_file()
    for name in (layout.STATE_FILE, layout.CONFIG_FILE, layout.HPARAMS_FILE, layout.MARKER_FILE):
        assert (step / name).is_file(), name
    marker = json.loads((step / layout.MARKER_FILE).read_text())
    assert marker["format"] == "sharded" and marker["step"] == 4 and marker["world_size"] == 2
    assert checkpoint_format(step) == "sharded"
    assert checkpoint_format(workdir / "two" / "full" / "step-00000004") == "full"
    assert layout.latest_checkpoint(out_dir) == out_dir / "step-00000008"
    assert not [p.name for p in out_dir.iterdir() if p.name.startswith(".") and p.name != layout.LOCK_FILE], \
        "temporary directories left behind"
    training_state = load_training_state(step)
    assert training_state["train_state"]["step"] == 4 and len(training_state["rng"]) == 2
    assert training_state["data"] == {"samples_consumed": 4 * worker.GLOBAL_BATCH}


@pytest.mark.multiproc
def test_sharded_checkpoint_from_2_ranks_resumes_on_4_ranks(four, two):
    assert four["resume_sharded"]["mesh_shape"] == "replicate 2 × shard 2"
    assert_same_training(four["resume_sharded"], two["full_shard"], steps=range(5, 9))


@pytest.mark.multiproc
def test_sharded_checkpoint_from_2_ranks_resumes_in_one_process(two, workdir):
    result = worker.train(Runtime(), out_dir=workdir / "one", resume_from=workdir / "two" / "sharded" / "step-00000004")
    assert_same_training(result, two["full_shard"], steps=range(5, 9))
    torch.testing.assert_close(result["weights"], two["full_shard"]["weights"], rtol=1e-4, atol=1e-6)
    # A full-format run can resume the sharded checkpoint too, and still writes a full final/.
    result = worker.train(Runtime(), out_dir=workdir / "one_full", checkpoint_formats=("full",),
                          resume_from=workdir / "two" / "sharded" / "step-00000004")
    assert_same_training(result, two["full_shard"], steps=range(5, 9))
    assert (workdir / "one_full" / "full" / "final" / layout.MODEL_FILE).is_file()


@pytest.mark.multiproc
def test_full_checkpoint_written_under_fsdp_resumes_on_4_fsdp_ranks(four, two):
    assert four["resume_full"]["mesh_shape"] == "shard 4"
    assert_same_training(four["resume_full"], two["full_shard"], steps=range(5, 9))


@pytest.mark.multiproc
@pytest.mark.parametrize("scenario", ["resume_sharded_ddp", "resume_full_ddp"])
def test_checkpoints_written_under_fsdp_resume_under_ddp(four, two, scenario):
    assert four[scenario]["wrapper"] == "ddp"
    assert_same_training(four[scenario], two["full_shard"], steps=range(5, 9))


@pytest.mark.multiproc
def test_final_is_a_full_model_directory_that_loads_in_one_process(two, workdir):
    final = workdir / "two" / "sharded" / "final"
    assert checkpoint_format(final) == "full"
    model = GPT(Config.from_file(final / layout.CONFIG_FILE))
    load_weights(model, final)
    gathered = two["full_shard"]["weights"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, gathered[name]), name


def test_checkpoint_format_needs_a_marker(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint.json"):
        checkpoint_format(tmp_path)


# ------------------------------------------------------------------------- options, no processes
def resolve(strategy: str, fsdp: FSDPArgs, world_size: int, num_nodes: int, device_type: str = "cpu") -> ParallelPlan:
    return ParallelPlan.resolve(devices=world_size // num_nodes, num_nodes=num_nodes, strategy=strategy, fsdp=fsdp,
                                train=TrainArgs(global_batch_size=64, micro_batch_size=1), precision="32-true",
                                device_type=device_type)


def test_strategy_resolution():
    assert resolve("auto", FSDPArgs(), world_size=1, num_nodes=1).sharding_strategy is None
    assert resolve("auto", FSDPArgs(), world_size=8, num_nodes=1).sharding_strategy == "FULL_SHARD"
    assert resolve("fsdp", FSDPArgs(), world_size=16, num_nodes=2).sharding_strategy == "HYBRID_SHARD"
    assert resolve("ddp", FSDPArgs(), world_size=2, num_nodes=1).sharding_strategy == "NO_SHARD"
    assert resolve("fsdp", FSDPArgs("SHARD_GRAD_OP"), world_size=2, num_nodes=1).sharding_strategy == "SHARD_GRAD_OP"
    with pytest.raises(ValueError, match="--strategy ddp contradicts"):
        resolve("ddp", FSDPArgs("FULL_SHARD"), world_size=2, num_nodes=1)
    with pytest.raises(ValueError, match="--fsdp.cpu_offload needs a sharded strategy"):
        resolve("auto", FSDPArgs("NO_SHARD", cpu_offload=True), world_size=2, num_nodes=1, device_type="cuda")
    with pytest.raises(ValueError, match="--fsdp.cpu_offload needs a sharded strategy"):
        resolve("ddp", FSDPArgs(cpu_offload=True), world_size=2, num_nodes=1, device_type="cuda")
    with pytest.raises(ValueError, match="--fsdp.sharding_strategy"):
        FSDPArgs(sharding_strategy="ZERO3")


def test_plan_lays_out_the_mesh_and_the_batch():
    hybrid = resolve("auto", FSDPArgs(), world_size=16, num_nodes=2)
    assert (hybrid.dp_replicate, hybrid.dp_shard, hybrid.shard_size, hybrid.data_parallel_size) == (2, 8, 8, 16)
    assert hybrid.mesh_shape() == {"dp_replicate": 2, "dp_shard": 8} and hybrid.batch.grad_accum_steps == 4
    assert hybrid.describe_mesh() == "replicate 2 × shard 8"
    ddp = resolve("ddp", FSDPArgs(), world_size=4, num_nodes=2)
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.shard_size) == (4, 1, 1)
    single = resolve("auto", FSDPArgs(), world_size=1, num_nodes=1)
    assert single.wrapper == "none" and single.mesh_shape() == {} and not single.uses_process_group
    assert "one process" in single.describe() and "global batch 64, grad accumulation 64" in single.describe()
    one_fsdp = resolve("fsdp", FSDPArgs(cpu_offload=True), world_size=1, num_nodes=1, device_type="cuda")
    assert one_fsdp.wrapper == "fsdp" and one_fsdp.uses_process_group and one_fsdp.cpu_offload


def test_single_process_parallelize_applies_checkpointing_only():
    config = worker.tiny_config()
    plain = plain_init(config, worker.SEED)
    checkpointed = plain_init(config, worker.SEED)
    plan = ParallelPlan.resolve(devices=1, num_nodes=1, train=TrainArgs(), precision="bf16-mixed",
                                fsdp=FSDPArgs(activation_checkpointing=True), device_type="cpu")
    model = parallelize(checkpointed, plan, device=torch.device("cpu"))
    assert model is checkpointed and plan.wrapper == "none" and not plan.mixed_precision_policy
    assert "activation checkpointing" in plan.describe()
    assert list(model.state_dict()) == list(plain.state_dict())  # no wrapper prefix in the keys
    ids = torch.randint(0, 256, (2, worker.SEQ_LEN))
    for m in (plain, model):
        m(ids).float().square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    apply_activation_checkpointing(model)  # idempotent
    assert type(model.blocks[0]).__name__ == "CheckpointedBlock"


@pytest.mark.multiproc
def test_all_gathers_per_step_follow_the_sharding_strategy(two):
    # The tiny model has four units that hold weights: the embedding, two Blocks and [final norm, head] (the root holds
    # none). Each rank takes GLOBAL_BATCH / 2 samples per step in micro-batches. Both ranks share one host: every
    # all-gather goes through shared memory, none through gloo.
    steps = worker.MAX_STEPS
    full = two["full_shard"]  # micro-batch 1: four per step
    # Before every micro-batch's forward, each unit; before its backward again the three resharded after forward (the
    # head, needed first, is not).
    assert full["host_all_gathers"] == steps * full["grad_accum_steps"] * (4 + 3)
    held = two["shard_grad_op"]  # micro-batch 2: two per step
    assert held["grad_accum_steps"] == 2
    # SHARD_GRAD_OP keeps every unit gathered through forward and backward, and through the step's micro-batches.
    assert held["host_all_gathers"] == steps * 4
    assert full["all_gathers"] == held["all_gathers"] == 0
    # LLMTRAIN_HOST_COLLECTIVES=0: the same all-gathers, through gloo.
    through_gloo = two["full_shard_gloo"]
    assert through_gloo["all_gathers"] == full["host_all_gathers"] and through_gloo["host_all_gathers"] == 0


@pytest.mark.multiproc
def test_one_hosts_gradients_reduce_through_shared_memory_or_as_all_reduces(two):
    # On one host each unit's gradients reduce through shared memory, once per unit and step (after the step's last
    # backward), never through gloo's reduce-scatter; the losses and weights of the same runs match one process (the
    # tests above). The all-reduces left are the loop's own (the loss, the gradient norm).
    steps = worker.MAX_STEPS
    for run in ("full_shard", "shard_grad_op"):
        assert two[run]["host_reduce_scatters"] == steps * 4
        assert two[run]["reduce_scatters"] == 0
    # With shared memory off (and parallelize.reduce_scatter_by_all_reduce's size bound at 0, dist_worker.suite_two):
    # an all-reduce per unit and step, never gloo's reduce-scatter, and the losses of shared memory's run.
    through_gloo = two["full_shard_gloo"]
    assert through_gloo["host_reduce_scatters"] == 0 and through_gloo["reduce_scatters"] == 0
    assert through_gloo["all_reduces"] >= steps * 4
    assert_same_training(through_gloo, two["full_shard"])


@pytest.mark.multiproc
def test_without_room_in_shared_memory_every_rank_falls_back_to_gloo(two):
    # dist_worker.suite_two: rank 0 cannot reserve the slots, so no rank uses them; the run trains as the others.
    no_room = two["full_shard_no_room"]
    assert no_room["host_all_gathers"] == no_room["host_reduce_scatters"] == 0
    assert no_room["all_gathers"] == two["full_shard_gloo"]["all_gathers"] > 0
    assert_same_training(no_room, two["full_shard"])
    torch.testing.assert_close(no_room["weights"], two["full_shard"]["weights"], rtol=1e-5, atol=1e-7)


def test_host_collectives_switch(monkeypatch):
    monkeypatch.setenv("LLMTRAIN_HOST_COLLECTIVES", "0")
    assert not shared_memory.enabled()
    monkeypatch.setenv("LLMTRAIN_HOST_COLLECTIVES", "yes")
    with pytest.raises(ValueError, match="LLMTRAIN_HOST_COLLECTIVES='yes'"):
        shared_memory.enabled()
    monkeypatch.delenv("LLMTRAIN_HOST_COLLECTIVES")
    assert shared_memory.enabled() == Path(shared_memory.SHARED_MEMORY_DIR).is_dir()


# ------------------------------------------------------------------------------------ a mixture of experts
@pytest.fixture(scope="module")
def single_moe() -> dict:
    return worker.one_process_moe()


@pytest.mark.multiproc
def test_moe_on_two_ranks_matches_one_process_and_every_rank_has_its_expert_biases(two, single_moe):
    """The balancing losses weigh alike at accumulation 8 in one process and 4 on each of 2 ranks, and the bias
    update reads the load summed over the ranks: both ranks end with the biases of the one process."""
    result = two["moe"]
    assert result["mesh_shape"] == "shard 2" and result["grad_accum_steps"] == worker.GLOBAL_BATCH // 2
    assert_same_training(result, single_moe)
    rank0, rank1 = result["expert_biases"]
    (expected,) = single_moe["expert_biases"]
    for bias0, bias1, reference in zip(rank0, rank1, expected):
        assert torch.equal(bias0, bias1) and bias0.abs().max() > 0
        torch.testing.assert_close(bias0, reference)
    for step, metrics in result["moe"].items():  # the load summed over the ranks: the one process's balance
        assert metrics == pytest.approx(single_moe["moe"][step], rel=1e-4)


@pytest.mark.multiproc
def test_moe_sharded_checkpoint_resumes_in_one_process_with_its_experts_and_biases(two, workdir):
    """The 3-D expert weights and the expert_bias buffer go through DCP (step-4) and final/'s safetensors."""
    result = worker.train(Runtime(), config=worker.moe_config(), out_dir=workdir / "moe_one",
                          resume_from=workdir / "moe" / "sharded" / "step-00000004")
    assert_same_training(result, two["moe"], steps=range(5, 9))
    for got, expected in zip(result["expert_biases"][0], two["moe"]["expert_biases"][0]):
        torch.testing.assert_close(got, expected)
    final = workdir / "moe" / "sharded" / "final"
    model = GPT(Config.from_file(final / layout.CONFIG_FILE))
    load_weights(model, final)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, two["moe"]["weights"][name]), name
    assert model.blocks[0].mlp.expert_bias.abs().max() > 0
