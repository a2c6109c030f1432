"""Launchers users already have: `accelerate launch` and the `deepspeed` launcher start llmtrain as torchrun does.

The real launchers (the `accelerate` and `deepspeed` packages) start a tiny pretraining run that must log the very
losses of `--devices 2`; the environments they set, and mpirun's, are also read without processes through
:func:`plan_launch`. Each multi-process test has its own free port, gloo on loopback and a hard timeout.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LAUNCHER_PREFIXES, LAUNCHER_VARS, free_port_number, write_tiny_model
from forked_cli import run_forked

from llmtrain.cli import _drop_launcher_local_rank
from llmtrain.distributed.launch import is_first_process, plan_launch, resolve_devices

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
DEEPSPEED = [sys.executable, "-m", "deepspeed.launcher.runner"]
# NOTE: a hang guard, not a speed check: a 2-process run takes 10-30 s alone, and several times that beside other work.
HARD_TIMEOUT_S = 600

# A few steps of a 2-layer model: 2 ranks × micro batch 2 × 2 accumulation steps = global batch 8.
TRAIN_FLAGS = ["--data", "BuiltinStories", "--data.num_documents", "200", "--data.num_val_documents", "20",
               "--train.global_batch_size", "8", "--train.micro_batch_size", "2", "--train.max_seq_length", "32",
               "--train.lr_warmup_steps", "1", "--train.log_interval", "1", "--train.max_steps", "3",
               "--eval.interval", "100", "--eval.max_iters", "1", "--optimizer", "AdamW", "--optimizer.lr", "0.003",
               "--accelerator", "cpu"]


def launcher_env(tmp: Path) -> dict[str, str]:
    """No launcher variables of the shell; gloo on loopback, one thread per process, and no accelerate config
    file of the user's (HF_HOME), which could switch its launcher to another mode."""
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCHER_VARS and not name.startswith((*LAUNCHER_PREFIXES, "ACCELERATE_"))}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HOME=str(tmp / "hf_home"),
               LLMTRAIN_CACHE_DIR=str(tmp / "cache"))
    return env


def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    # A session of its own, so a hung run can be killed with every process it started.
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HARD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{command} did not finish in {HARD_TIMEOUT_S}s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def pretrain_args(tmp: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["pretrain", "--model_config", str(tmp / "tiny.yaml"), "--out_dir", str(out_dir), *TRAIN_FLAGS, *extra]


def losses(out_dir: Path) -> dict[int, float]:
    with open(out_dir / "metrics.csv") as handle:
        return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(handle) if row["loss"]}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the module: the tiny model, the data cache, and the `--devices 2` reference run."""
    tmp = tmp_path_factory.mktemp("launchers")
    write_tiny_model(tmp / "tiny.yaml")
    return tmp


@pytest.fixture(scope="module")
def devices_2_losses(shared: Path) -> dict[int, float]:
    """The losses of the run every launcher must repeat: llmtrain spawning its 2 workers itself."""
    result = run([sys.executable, "-m", "llmtrain", *pretrain_args(shared, shared / "devices2", "--devices", "2")],
                 launcher_env(shared))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = losses(shared / "devices2")
    assert sorted(found) == [1, 2, 3]
    return found


# --------------------------------------------------------------------------------------------------
# accelerate launch


@pytest.mark.multiproc
def test_accelerate_launch_multi_gpu_starts_the_ranks_and_matches_devices_2(shared, devices_2_losses, tmp_path):
    """`--multi_gpu` runs torchrun's agent inside accelerate (on CPUs too), and llmtrain trains in its ranks."""
    out_dir = tmp_path / "accelerate"
    result = run([*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
                  "no", "--dynamo_backend", "no", "--main_process_port", str(free_port_number()),
                  "-m", "llmtrain", *pretrain_args(shared, out_dir, "--devices", "2")], launcher_env(shared))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "world 2" in result.stdout
    assert losses(out_dir) == devices_2_losses


@pytest.mark.multiproc
def test_accelerate_launch_on_two_machines(tmp_path):
    """The tutorial's two-machine form, both "machines" here: one process each, ranks by --machine_rank."""
    port, env = free_port_number(), launcher_env(tmp_path)
    machines = [subprocess.Popen(
        [*ACCELERATE, "--multi_gpu", "--num_machines", "2", "--machine_rank", str(machine), "--main_process_ip",
         "127.0.0.1", "--main_process_port", str(port), "--num_processes", "2", "--mixed_precision", "no",
         "--dynamo_backend", "no", "-m", "llmtrain.distributed._selftest", "--devices", "1", "--num_nodes", "2",
         "--out", str(tmp_path / "out")], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True) for machine in (0, 1)]
    outputs = []
    try:
        outputs = [machine.communicate(timeout=HARD_TIMEOUT_S)[0] for machine in machines]
    finally:
        for machine in machines:
            if machine.poll() is None:
                os.killpg(machine.pid, signal.SIGKILL)
    assert all(machine.returncode == 0 for machine in machines), "\n".join(out[-3000:] for out in outputs)
    found = [json.loads((tmp_path / "out" / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["world_size"], r["local_rank"], r["local_world_size"], r["rank_sum"]) for r in found] == \
        [(2, 0, 1, 1.0)] * 2
    assert found[0]["ppid"] == machines[0].pid and found[1]["ppid"] == machines[1].pid  # no second-level spawn


@pytest.mark.multiproc
def test_accelerate_launch_cpu_is_one_process_that_spawns_devices(shared, devices_2_losses, tmp_path):
    """`--cpu --num_processes 2` starts one process (its CPU ranks would come from mpirun); with `--devices 2`
    llmtrain spawns the two workers there, the run of `--devices 2`."""
    out_dir = tmp_path / "accelerate_cpu"
    result = run([*ACCELERATE, "--cpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                  "--dynamo_backend", "no", "-m", "llmtrain", *pretrain_args(shared, out_dir, "--devices", "2")],
                 launcher_env(shared))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert losses(out_dir) == devices_2_losses


@pytest.mark.multiproc
def test_accelerate_launch_cpu_with_one_device_is_refused(shared, tmp_path):
    """Asked for 2 processes, accelerate's CPU launcher starts one; with --devices 1 it would train alone."""
    result = run([*ACCELERATE, "--cpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                  "--dynamo_backend", "no", "-m", "llmtrain",
                  *pretrain_args(shared, tmp_path / "alone", "--devices", "1")], launcher_env(shared))
    assert result.returncode != 0
    assert "error: --devices 1, but `accelerate launch` was asked for several processes" in result.stderr
    assert "Traceback" not in result.stderr.split("error: --devices 1")[0]  # llmtrain's own line, no traceback
    assert not (tmp_path / "alone" / "metrics.csv").exists()


# --------------------------------------------------------------------------------------------------
# The deepspeed launcher


@pytest.mark.multiproc
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="the deepspeed package is not installed (pip install -c constraints.txt -e '.[deepspeed]')")
def test_deepspeed_launcher_matches_devices_2(shared, devices_2_losses, tmp_path):
    """`deepspeed --num_gpus 2` (no hostfile: this machine) starts both ranks with torchrun's RANK, WORLD_SIZE and
    LOCAL_RANK and puts `--local_rank=N` before llmtrain's arguments, which llmtrain accepts."""
    out_dir = tmp_path / "deepspeed"
    result = run([*DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port_number()), "--module", "llmtrain",
                  *pretrain_args(shared, out_dir, "--devices", "2")], launcher_env(shared))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "--local_rank=1" in result.stdout + result.stderr  # the launcher's log of the command it ran
    assert losses(out_dir) == devices_2_losses


def test_local_rank_from_a_launcher_is_dropped_when_it_agrees(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _drop_launcher_local_rank(["--local_rank=1", "pretrain", "--devices", "2"]) == ["pretrain", "--devices", "2"]
    assert _drop_launcher_local_rank(["--local-rank", "1", "pretrain"]) == ["pretrain"]
    with pytest.raises(ValueError, match=r"--local_rank 0 disagrees with LOCAL_RANK=1 from the launcher"):
        _drop_launcher_local_rank(["--local_rank=0", "pretrain"])
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(ValueError, match="--local_rank 0 came without the LOCAL_RANK variable"):
        _drop_launcher_local_rank(["--local_rank=0", "pretrain"])


def test_local_rank_that_disagrees_exits_2_with_one_line(tmp_path, shared):
    env = {**launcher_env(tmp_path), "LOCAL_RANK": "0"}
    [result] = run_forked([["--local_rank=1", *pretrain_args(shared, tmp_path / "o")]], tmp_path / "forked", env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: --local_rank 1 disagrees with LOCAL_RANK=0"), result.stderr
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------------------------------
# The launchers' environments, read without processes


def deepspeed_env(rank: int, local_rank: int, node: int) -> dict[str, str]:
    """What `deepspeed --hostfile` (pdsh) sets on each rank of 2 nodes × 2 processes."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "4", "LOCAL_SIZE": "2",
            "CROSS_RANK": str(node), "CROSS_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


def test_deepspeed_launcher_names_become_torchruns():
    plan = plan_launch(2, 2, deepspeed_env(rank=3, local_rank=1, node=1))
    assert plan.mode == "env" and plan.node_rank == 1
    assert plan.rank_env == {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}  # what Runtime and the mesh read
    assert resolve_devices("auto", 2, "cpu", deepspeed_env(rank=0, local_rank=0, node=0)) == (
        2, "the processes the launcher started on this node")
    with pytest.raises(ValueError, match=r"launcher started 4 \(2 per node\).*--devices 2 --num_nodes 2"):
        plan_launch(4, 1, deepspeed_env(rank=0, local_rank=0, node=0))


@pytest.mark.parametrize("size_var", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"])
def test_mpirun_alone_is_refused(size_var):
    """`accelerate launch --cpu --mpirun_hostfile` and `deepspeed --launcher openmpi` give each rank only MPI's
    variables: every process would train alone."""
    with pytest.raises(ValueError, match=rf"mpirun started this process as one of 2 \({size_var}\)"):
        plan_launch(2, 1, {size_var: "2", "MASTER_ADDR": "127.0.0.1"})
    assert plan_launch(1, 1, {size_var: "1"}).mode == "single"  # mpirun -n 1: one process, nothing to read
    rank_var = size_var.replace("SIZE", "RANK")
    assert [is_first_process({size_var: "2", rank_var: rank}) for rank in "01"] == [True, False]  # says it once


def test_accelerate_one_process_launcher():
    env = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert plan_launch(2, 1, env).mode == "local_spawn"
    with pytest.raises(ValueError, match=r"--num_nodes 2: `accelerate launch` without --multi_gpu.*--num_machines 2 "
                                         r"--machine_rank <0..1>.*--num_processes 4"):
        plan_launch(2, 2, env)
    # One process asked of accelerate (no MASTER_ADDR): llmtrain's single process, as without it.
    assert plan_launch(1, 1, {"ACCELERATE_USE_CPU": "True"}).mode == "single"
