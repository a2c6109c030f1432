"""SLURM end to end on a real cluster (tests/helpers/slurm_cluster.py): two fake nodes on this machine.

The cluster is installed and started when missing. Without root or apt-get the tests skip (the reason
says so); with LLMTRAIN_TEST_SLURM=1 they run regardless, and a cluster that cannot start fails them.
The jobs run the checkout under test with this interpreter (``python -m llmtrain``, PYTHONPATH = the
checkout) on the CPU over gloo on the loopback interface.
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from limits import hard_limit
from slurm_cluster import NODE_NAMES, ensure_cluster, skip_reason

SKIP_REASON = skip_reason()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))]

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN_SBATCH = ROOT / "scripts/slurm/pretrain.sbatch"
FINETUNE_SBATCH = ROOT / "scripts/slurm/finetune.sbatch"
NODELIST = "llmtrain-node[1-2]"
TEST_LIMIT_S = 1800
CLUSTER_LIMIT_S = 900
JOB_TIMEOUT_S = 600
# The templates ask for GPUs and a day; the fake nodes have 2 CPUs and no GPUs.
# The templates ask for GPUs and 12 cores a task; the fake nodes have two CPUs and no GPU. Their USR1 comes 600 s
# before the time limit, which a short test job is already within: here it comes 60 s before a 10-minute limit,
# and the tests send it themselves.
CPU_OPTIONS = ["--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10", "--signal=B:USR1@60"]

DUMP_ENV = """
import json, os, socket, sys
env = {k: v for k, v in os.environ.items() if k.startswith("SLURM")}
env["hostname"] = socket.gethostname()
name = sys.argv[2] if len(sys.argv) > 2 else "task-" + env["SLURM_PROCID"]
with open(os.path.join(sys.argv[1], name + ".json"), "w") as f:
    json.dump(env, f, indent=1, sort_keys=True)
"""

# Stands in for llmtrain: writes its arguments, then either returns or (first
# run, with FAKE_WAIT_FOR_USR1=1) waits for USR1, as llmtrain does before it checkpoints and stops.
FAKE_LLMTRAIN = """#!/bin/bash
run="$MARK_DIR/run${SLURM_RESTART_COUNT:-0}-task${SLURM_PROCID}"
printf '%s\\n' "$@" > "$run.args"
if [[ ${FAKE_WAIT_FOR_USR1:-0} == 1 && ${SLURM_RESTART_COUNT:-0} == 0 ]]; then
    trap 'touch "$run.usr1"; exit ${FAKE_USR1_EXIT:-75}' USR1
    touch "$run.ready"
    for _ in $(seq 600); do sleep 0.1; done
    exit 3
fi
"""


@pytest.fixture(autouse=True)
def per_test_limit(request):
    with hard_limit(TEST_LIMIT_S, request.node.name):
        yield


@pytest.fixture(scope="session")
def cluster():
    with hard_limit(CLUSTER_LIMIT_S, "installing and starting SLURM"):
        handle = ensure_cluster()
    yield handle
    if handle.started_here:
        handle.teardown()


def run_job(cluster, script, args=(), env=None, options=(), timeout=JOB_TIMEOUT_S):
    """Submit, wait, and insist on COMPLETED (else fail with the job's output)."""
    job_id = cluster.submit(script, args, env, options)
    state = cluster.wait(job_id, timeout)
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{cluster.output(job_id)}"
    return job_id


def env_dump_script(tmp_path):
    (tmp_path / "dump_env.py").write_text(DUMP_ENV)
    script = tmp_path / "env.sbatch"
    script.write_text(f"""#!/bin/bash
set -euo pipefail
"{sys.executable}" "{tmp_path}/dump_env.py" "{tmp_path}" batch
srun "{sys.executable}" "{tmp_path}/dump_env.py" "{tmp_path}"
""")
    return script


def read_tasks(tmp_path):
    tasks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("task-*.json"))]
    return sorted(tasks, key=lambda env: int(env["SLURM_PROCID"]))


def test_two_tasks_on_each_of_two_nodes(cluster, tmp_path):
    run_job(cluster, env_dump_script(tmp_path), options=["--nodes=2", "--ntasks-per-node=2"])
    tasks = read_tasks(tmp_path)
    assert [int(t["SLURM_PROCID"]) for t in tasks] == [0, 1, 2, 3]
    # Block distribution: ranks 0-1 on the first node, 2-3 on the second.
    assert [int(t["SLURM_NODEID"]) for t in tasks] == [0, 0, 1, 1]
    assert [int(t["SLURM_LOCALID"]) for t in tasks] == [0, 1, 0, 1]
    assert [t["SLURMD_NODENAME"] for t in tasks] == [NODE_NAMES[0]] * 2 + [NODE_NAMES[1]] * 2
    for task in tasks:
        assert task["SLURM_NTASKS"] == "4" and task["SLURM_NNODES"] == "2"
        assert task["SLURM_NTASKS_PER_NODE"] == "2" and task["SLURM_TASKS_PER_NODE"] == "2(x2)"
        assert task["SLURM_JOB_NODELIST"] == NODELIST and task["SLURM_STEP_NODELIST"] == NODELIST
        assert task["SLURM_STEP_ID"] == "0" and task["SLURM_STEP_NUM_TASKS"] == "4"
    # The batch script also carries SLURM_PROCID=0 and SLURM_NTASKS, but no step: it is not a rank.
    batch = json.loads((tmp_path / "batch.json").read_text())
    assert "SLURM_STEP_ID" not in batch and batch["SLURM_NTASKS"] == "4"


def test_one_task_per_node(cluster, tmp_path):
    run_job(cluster, env_dump_script(tmp_path), options=["--nodes=2", "--ntasks-per-node=1"])
    tasks = read_tasks(tmp_path)
    assert [(t["SLURM_PROCID"], t["SLURM_NODEID"], t["SLURM_LOCALID"]) for t in tasks] == [("0", "0", "0"),
                                                                                           ("1", "1", "0")]
    assert [t["SLURMD_NODENAME"] for t in tasks] == list(NODE_NAMES)
    for task in tasks:
        assert task["SLURM_NTASKS"] == "2" and task["SLURM_NNODES"] == "2"
        assert task["SLURM_NTASKS_PER_NODE"] == "1" and task["SLURM_TASKS_PER_NODE"] == "1(x2)"
        assert task["SLURM_JOB_NODELIST"] == NODELIST and task["SLURM_STEP_ID"] == "0"


def fake_llmtrain(tmp_path):
    fake = tmp_path / "fake-llmtrain"
    fake.write_text(FAKE_LLMTRAIN)
    fake.chmod(0o755)
    marks = tmp_path / "marks"
    marks.mkdir()
    return fake, marks


def wait_for_files(paths, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never appeared: {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.2)


@pytest.mark.parametrize("exit_code", [75, 0])
def test_pretrain_sbatch_passes_usr1_on_and_requeues_with_resume(cluster, tmp_path, exit_code):
    """The time-limit path, with a stand-in for llmtrain: USR1 reaches every task, then the job runs again, unless
    the run finished (status 0) rather than stopped to resume (75, as llmtrain does after its checkpoint)."""
    fake, marks = fake_llmtrain(tmp_path)
    env = {"LLMTRAIN": str(fake), "MARK_DIR": str(marks), "FAKE_WAIT_FOR_USR1": "1", "FAKE_USR1_EXIT": str(exit_code)}
    job_id = cluster.submit(PRETRAIN_SBATCH, ["--config", "x.yaml"], env,
                            [*CPU_OPTIONS, "--ntasks-per-node=2", f"--chdir={tmp_path}"])
    wait_for_files([marks / f"run0-task{rank}.ready" for rank in range(4)])
    # What `#SBATCH --signal=B:USR1@600` does 600 s before the time limit.
    cluster.run("scancel", "--signal=USR1", "--batch", str(job_id))
    state = cluster.wait(job_id, JOB_TIMEOUT_S)
    output = cluster.output(job_id)
    if exit_code == 0:
        assert state == "COMPLETED" and cluster.job(job_id)["Restarts"] == "0", output
        assert "not requeueing" in output and not (marks / "run1-task0.args").exists(), output
        return
    assert state == "COMPLETED", output
    assert cluster.job(job_id)["Restarts"] == "1", output
    for rank in range(4):
        assert (marks / f"run0-task{rank}.usr1").exists(), output
        args = (marks / f"run1-task{rank}.args").read_text().split()
        # A leading --config goes first: the file cannot undo the allocation's numbers or --resume auto.
        assert args == ["pretrain", "--config", "x.yaml", "--devices", "2", "--num_nodes", "2", "--resume", "auto"]
    assert "requeueing job" in output


def test_finetune_sbatch_one_task_per_node_arguments(cluster, tmp_path):
    fake, marks = fake_llmtrain(tmp_path)
    env = {"LLMTRAIN": str(fake), "MARK_DIR": str(marks), "DEVICES": "2"}
    job_id = run_job(cluster, FINETUNE_SBATCH, ["ckpt/model", "--data", "JSON"], env,
                     [*CPU_OPTIONS, "--ntasks-per-node=1", "--cpus-per-task=2", f"--chdir={tmp_path}"])
    # The node's task gets the node's cores (srun does not inherit --cpus-per-task from sbatch).
    assert "+ srun --kill-on-bad-exit=1 --cpus-per-task=2 " in cluster.output(job_id)
    for rank in range(2):
        args = (marks / f"run0-task{rank}.args").read_text().split()
        assert args == ["finetune_lora", "ckpt/model", "--devices", "2", "--num_nodes", "2", "--resume", "auto",
                        "--data", "JSON"]
    assert not (marks / "run0-task2.args").exists()


def test_finetune_sbatch_checkpoint_dir_wins_over_a_recipes(cluster, tmp_path, capsys):
    """`finetune.sbatch CHECKPOINT_DIR --config RECIPE`, as the SLURM README allows: every recipe in config_hub/finetune
    names a checkpoint_dir, and the one on the command line is the model to fine-tune, not the recipe's."""
    from llmtrain.cli import main

    fake, marks = fake_llmtrain(tmp_path)
    env = {"LLMTRAIN": str(fake), "MARK_DIR": str(marks), "DEVICES": "2"}
    recipe = ROOT / "config_hub/finetune/debug/lora.yaml"
    run_job(cluster, FINETUNE_SBATCH, ["ckpt/model", "--config", str(recipe), "--train.max_steps", "3"], env,
            [*CPU_OPTIONS, "--ntasks-per-node=1", "--cpus-per-task=2", f"--chdir={tmp_path}"])
    args = (marks / "run0-task0.args").read_text().split()
    assert args[0] == "finetune_lora" and args[-2:] == ["--train.max_steps", "3"]
    with pytest.raises(SystemExit):
        main([*args, "--print_config"])
    printed = capsys.readouterr().out
    assert re.search(r"^checkpoint_dir: ckpt/model$", printed, re.M) and re.search(r"^devices: 2$", printed, re.M), \
        printed


def read_losses(out_dir):
    with open(Path(out_dir) / "metrics.csv") as handle:
        return {int(row["step"]): row["loss"] for row in csv.DictReader(handle) if row["loss"]}


def test_pretrain_sbatch_preempted_by_usr1_checkpoints_requeues_and_resumes(cluster, tmp_path):
    """The project's sbatch script trains the debug recipe (shrunk) on 2 nodes x 2 devices in both layouts,
    and the real time-limit path. The uninterrupted job runs a task per device; the preempted one runs a
    task per node, whose launcher spawns the node's two workers. USR1 to the batch script (what
    `--signal=B:USR1@600` sends) reaches the ranks through srun and the launchers; they checkpoint and exit
    75, the script requeues the job, the next run continues through --resume auto, and every loss equals
    the uninterrupted job's."""
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {"LLMTRAIN": f"{sys.executable} -m llmtrain", "PYTHONPATH": python_path,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "LLMTRAIN_CACHE_DIR": str(tmp_path / "cache"), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    task_per_node = [*CPU_OPTIONS, "--ntasks-per-node=1", "--cpus-per-task=2", f"--chdir={tmp_path}"]
    task_per_device = [*CPU_OPTIONS, "--ntasks-per-node=2", f"--chdir={tmp_path}"]

    def arguments(out_dir):
        return ["--config", str(ROOT / "config_hub/pretrain/debug.yaml"), "--out_dir", str(out_dir),
                "--train.max_steps", "12", "--train.save_interval", "4", "--train.log_interval", "1",
                "--train.global_batch_size", "8", "--train.micro_batch_size", "2", "--train.max_seq_length", "64",
                "--train.lr_warmup_steps", "1", "--eval.max_iters", "2", "--accelerator", "cpu", "--devices", "2",
                "--num_nodes", "2", "--data.max_bytes", "2000000"]

    uninterrupted = tmp_path / "uninterrupted"
    job_id = run_job(cluster, PRETRAIN_SBATCH, arguments(uninterrupted), env, task_per_device)
    assert "world 4," in cluster.output(job_id)  # one run of four ranks, not four single-process runs
    assert (uninterrupted / "final" / "model.safetensors").is_file()
    assert (uninterrupted / "final" / "model_config.yaml").is_file()

    preempted = tmp_path / "preempted"
    job_id = cluster.submit(PRETRAIN_SBATCH, arguments(preempted), env, task_per_node)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while "\nstep 2 |" not in cluster.output(job_id):
        assert time.monotonic() < deadline, cluster.output(job_id)
        time.sleep(0.2)
    cluster.run("scancel", "--signal=USR1", "--batch", str(job_id))
    state = cluster.wait(job_id, JOB_TIMEOUT_S)
    output = cluster.output(job_id)
    assert state == "COMPLETED" and cluster.job(job_id)["Restarts"] == "1", output
    assert "world 4," in output  # each node's launcher spawned 2 workers and passed USR1 on to them
    stopped = re.search(r"stopping after step (\d+): got SIGUSR1", output)
    assert stopped and "llmtrain ended with status 75; requeueing job" in output, output
    step = int(stopped.group(1))
    assert 2 < step < 12
    assert f"resumed from {preempted / f'step-{step:08d}'} at step {step}" in output
    assert (preempted / "final" / "model.safetensors").is_file()
    assert (preempted / "final" / "model_config.yaml").is_file()
    assert read_losses(preempted) == read_losses(uninterrupted)
    assert sorted(read_losses(preempted)) == list(range(1, 13))
