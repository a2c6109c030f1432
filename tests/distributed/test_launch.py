"""Launching, for real: gloo processes started plainly, by torchrun, and as simulated SLURM tasks.

Every process runs ``llmtrain.distributed._selftest``, whose ranks all-reduce their ranks and write
``rank-<r>.json``. Each test has a hard timeout, its own free port and gloo on loopback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmtrain.distributed import supervise
from llmtrain.distributed.launch import launch, plan_launch
from llmtrain.distributed.slurm import expand_hostlist, parse_tasks_per_node, slurm_master_port

REPO = Path(__file__).resolve().parents[2]
SELFTEST = [sys.executable, "-m", "llmtrain.distributed._selftest"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# NOTE: a hang guard, not a speed check: a launch takes 3-10 s alone, and several times that beside other work.
HARD_TIMEOUT_S = 300


def start(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    # A session of its own, so a hung test can kill the process with every worker it spawned.
    return subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=HARD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not finish in {HARD_TIMEOUT_S}s\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err


def run(command: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    return finish(start(command, env))


def records(out_dir: Path) -> list[dict]:
    return sorted((json.loads(path.read_text()) for path in out_dir.glob("rank-*.json")), key=lambda r: r["rank"])


def slurm_env(base: dict[str, str], *, procid: int, ntasks: int, nnodes: int, tasks_per_node: str,
              port: int, nodeid: int = 0, localid: int = 0, nodelist: str = "localhost") -> dict[str, str]:
    return {**base, "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
            "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid), "SLURM_NTASKS": str(ntasks),
            "SLURM_NNODES": str(nnodes), "SLURM_TASKS_PER_NODE": tasks_per_node,
            "SLURM_JOB_NODELIST": nodelist, "MASTER_PORT": str(port)}


def assert_world(out_dir: Path, world_size: int) -> list[dict]:
    found = records(out_dir)
    assert [r["rank"] for r in found] == list(range(world_size))
    assert {r["world_size"] for r in found} == {world_size}
    assert {r["rank_sum"] for r in found} == {float(sum(range(world_size)))}
    return found


# --------------------------------------------------------------------------------------------------
# Plain process and torchrun


def test_plain_process_spawns_devices_and_only_rank0_prints(tmp_path, dist_env):
    proc = start([*SELFTEST, "--devices", "2", "--out", str(tmp_path)], dist_env)
    code, out, err = finish(proc)
    assert code == 0, err
    found = assert_world(tmp_path, 2)
    assert {r["ppid"] for r in found} == {proc.pid}  # workers are children of the launching process
    assert "rank 0 of 2 ok" in out and "rank 1 of 2" not in out


def test_torchrun_ranks_run_in_place(tmp_path, dist_env, free_port):
    proc = start([*TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                  str(free_port()), "-m", "llmtrain.distributed._selftest", "--devices", "2", "--out",
                  str(tmp_path)], dist_env)
    code, out, err = finish(proc)
    assert code == 0, err
    found = assert_world(tmp_path, 2)
    assert {r["ppid"] for r in found} == {proc.pid}  # torchrun's own workers, no second-level spawn
    assert "rank 1 of 2" not in out


def test_two_torchrun_nodes_on_one_machine(tmp_path, dist_env, free_port):
    port = free_port()
    nodes = [start([*TORCHRUN, "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2",
                    "--master_addr", "127.0.0.1", "--master_port", str(port), "-m",
                    "llmtrain.distributed._selftest", "--devices", "2", "--num_nodes", "2", "--out",
                    str(tmp_path)], dist_env) for node in (0, 1)]
    for node in nodes:
        code, _, err = finish(node)
        assert code == 0, err
    found = assert_world(tmp_path, 4)
    assert [r["local_rank"] for r in found] == [0, 1, 0, 1]
    assert {r["local_world_size"] for r in found} == {2}


# --------------------------------------------------------------------------------------------------
# SLURM, simulated through its variables


def test_slurm_one_task_per_device(tmp_path, dist_env, free_port):
    port = free_port()
    tasks = [start([*SELFTEST, "--devices", "2", "--out", str(tmp_path)],
                   slurm_env(dist_env, procid=task, localid=task, ntasks=2, nnodes=1, tasks_per_node="2", port=port))
             for task in (0, 1)]
    for task in tasks:
        code, _, err = finish(task)
        assert code == 0, err
    found = assert_world(tmp_path, 2)
    assert [r["pid"] for r in found] == [task.pid for task in tasks]  # each task is its rank
    assert [r["local_rank"] for r in found] == [0, 1]


def test_slurm_one_task_per_node_spawns_devices(tmp_path, dist_env, free_port):
    task = start([*SELFTEST, "--devices", "2", "--out", str(tmp_path)],
                 slurm_env(dist_env, procid=0, ntasks=1, nnodes=1, tasks_per_node="1", port=free_port()))
    code, _, err = finish(task)
    assert code == 0, err
    found = assert_world(tmp_path, 2)
    assert {r["ppid"] for r in found} == {task.pid}


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
    ("a1,b2", ["a1", "b2"]),
    ("gpu-[01-02]", ["gpu-01", "gpu-02"]),
    ("n[8-10],login", ["n8", "n9", "n10", "login"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
])
def test_expand_hostlist(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts


def test_expand_hostlist_rejects_garbage():
    with pytest.raises(ValueError, match="node list"):
        expand_hostlist("node[1-")


def test_slurm_helpers():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    port = slurm_master_port("123456", "0")
    assert port == slurm_master_port("123456", "0") and 10000 <= port < 30000
    assert port != slurm_master_port("123456", "1")


def test_slurm_plans_without_processes():
    base = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1", "SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)",
            "SLURM_JOB_NODELIST": "gpu-[07-08]"}
    plan = plan_launch(4, 2, base)
    assert plan.mode == "slurm_task_per_device" and plan.master_addr == "gpu-07"
    assert plan.rank_env["RANK"] == "5" and plan.rank_env["WORLD_SIZE"] == "8" and plan.rank_env["LOCAL_RANK"] == "1"
    per_node = plan_launch(4, 2, {**base, "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "1(x2)"})
    assert per_node.mode == "slurm_task_per_node" and per_node.node_rank == 1
    with pytest.raises(ValueError, match="--num_nodes 3, but SLURM runs this step on 2 node"):
        plan_launch(4, 3, base)
    with pytest.raises(ValueError, match="uneven"):
        plan_launch(4, 2, {**base, "SLURM_TASKS_PER_NODE": "5,3"})


def test_slurm_ranks_are_consecutive_on_a_node_whatever_the_distribution():
    """`srun --distribution cyclic` deals tasks 0, 2 to the first node and 1, 3 to the second (SLURM_PROCID);
    the ranks follow the nodes, as torchrun numbers them, so that tensor-parallel groups and HYBRID_SHARD's
    shards stay within a node."""
    cyclic = [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]  # (SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID) of each task
    base = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_NNODES": "2",
            "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_DISTRIBUTION": "cyclic"}
    ranks = {}
    for procid, nodeid, localid in cyclic:
        plan = plan_launch(2, 2, {**base, "SLURM_PROCID": str(procid), "SLURM_NODEID": str(nodeid),
                                  "SLURM_LOCALID": str(localid)})
        ranks[int(plan.rank_env["RANK"])] = (nodeid, int(plan.rank_env["LOCAL_RANK"]))
    assert ranks == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}


@pytest.mark.parametrize("template, recipe", [("pretrain", []), ("finetune", ["ckpt/model"])])
def test_sbatch_templates_keep_the_allocation_and_resume_over_a_saved_config(tmp_path, dist_env, template, recipe):
    """A saved --print_config holds devices, num_nodes and resume: false. Given to the template (as the README and
    the pretraining tutorial do), it must not undo the --devices, --num_nodes and --resume auto the template fills
    in: the run would stop on a node count, or its requeued job refuse the out_dir its checkpoints are in."""
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"  # runs the command of the one task, without srun's own options
    srun.write_text('#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    (tmp_path / "saved.yaml").write_text("devices: auto\nnum_nodes: 1\nresume: false\n")
    env = {**dist_env, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{dist_env['PATH']}", "PYTHONPATH": str(REPO),
           "LLMTRAIN": f"{sys.executable} -m llmtrain", "SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "node[1-2]"}
    code, out, err = run(["bash", str(REPO / "scripts" / "slurm" / f"{template}.sbatch"), *recipe, "--config",
                          str(tmp_path / "saved.yaml"), "--print_config"], env)
    assert code == 0, err
    assert {"devices: 2", "num_nodes: 2", "resume: auto"} <= set(out.splitlines()), out


# --------------------------------------------------------------------------------------------------
# Errors: fast and clear


def test_torchrun_world_mismatch_is_an_error(tmp_path, dist_env, free_port):
    code, out, err = run([*TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                         "--master_port", str(free_port()), "-m", "llmtrain.distributed._selftest",
                         "--devices", "4", "--out", str(tmp_path)], dist_env)
    assert code != 0
    assert "--devices 4 × --num_nodes 1 = 4 processes, but the launcher started 2 (2 per node)" in err
    assert "torchrun --nproc_per_node 4 --nnodes 1" in err
    assert not records(tmp_path)  # failed before anything was built


def test_slurm_bad_tasks_per_node_is_an_error(tmp_path, dist_env, free_port):
    env = slurm_env(dist_env, procid=0, ntasks=3, nnodes=1, tasks_per_node="3", port=free_port())
    code, _, err = run([*SELFTEST, "--devices", "2", "--out", str(tmp_path)], env)
    assert code != 0
    assert "SLURM runs 3 tasks per node but --devices is 2" in err and "--ntasks-per-node 2" in err


def test_several_nodes_from_a_plain_process_is_an_error(tmp_path, dist_env):
    code, _, err = run([*SELFTEST, "--devices", "2", "--num_nodes", "2", "--out", str(tmp_path)], dist_env)
    assert code != 0
    assert "torchrun --nnodes 2 --nproc_per_node 2 --node_rank <0..1>" in err
    assert "-m llmtrain.distributed._selftest --devices 2 --num_nodes 2" in err and "srun" in err


def test_missing_node_fails_within_rendezvous_timeout(tmp_path, dist_env, free_port):
    # One task per node, two nodes, but only node 0 is started.
    env = slurm_env(dist_env, procid=0, ntasks=2, nnodes=2, tasks_per_node="1(x2)", port=free_port())
    code, _, err = run([*SELFTEST, "--devices", "2", "--num_nodes", "2", "--rdzv_timeout", "3",
                        "--out", str(tmp_path)], env)
    assert code != 0
    assert "node 0 of 2: the nodes did not all meet" in err and "within 3s" in err


def test_missing_task_fails_within_rendezvous_timeout(tmp_path, dist_env, free_port):
    # One task per device, a world of two, but only task 0 is started.
    env = slurm_env(dist_env, procid=0, ntasks=2, nnodes=1, tasks_per_node="2", port=free_port())
    code, _, err = run([*SELFTEST, "--devices", "2", "--rdzv_timeout", "3", "--out", str(tmp_path)], env)
    assert code != 0
    assert "rank 0 of 2: the processes did not all meet" in err and "within 3s" in err


@pytest.mark.parametrize("user_setting, seconds", [(None, "900.0"), ("120", "120.0")])
def test_a_slurm_task_per_gpu_waits_for_its_peers_as_long_as_torchrun(dist_env, free_port, user_setting, seconds):
    """srun with a task per GPU: each task imports, checks --resume auto and maps training_state.pt from a shared
    filesystem before it meets the others, so rank 0's store gives them torchrun's 900 s (60 s failed slow starts).
    A user's own $LLMTRAIN_RDZV_TIMEOUT still decides. The task reports what its ranks' meeting would wait."""
    code = ("from llmtrain.distributed import launch, runtime; launch.launch(lambda: print('meeting within', "
            "runtime.rendezvous_timeout_s(), flush=True), devices=8, num_nodes=2)")
    env = slurm_env(dist_env, procid=0, ntasks=16, nnodes=2, tasks_per_node="8(x2)", port=free_port(),
                    nodelist="gpu[01-02]")
    if user_setting is not None:
        env["LLMTRAIN_RDZV_TIMEOUT"] = user_setting
    code_, out, err = run([sys.executable, "-c", code], env)
    assert code_ == 0, err
    assert out.splitlines() == [f"meeting within {seconds}"]


def test_a_users_rendezvous_timeout_bounds_the_meeting_of_the_tasks(tmp_path, dist_env, free_port):
    # One task per device, a world of two, only task 0 started, and no --rdzv_timeout: the user's setting decides.
    env = {**slurm_env(dist_env, procid=0, ntasks=2, nnodes=1, tasks_per_node="2", port=free_port()),
           "LLMTRAIN_RDZV_TIMEOUT": "2"}
    code, _, err = run([*SELFTEST, "--devices", "2", "--out", str(tmp_path)], env)
    assert code != 0
    assert "rank 0 of 2: the processes did not all meet" in err and "within 2s" in err


def test_a_failed_task_ends_the_wait_of_the_others(tmp_path, dist_env, free_port):
    # srun without --kill-on-bad-exit leaves the other tasks running: rank 0, done, waits at the barrier before
    # the group closes for rank 1, which failed; it must stop with rank 1's error, not wait out two hours.
    port = free_port()
    tasks = [start([*SELFTEST, "--devices", "2", "--behaviour", "raise", "--out", str(tmp_path)],
                   slurm_env(dist_env, procid=task, localid=task, ntasks=2, nnodes=1, tasks_per_node="2", port=port))
             for task in (0, 1)]
    try:
        outcomes = [task.communicate(timeout=60) for task in tasks]
    except subprocess.TimeoutExpired:
        for task in tasks:
            os.killpg(task.pid, signal.SIGKILL)
        pytest.fail(f"a task still waits a minute after rank 1 failed: {[task.communicate() for task in tasks]}")
    assert [task.returncode for task in tasks] == [1, 1], outcomes
    assert ("rank 0: stopped waiting for the other ranks: rank 1 failed: RuntimeError: selftest failure raised on "
            "purpose by rank 1") in outcomes[0][1]


def test_worker_error_reaches_the_parent(tmp_path, dist_env):
    code, _, err = run([*SELFTEST, "--devices", "2", "--behaviour", "raise", "--out", str(tmp_path)], dist_env)
    assert code != 0
    assert "rank 1 of 2 failed (exit code 1): RuntimeError: selftest failure raised on purpose by rank 1" in err
    assert 'in check_rank\n    raise RuntimeError(f"selftest failure' in err  # the worker's own traceback


def test_an_input_error_a_worker_finds_is_one_line_and_exit_2(tmp_path, dist_env):
    # As a single process tells it (llmtrain.errors): a shard that one rank finds damaged is the user's to fix.
    code, _, err = run([*SELFTEST, "--devices", "2", "--behaviour", "refuse", "--out", str(tmp_path)], dist_env)
    assert code == 2, err
    assert err.strip().splitlines() == ["error: rank 1 of 2: --behaviour refuse: rank 1 refuses its input on purpose"]


def start_sleeping_workers(out_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen, list[int]]:
    proc = start([*SELFTEST, "--devices", "2", "--behaviour", "sleep", "--out", str(out_dir)], env)
    deadline = time.monotonic() + HARD_TIMEOUT_S
    while len(records(out_dir)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = [r["pid"] for r in records(out_dir)]
    if len(workers) != 2:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the workers did not start: {proc.communicate()}")
    return proc, workers


def test_usr1_reaches_the_spawned_workers(tmp_path, dist_env):
    proc, _ = start_sleeping_workers(tmp_path, dist_env)
    os.kill(proc.pid, signal.SIGUSR1)  # as srun passes it to a one-task-per-node launcher near the time limit
    code, _, err = finish(proc)
    assert code == 0, err
    assert sorted(path.name for path in tmp_path.glob("usr1-*")) == ["usr1-0", "usr1-1"]


def test_interrupt_stops_the_workers(tmp_path, dist_env):
    proc, workers = start_sleeping_workers(tmp_path, dist_env)
    os.kill(proc.pid, signal.SIGINT)  # the launcher alone, as a Ctrl-C that only it received
    code, _, err = finish(proc)
    assert code == 128 + signal.SIGINT, err
    assert "got SIGINT; stopped the workers" in err
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or "State:\tZ" in Path(f"/proc/{pid}/status").read_text()


# --------------------------------------------------------------------------------------------------
# In-process paths


def test_single_device_runs_inline(clean_launch_env):
    calls = []
    launch(calls.append, ("hello",), devices=1, num_nodes=1)
    assert calls == ["hello"]


def test_spawn_needs_a_picklable_call(clean_launch_env):
    with pytest.raises(ValueError, match="module-level function"):
        launch(lambda: None, devices=2, num_nodes=1)


def test_spawn_refuses_entrypoints_from_main(clean_launch_env, monkeypatch):
    def entrypoint() -> None: ...

    monkeypatch.setattr(entrypoint, "__module__", "__main__")
    with pytest.raises(ValueError, match="defined in the __main__ script"):
        supervise.spawn_workers(plan_launch(2, 1), entrypoint, (), {}, 5.0)


def test_the_error_file_is_whole_whenever_the_launcher_reads_it(tmp_path, monkeypatch):
    """The error record is written aside and renamed into place: torchrun reads it the moment the process ends (its
    SIGTERM may end it mid-write), and an empty or half-written file crashes torchrun's agent itself."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    error_file.write_text("")  # what a process killed mid-write by an in-place writer left behind
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert supervise.write_error_file(RuntimeError("disk full"), "Traceback: ...")
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # nothing partial left beside it
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["message"] == "RuntimeError: disk full"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "missing" / "error.json"))
    assert not supervise.write_error_file(RuntimeError("x"), "")
