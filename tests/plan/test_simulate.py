"""``--dry_run.simulate``: ranks of 32- to 512-rank layouts run in one process through the real code
(llmtrain.recipes.simulate).

Each simulated rank builds its part of the model, runs one training step and gathers a full checkpoint under torch's
fake process group and fake tensors; the tests hold the dry run's arithmetic (memory, communication) to what torch's
trackers measured there, within 15%, and check what only shows at scale: no collective whose size at one rank grows
with the world, and rank 0 never receiving more than one tensor at a time of a full checkpoint.

The layouts use one micro-batch per step (two or eight for a pipeline, which needs them): the simulation's cost is
one dispatch per operator, whatever the tensors' sizes, so a step of a 70B model takes seconds. The usage line, dp x tp,
the clipping and the command line are in the fast tier (about 30 s together); the layouts with a pipeline or a large
model take 8 to 14 s each and are marked slow.
"""

from __future__ import annotations

import importlib
import os

import pytest

from forked_cli import run_forked
from llmtrain.recipes import simulate
from llmtrain.args import FSDPArgs, TrainArgs
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.flops import num_parameters

AGREEMENT = 0.15
"""How far the dry run's figures may be from the measured ones (the issue's bound)."""
SEQ_LEN = 2048


def layout(name: str, *, devices: int = 8, nodes: int, micro: int = 1, accumulation: int = 1, tp: int = 1,
           pp: int = 1, strategy: str | None = None, precision: str = "bf16-mixed"):
    """(config, plan, train) of model ``name`` on ``devices`` × ``nodes`` H100s."""
    config = Config.from_name(name)
    data_parallel = devices * nodes // (tp * pp)
    train = TrainArgs(global_batch_size=data_parallel * micro * accumulation, micro_batch_size=micro,
                      max_seq_length=SEQ_LEN)
    plan = ParallelPlan.resolve(devices=devices, num_nodes=nodes, train=train, precision=precision,
                                fsdp=FSDPArgs(sharding_strategy=strategy), device_type="cuda", accelerator="cuda",
                                gpu="H100", tp=tp, pp=pp)
    return config, plan, train


def run(config, plan, train, ranks=None, checkpoint=False):
    return simulate.simulate(config, plan, seq_len=SEQ_LEN, optimizer_spec="AdamW", train=train, ranks=ranks,
                             checkpoint=checkpoint)


def assert_estimates_hold(reports) -> None:
    """Memory within 15% of the measured peak, each mesh dimension's bytes per step within 15%, nothing that grows
    with the world."""
    for report in reports:
        measured, estimated = report.peak_total, report.estimate.total
        assert abs(estimated - measured) <= AGREEMENT * measured, (
            f"rank {report.rank}: estimate {estimated / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB "
            f"({report.peak})")
        for dim, ops in report.step.items():
            sent = sum(found.bytes for found in ops.values())
            if sent < 2**10:  # the step's token count and votes, a gradient norm: bytes, never tensors of the model
                assert dim in ("world", "pp") or set(ops) == {"allreduce_"}, (dim, ops)
                continue
            expected = report.comm_estimate.get(dim)
            assert expected is not None, f"rank {report.rank}: {dim} carries {ops}, which the dry run does not count"
            assert abs(expected - sent) <= AGREEMENT * sent, (
                f"rank {report.rank}, {dim}: estimate {expected / 2**30:.3f} GiB, measured {sent / 2**30:.3f} GiB {ops}")
        assert not report.growing, report.growing


@pytest.fixture(scope="module", autouse=True)
def imports_the_ranks_share():
    """Every simulated rank runs in a fork of this process (simulate.start_child_process), which shares what this
    process has imported: torch._dynamo, which each rank's optimizer constructor imports (1.5 s of CPU each,
    measured), and what simulate_rank imports on its way, imported here once instead of in each of the file's 13
    forks. The command line forks its ranks with them imported already (its check of --optimizer builds one)."""
    for name in ("torch._dynamo", "torch._subclasses.fake_tensor", "llmtrain.checkpoint.checkpointer",
                 "llmtrain.distributed.pipeline", "llmtrain.plan.communication", "llmtrain.plan.memory",
                 "llmtrain.recipes.build", "llmtrain.train.loop", "llmtrain.train.step", "llmtrain.train.strategy"):
        importlib.import_module(name)


def test_the_ranks_whose_work_differs():
    _, plan, _ = layout("tiny-llama-1.1b", nodes=4, tp=4, pp=2, accumulation=2)
    assert simulate.simulated_ranks(plan) == [(0, "rank 0"), (16, "last pipeline stage"),
                                              (24, "first rank of node 3")]
    _, plan, _ = layout("tiny-llama-1.1b", devices=8, nodes=1)
    assert simulate.simulated_ranks(plan) == [(0, "rank 0")]


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "FULL_SHARD"])
def test_the_usage_line_at_32_ranks(strategy):
    """`llmtrain pretrain tiny-llama --devices 8 --num_nodes 4`: rank 0 and a rank of the last node."""
    config, plan, train = layout("tiny-llama-1.1b", nodes=4, micro=4, strategy=strategy)
    reports = run(config, plan, train)
    assert [report.rank for report in reports] == [0, 24]
    assert_estimates_hold(reports)
    dims = set(reports[0].step)
    if strategy == "HYBRID_SHARD":  # sharded within a node, each shard's gradients all-reduced across the nodes
        assert {"dp_shard", "dp_replicate"} <= dims
        assert set(reports[0].step["dp_replicate"]) == {"allreduce_"}
    else:
        assert "dp_replicate" not in dims
    # every unit gathered for the forward, the resharded ones again for the backward; gradients reduce-scattered once
    gathers = reports[0].step["dp_shard"]["_allgather_base_"].count
    assert gathers == 2 * (config.n_layer + 1) + 2  # the blocks and the embedding twice, [norm, head] and the root once


def test_data_and_tensor_parallel_8_by_4_at_32_ranks():
    config, plan, train = layout("tiny-llama-1.1b", nodes=4, micro=4, tp=4)
    assert plan.data_parallel_size == 8 and plan.tp == 4
    reports = run(config, plan, train, ranks=[(0, "rank 0")])
    assert_estimates_hold(reports)
    assert "tp" in reports[0].step


def test_clipping_fsdp_and_tensor_parallel_gradients_gathers_none_whole():
    """FSDP and tensor parallelism both split the embedding's and the head's rows; torch's get_total_norm redistributed
    such gradients to whole tensors, and on this layout the step's peak was the clipping, every rank holding all 1.1B
    gradients in fp32 (6.15 GiB measured against a 3.8 GiB estimate). Reduced from the local shards, the peak is the
    forward's again."""
    config, plan, train = layout("tiny-llama-1.1b", nodes=1, micro=2, tp=4)
    assert plan.dp_shard == 2 and plan.tp == 4
    [report] = run(config, plan, train, ranks=[(0, "rank 0")])
    assert_estimates_hold([report])
    assert report.peak_total < 4 * num_parameters(config)  # less than the whole model's fp32 gradients, all told


def pipeline_layout(nodes: int):
    """pp 2 x dp x tp 4 of tiny-llama on ``nodes`` nodes: 2 micro-batches of 2 a step."""
    return layout("tiny-llama-1.1b", nodes=nodes, micro=2, accumulation=2, tp=4, pp=2)


@pytest.fixture(scope="module")
def pipeline_at_32_ranks():
    """The ranks of :func:`simulate.simulated_ranks` of the 32-rank pipeline layout, side by side, rank 0 with a full
    checkpoint's gathering too (after its step, which it does not change): what
    test_pipeline_data_and_tensor_parallel_2_by_4_by_4_at_32_ranks checks of the step and
    test_a_full_checkpoint_under_pipeline_parallelism_sends_rank_0_one_tensor_at_a_time of the checkpoint, from one
    simulation of each rank."""
    config, plan, train = pipeline_layout(nodes=4)
    children = [simulate.start_child_process(simulate.simulate_rank, config, plan, rank, seq_len=SEQ_LEN,
                                             optimizer_spec="AdamW", train=train, why=why, checkpoint=rank == 0)
                for rank, why in simulate.simulated_ranks(plan)]
    return config, plan, [finish(child) for child, finish in children]


@pytest.mark.slow
def test_pipeline_data_and_tensor_parallel_2_by_4_by_4_at_32_ranks(pipeline_at_32_ranks):
    _, _, reports = pipeline_at_32_ranks
    assert [report.coordinates["pp"] for report in reports] == [0, 1, 1]
    assert_estimates_hold(reports)
    for report in reports:  # the stage boundary: each micro-batch's activations one way, their gradients back
        pp = report.step["pp"]
        assert {"send", "recv_"} <= set(pp) <= {"send", "recv_", "allreduce_"}
        assert pp["allreduce_"].largest <= 8  # the gradient norm's square, summed over the stages


@pytest.mark.slow
def test_an_8b_model_at_64_ranks_with_tensor_parallel_8():
    config, plan, train = layout("llama-3-8b", nodes=8, tp=8)
    assert_estimates_hold(run(config, plan, train, ranks=[(0, "rank 0")]))


@pytest.mark.slow
def test_a_70b_model_at_512_ranks_over_pipeline_data_and_tensor_parallel():
    config, plan, train = layout("llama-3-70b", nodes=64, tp=8, pp=8, accumulation=8)
    assert plan.data_parallel_size == 8
    reports = run(config, plan, train, ranks=[(0, "rank 0"), (448, "last pipeline stage")])
    assert_estimates_hold(reports)


@pytest.mark.slow
def test_a_full_checkpoint_under_pipeline_parallelism_sends_rank_0_one_tensor_at_a_time(pipeline_at_32_ranks):
    """save (a full step checkpoint), final/ and a full resume gather the same way; rank 0's bytes must not grow with
    the world, and no collective may carry more than the model's largest tensor (or its optimizer state's)."""
    received = {}
    for nodes in (4, 8):
        if nodes == 4:  # the step test's simulation of rank 0 (its checkpoint's gathering does not see the step)
            config, plan, reports = pipeline_at_32_ranks
            [report] = [report for report in reports if report.rank == 0]
        else:
            config, plan, train = pipeline_layout(nodes=nodes)
            [report] = run(config, plan, train, ranks=[(0, "rank 0")], checkpoint=True)
        assert report.checkpoint and not report.growing, report.growing
        collectives = [found for ops in report.checkpoint.values() for found in ops.values()]
        largest_tensor = 4 * config.padded_vocab_size * config.n_embd  # the embedding, fp32
        assert max(found.largest for found in collectives) <= largest_tensor
        received[plan.world_size] = sum(found.bytes for found in collectives)
    assert received[32] == received[64] > 0, received


REFUSED = [
    (["--strategy", "deepspeed_stage_3"], "--dry_run.simulate runs torch's own data parallelism"),
    (["--model_name", "moe-debug"], "--dry_run.simulate cannot run a mixture of experts (moe-debug)"),
]
"""Flags the simulation cannot run (after the model, llama-debug unless they name one), and what the one line
refusing them says."""


@pytest.fixture(scope="module")
def command_lines(tmp_path_factory):
    """`python -m llmtrain pretrain ... --dry_run.simulate true`: the simulated usage line and each of REFUSED, as
    command lines of their own, forked from one interpreter (tests/helpers/forked_cli): (result, out_dir) of each."""
    root = tmp_path_factory.mktemp("simulate_cli")
    argvs = [["pretrain", "llama-debug", "--devices", "4", "--num_nodes", "2", "--dry_run.simulate", "true",
              "--dry_run.gpu", "H100", "--train.micro_batch_size", "2", "--train.global_batch_size", "16",
              "--train.max_seq_length", "256", "--out_dir", str(root / "out" / "0")]]
    argvs += [["pretrain", *([] if "--model_name" in flags else ["llama-debug"]), "--devices", "2",
               "--dry_run.simulate", "true", "--out_dir", str(root / "out" / str(index)), *flags]
              for index, (flags, _) in enumerate(REFUSED, start=1)]
    done = run_forked(argvs, root / "logs", dict(os.environ), timeout_s=900)  # a hang guard
    return [(result, root / "out" / str(index)) for index, result in enumerate(done)]


def test_the_cli_prints_measured_memory_and_communication_beside_the_estimate(command_lines):
    done, out_dir = command_lines[0]
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "simulated    2 rank(s) of 8" in out
    assert "rank 0 " in out and "first rank of node 1" in out
    assert out.count("memory     measured") == 2 and out.count("step comm  dp_shard") == 2
    assert not out_dir.exists()


@pytest.mark.parametrize("index, flags, message", [(index, flags, message)
                                                   for index, (flags, message) in enumerate(REFUSED, start=1)])
def test_what_the_simulation_cannot_run_is_refused_in_one_line(command_lines, index, flags, message):
    done, out_dir = command_lines[index]
    assert done.args[-len(flags):] == flags
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
