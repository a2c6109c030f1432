"""The parallel plan: every bad combination of layout flags is one message and exit 2 before any worker starts,
with ``--devices 2`` and with one process; under two torchrun commands of one process each (two nodes), the mistakes
only a launcher reveals and two of the others; the design's usage line under two torchrun commands of two processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmtrain.args import FSDPArgs, TrainArgs
from llmtrain.distributed.parallel_plan import ParallelPlan

from conftest import LAUNCHER_PREFIXES, LAUNCHER_VARS, free_port_number
from forked_cli import forked_driver, forked_results, run_forked
from refusals import DEBUG, HANG_GUARD_S, assert_one_message

ROOT = Path(__file__).resolve().parents[2]

# Bad combinations on 2 devices of one node (the launching process refuses them before spawning).
BAD_ON_TWO_DEVICES = [
    (["--train.micro_batch_size", "16"], "--train.global_batch_size 16 is not divisible"),
    (["--strategy", "ddp", "--fsdp.sharding_strategy", "FULL_SHARD"], "--strategy ddp contradicts"),
    (["--fsdp.cpu_offload", "true"], "--fsdp.cpu_offload true on a CPU run (--accelerator auto, and this machine "
                                     "sees no CUDA device)"),
    (["--accelerator", "cpu", "--fsdp.cpu_offload", "true"], "--fsdp.cpu_offload true on a CPU run (--accelerator "
                                                             "cpu): offloading"),
    (["--fsdp.cpu_offload", "true", "--dry_run"], "--fsdp.cpu_offload true on a CPU run"),
    (["--strategy", "fsdp", "--fsdp.sharding_strategy", "NO_SHARD"], "--strategy fsdp contradicts"),
    (["--fsdp.sharding_strategy", "HYBRID_SHARD"], "needs --num_nodes 2 or more"),
    (["--num_nodes", "2"], "--num_nodes 2 needs a launcher on every node"),
    (["--fsdp.async_save", "true"], "--fsdp.async_save true needs --fsdp.state_dict_type sharded"),
    (["--train.global_batch_size", "4", "--train.micro_batch_size", "8"], "is smaller than"),
    (["--train.max_seq_length", "100000"], "--train.max_seq_length 100000 exceeds the block_size"),
    (["--accelerator", "cuda"], "--accelerator cuda: this machine sees no CUDA device"),
    (["--devices", "0"], "--devices 0 must be a number of processes per node (1 or more), or auto / -1"),
    (["--accelerator", "gpu"], "--accelerator gpu: this machine sees no CUDA device"),
]

# With one process these would be accepted and do nothing: refused instead.
BAD_ON_ONE_PROCESS = [
    (["--fsdp.sharding_strategy", "HYBRID_SHARD"], "--fsdp.sharding_strategy HYBRID_SHARD"),
    (["--fsdp.sharding_strategy", "FULL_SHARD"], "--fsdp.sharding_strategy FULL_SHARD needs --devices 2 or more"),
    (["--strategy", "fsdp", "--fsdp.cpu_offload", "true"], "--fsdp.cpu_offload true on a CPU run"),
    (["--fsdp.skip_gradient_sync", "false"], "--fsdp.skip_gradient_sync False needs --devices 2 or more"),
    (["--strategy", "ddp"], "--strategy ddp needs several processes"),
]

# Under torchrun each rank checks its own flags against what the launcher started. The cases share two torchrun
# agents (two nodes) of one rank each, whose rank runs every case as a command of its own (under_torchrun): a rank's
# checks read the launcher's variables (WORLD_SIZE, LOCAL_WORLD_SIZE), which two nodes of one process set as two of
# two do (the usage-line test below runs two nodes of two processes).
# The table keeps the mistakes only a launcher can reveal, plus two of the single-node table's (a batch and a model
# check) to show the per-rank checks refuse there too; the single-node table above runs the same checks
# (ParallelPlan) for every other flag.
BAD_UNDER_TORCHRUN = [
    (["--train.micro_batch_size", "16"], "--train.global_batch_size 16 is not divisible"),
    (["--train.max_seq_length", "100000"], "--train.max_seq_length 100000 exceeds the block_size"),
    (["--num_nodes", "3"], "--devices 1 × --num_nodes 3 = 3 processes, but the launcher started 2"),
    # The total is right (2), the processes per node are not: the launcher started 1 on each node.
    (["--devices", "2", "--num_nodes", "1"], "--devices 2 × --num_nodes 1 = 2 processes, but the launcher started 2 "
                                             "(1 per node)"),
    (["--devices", "auto", "--num_nodes", "3"], "--devices auto reads 1 processes per node from the launcher, but "
                                                "--num_nodes 3 × 1 is not the 2 it started in all; pass --num_nodes 2"),
]


def launch_env() -> dict[str, str]:
    """This process's environment for launched commands: no launcher variables, gloo on loopback, one thread each."""
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCHER_VARS and not name.startswith(LAUNCHER_PREFIXES)}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every single-node case's command line, each its own process (forked_cli), by table and index."""
    root = tmp_path_factory.mktemp("plan-refusals")
    cases = [(f"two-{index}", [*DEBUG, "--devices", "2", *flags]) for index, (flags, _) in enumerate(BAD_ON_TWO_DEVICES)]
    cases += [(f"one-{index}", [*DEBUG, *flags]) for index, (flags, _) in enumerate(BAD_ON_ONE_PROCESS)]
    argvs = [[*argv, "--out_dir", str(root / name / "o")] for name, argv in cases]
    done = run_forked(argvs, root / "logs", launch_env(), timeout_s=HANG_GUARD_S * 4)
    return {name: (result, root / name / "o") for (name, _), result in zip(cases, done)}


@pytest.mark.parametrize("index", range(len(BAD_ON_TWO_DEVICES)), ids=[" ".join(f) for f, _ in BAD_ON_TWO_DEVICES])
def test_bad_combination_on_two_devices_is_one_message_and_exit_2(index, refused):
    done, out_dir = refused[f"two-{index}"]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert_one_message(done.stderr, BAD_ON_TWO_DEVICES[index][1])
    assert not out_dir.exists()  # nothing started


@pytest.mark.parametrize("index", range(len(BAD_ON_ONE_PROCESS)), ids=[" ".join(f) for f, _ in BAD_ON_ONE_PROCESS])
def test_flag_that_needs_several_processes_is_refused_with_one(index, refused):
    done, out_dir = refused[f"one-{index}"]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert_one_message(done.stderr, BAD_ON_ONE_PROCESS[index][1])
    assert not out_dir.exists()


@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory) -> tuple[list[int], list[str], list[list[subprocess.CompletedProcess]], Path]:
    """Every case of BAD_UNDER_TORCHRUN under one pair of torchrun commands (two nodes of one process each): each
    node's process is a forked_cli driver, which forks one `python -m llmtrain` per case, all at once (a rank other
    than 0 waits before it exits 2), with that rank's launcher variables; once both drivers are done, each exits
    as its cases did. The nodes' exit codes and outputs, each node's results by case, and the cases' out_dir root."""
    root = tmp_path_factory.mktemp("torchrun-refusals")
    argvs = [[*DEBUG, "--devices", "1", "--num_nodes", "2", *flags, "--out_dir", str(root / "out" / str(index))]
             for index, (flags, _) in enumerate(BAD_UNDER_TORCHRUN)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port_number()), "--rdzv_conf", "timeout=60",
                "--no-python"]
    nodes = [subprocess.Popen([*torchrun, "--node_rank", str(node),
                               *forked_driver(argvs, root / f"node{node}", at_once=len(argvs), barrier=root / "done")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=launch_env())
             for node in (0, 1)]
    outputs = [node.communicate(timeout=HANG_GUARD_S)[0] for node in nodes]
    results = [forked_results(root / f"node{node}") for node in (0, 1)]
    return [node.returncode for node in nodes], outputs, results, root / "out"


@pytest.mark.multiproc
def test_torchrun_sees_the_refusing_ranks_exit_2(under_torchrun):
    """Both torchrun commands fail, each reporting its rank's exit code 2 (or -15: stopped by torchrun once the
    other node's rank had failed)."""
    returncodes, outputs, _, _ = under_torchrun
    assert all(code != 0 for code in returncodes), outputs
    exit_codes = [int(code) for output in outputs for code in re.findall(r"exitcode\s*:\s*(-?\d+)", output)]
    assert exit_codes and all(code in (2, -15) for code in exit_codes), outputs
    assert 2 in exit_codes


@pytest.mark.multiproc
@pytest.mark.parametrize("index", range(len(BAD_UNDER_TORCHRUN)), ids=[" ".join(f) for f, _ in BAD_UNDER_TORCHRUN])
def test_bad_combination_under_two_torchrun_nodes(index, under_torchrun):
    """Rank 0 prints the one message; every rank exits 2; nothing is written."""
    _, _, results, out_root = under_torchrun
    done = [node_results[index] for node_results in results]
    assert [result.returncode for result in done] == [2, 2], done
    assert_one_message("\n".join(result.stdout + result.stderr for result in done), BAD_UNDER_TORCHRUN[index][1])
    assert not (out_root / str(index)).exists()


@pytest.mark.multiproc
def test_the_designs_usage_line_with_the_alias_under_two_torchrun_commands(tmp_path, dist_env, free_port):
    """`llmtrain pretrain tiny-llama --devices 2 --num_nodes 2` with the model shrunk by --model_config.* flags (the
    zoo's other fields kept) and the zoo recipe's batch defaults; then --devices auto reads the same layout."""
    shrink = ["--model_config.n_layer", "2", "--model_config.n_embd", "64", "--model_config.n_head", "4",
              "--model_config.intermediate_size", "128", "--model_config.vocab_size", "4096"]
    small = ["--data", "BuiltinStories", "--data.num_documents", "200", "--data.num_val_documents", "20",
             "--train.max_seq_length", "32", "--train.max_steps", "1", "--train.micro_batch_size", "16",
             "--eval.max_iters", "1", "--eval.initial_validation", "false"]
    outputs = []
    for devices, out in (("2", "a"), ("auto", "b")):
        port = str(free_port())
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
                    "--master_addr", "127.0.0.1", "--master_port", port, "--rdzv_conf", "timeout=60"]
        nodes = [subprocess.Popen([*torchrun, "--node_rank", str(node), "-m", "llmtrain", "pretrain", "tiny-llama",
                                   "--devices", devices, "--num_nodes", "2", *shrink, *small,
                                   "--out_dir", str(tmp_path / out)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dist_env)
                 for node in (0, 1)]
        outputs.append("\n".join(node.communicate(timeout=HANG_GUARD_S)[0] for node in nodes))
        assert all(node.returncode == 0 for node in nodes), outputs[-1]
    for output in outputs:
        # The zoo's name, GQA and block size survive the shrinking flags; the batch comes from its recipe
        # (global 512 = 4 ranks × micro 16 × 8 steps) and precision auto is fp32 on a CPU.
        assert "pretrain: model tiny-llama-1.1b" in output, output
        assert ("fsdp, HYBRID_SHARD, mesh replicate 2 × shard 2 | world 4, micro batch 16, global batch 512, "
                "grad accumulation 8" in output), output
        assert "precision 32-true (auto: CPU" in output, output
    saved = yaml.safe_load((tmp_path / "a" / "final" / "model_config.yaml").read_text())
    assert (saved["name"], saved["n_layer"], saved["n_embd"], saved["n_query_groups"], saved["block_size"]) == (
        "tiny-llama-1.1b", 2, 64, 4, 2048)
    assert yaml.safe_load((tmp_path / "b" / "final" / "hyperparameters.yaml").read_text())["train"][
        "global_batch_size"] == 512  # the batch the run used, not "unset"


# ----------------------------------------------------------------------------- the plan itself
def plan(devices: int = 1, num_nodes: int = 1, strategy: str = "auto", **fsdp) -> ParallelPlan:
    return ParallelPlan.resolve(devices=devices, num_nodes=num_nodes, strategy=strategy, fsdp=FSDPArgs(**fsdp),
                                train=TrainArgs(global_batch_size=64, micro_batch_size=2), precision="bf16-mixed",
                                device_type="cuda")


def test_single_device_fsdp_is_real_fsdp():
    """--strategy fsdp on one device (CPU offload on a GPU) is a one-rank FSDP, not a silent no-op."""
    one = plan(strategy="fsdp", cpu_offload=True)
    assert (one.wrapper, one.sharding_strategy, one.cpu_offload, one.uses_process_group) == (
        "fsdp", "FULL_SHARD", True, True)
    assert one.mixed_precision_policy  # FSDP casts: fit() must not autocast on top


def test_cpu_offload_is_for_gpu_runs():
    """On a CPU run everything is in host memory already: the flag would do nothing, so it is refused by name (the
    command-line tables above show it refused before any worker starts, and by the dry run)."""
    with pytest.raises(ValueError, match="--fsdp.cpu_offload needs a sharded strategy"):
        plan(devices=2, strategy="ddp", cpu_offload=True)
    with pytest.raises(ValueError, match="--fsdp.cpu_offload True needs --devices 2 or more"):
        plan(cpu_offload=True)
    with pytest.raises(ValueError, match=r"--fsdp.cpu_offload true on a CPU run \(--accelerator cpu\).*Drop "
                                         "--fsdp.cpu_offload"):
        ParallelPlan.resolve(devices=2, num_nodes=1, fsdp=FSDPArgs(cpu_offload=True), accelerator="cpu",
                             train=TrainArgs(global_batch_size=64, micro_batch_size=2), precision="32-true")
    assert plan(devices=2, cpu_offload=True).cpu_offload


def test_gradient_sync_is_skipped_only_where_it_means_something():
    assert plan(devices=2).grad_sync_only_last  # FSDP with 16 accumulation steps
    assert not plan(devices=2, skip_gradient_sync=False).grad_sync_only_last
    assert not plan().grad_sync_only_last  # one process: nothing to sync


def test_mesh_dimensions_multiply_to_the_world():
    hybrid = plan(devices=8, num_nodes=4)
    assert hybrid.pp * hybrid.dp_replicate * hybrid.dp_shard * hybrid.tp == hybrid.world_size == 32
    with pytest.raises(ValueError, match="the mesh pp 1 × dp_replicate 4 × dp_shard 4 × tp 1 = 16 ranks"):
        ParallelPlan(**{**hybrid.__dict__, "dp_shard": 4}).check_mesh()
    with pytest.raises(ValueError, match="--tp_size 16 must divide --devices 8"):
        ParallelPlan(**{**hybrid.__dict__, "dp_replicate": 2, "dp_shard": 1, "tp": 16}).check_mesh()


def test_dry_run_and_memory_estimate_read_the_plan():
    from llmtrain.config import Config
    from llmtrain.plan.memory import estimate_memory

    config = Config.from_name("tiny-llama-1.1b")
    offloaded = estimate_memory(config, plan(devices=8, cpu_offload=True), seq_len=2048)
    sharded = estimate_memory(config, plan(devices=8), seq_len=2048)
    assert offloaded.optimizer == 0 < sharded.optimizer  # offload counted only where FSDP applies it
    single = estimate_memory(config, plan(), seq_len=2048)
    assert single.optimizer == 8 * sharded.optimizer


def test_hybrid_shard_keeps_a_shard_dimension_of_one_so_fsdp_replicates_across_nodes():
    # Two nodes of two processes, tensor parallel 2: one data-parallel rank per node.
    hybrid = ParallelPlan.resolve(devices=2, num_nodes=2, tp=2, train=TrainArgs(global_batch_size=8, micro_batch_size=2),
                                  precision="bf16-mixed", device_type="cuda")
    assert (hybrid.sharding_strategy, hybrid.dp_replicate, hybrid.dp_shard) == ("HYBRID_SHARD", 2, 1)
    assert hybrid.mesh_shape() == {"dp_replicate": 2, "dp_shard": 1, "tp": 2}
