"""Start the processes of a run: one command on a laptop, under torchrun and under SLURM's srun.

``launch(fn, args, kwargs, devices=N, num_nodes=M)`` reads the environment and takes one of five paths
(:func:`plan_launch` decides, without side effects):

- ``single``: a plain process and one device; ``fn`` runs here and ``launch`` returns.
- ``env``: torchrun (or any launcher that sets RANK, WORLD_SIZE and LOCAL_RANK: ``accelerate launch
  --multi_gpu``, which runs torchrun, and the ``deepspeed`` launcher) made this process one rank; ``fn`` runs here.
- ``slurm_task_per_device``: srun started one task per device; the SLURM variables become
  torchrun's and ``fn`` runs here.
- ``slurm_task_per_node``: srun started one task per node; it spawns ``devices`` workers with torch's
  elastic launcher, and the nodes meet at the first host of the SLURM node list.
- ``local_spawn``: a plain process and several devices; the elastic launcher spawns them here. ``accelerate
  launch --cpu --num_processes N`` starts one such process (its other CPU processes would come from mpirun).

mpirun's own variables (Open MPI's, PMI's) are refused rather than read: a process that only they describe
would otherwise train alone, as if it were the whole job.

Every rank runs ``fn`` inside :func:`run_as_worker`, which tears the process group down and ends the
process itself, so ``launch`` returns only in the ``single`` and spawning paths. Spawned workers are
fresh interpreters that unpickle ``fn`` and its arguments: both must be picklable by reference
(module-level functions, plain data), not lambdas, open files or built models.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Mapping, NoReturn, Optional

from llmtrain.distributed.parallel_plan import global_rank
from llmtrain.distributed.runtime import (RDZV_TIMEOUT_ENV, host_barrier, leave_in_order, ranks_that_never_arrived,
                                         rendezvous_timeout_s, report_failure)
from llmtrain.errors import debugging, told_status
from llmtrain.train.signals import PREEMPTED_EXIT_CODE

LaunchMode = Literal["single", "env", "slurm_task_per_device", "slurm_task_per_node", "local_spawn"]

ALL_RANKS_PRINT_ENV = "LLMTRAIN_ALL_RANKS_PRINT"
"""Set to 1 to let every rank write to stdout; by default only rank 0 does (stderr stays open on all)."""

_SPAWNED_ENV = "LLMTRAIN_SPAWNED"  # marks workers started by this module: their launcher reports their errors
_TOLD_KEY = "llmtrain_told"  # in a worker's error file: the exit status of an error told in one line, or null
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# The deepspeed launcher sets torchrun's three, but names the processes of a node and the node's rank its own way.
_DEEPSPEED_NAMES = {"LOCAL_WORLD_SIZE": "LOCAL_SIZE", "GROUP_RANK": "CROSS_RANK"}
# How mpirun tells a process the size of its job: Open MPI, PMI (MPICH, Intel MPI), MVAPICH.
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")

# The first lines a spawned worker runs: take the parent's import path, then load and run the call.
_WORKER_BOOT = ("import json, sys; sys.path[:0] = json.load(open(sys.argv[1])); "
                "from llmtrain.distributed.launch import _worker_main; _worker_main(sys.argv[2])")

_in_worker = False  # True inside run_as_worker: a nested launch() just calls its entrypoint

# NOTE: elastic turns these signals into "stop the workers" (killing them after 30 s). SIGTERM is left
# out: _forward_signals_to_workers passes it on, so the workers can checkpoint and exit with 75.
_ELASTIC_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


class WorkerFailedError(RuntimeError):
    """A spawned worker failed; the message names the first rank that failed and its error."""

    def __init__(self, message: str, exit_status: int = 1) -> None:
        super().__init__(message)
        self.exit_status = exit_status
        """That rank's exit status: 2 for an input error it found (llmtrain.errors), else 1."""


@dataclass(frozen=True)
class LaunchPlan:
    """How this process takes part in a run of ``devices × num_nodes`` processes."""

    mode: LaunchMode
    devices: int
    num_nodes: int
    node_rank: int = 0
    """This node's rank among ``num_nodes`` (spawning paths)."""
    master_addr: str = "127.0.0.1"
    """Where the nodes (or ranks) meet."""
    master_port: Optional[int] = None
    """The port of that meeting; None picks a free one when spawning on one machine."""
    run_id: str = ""
    """The elastic launcher's run id (spawning paths)."""
    rank_env: dict[str, str] = field(default_factory=dict)
    """torchrun-style variables this process sets before it runs as a rank (one SLURM task per device)."""

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


def launch(entrypoint: Callable[..., None], args: tuple = (), kwargs: Optional[dict] = None, *,
           devices: int, num_nodes: int, rdzv_timeout_s: Optional[float] = None) -> None:
    """Run ``entrypoint(*args, **kwargs)`` once on each of ``devices × num_nodes`` processes.

    Args:
        entrypoint: The work of one rank. It builds ``Runtime.from_env()`` to learn who it is. It must
            be importable by name (not defined in ``__main__``) when workers are spawned.
        args: Positional arguments; pickled when workers are spawned.
        kwargs: Keyword arguments; pickled when workers are spawned.
        devices: Processes per node.
        num_nodes: Nodes.
        rdzv_timeout_s: How long processes wait for each other to meet, both the nodes' meeting in the
            elastic launcher and the ranks' meeting in ``Runtime.from_env``. A missing node then fails
            the run in this many seconds instead of hanging. Default: ``$LLMTRAIN_RDZV_TIMEOUT`` if the
            user set it, else 900 s as torchrun waits (:data:`~llmtrain.distributed.runtime.RDZV_TIMEOUT_S`).

    Raises ValueError (before anything starts) when the flags disagree with the environment, and
    WorkerFailedError when a spawned worker fails; its traceback is printed to stderr first.
    """
    kwargs = dict(kwargs or {})
    if _in_worker:
        entrypoint(*args, **kwargs)
        return
    try:
        plan = plan_launch(devices, num_nodes)
    except ValueError as exc:
        _write_error_file(exc, traceback.format_exc())  # under torchrun, its summary then shows the reason
        raise
    if plan.mode == "single":
        entrypoint(*args, **kwargs)
        return
    if rdzv_timeout_s is None:
        rdzv_timeout_s = rendezvous_timeout_s()
    if plan.mode in ("env", "slurm_task_per_device"):
        os.environ.update(plan.rank_env)
        os.environ[RDZV_TIMEOUT_ENV] = str(rdzv_timeout_s)
        run_as_worker(entrypoint, args, kwargs)
    spawn_workers(plan, entrypoint, args, kwargs, rdzv_timeout_s)


# --------------------------------------------------------------------------------------------------
# Deciding the path


def _under_torchrun(env: Mapping[str, str]) -> bool:
    """torchrun (or a launcher that sets its variables) started this process as one rank."""
    return "TORCHELASTIC_RUN_ID" in env or all(name in env for name in _TORCHRUN_VARS)


def _with_torchrun_names(env: Mapping[str, str]) -> dict[str, str]:
    """The deepspeed launcher's LOCAL_SIZE and CROSS_RANK under torchrun's names, where torchrun's are missing."""
    return {ours: env[theirs] for ours, theirs in _DEEPSPEED_NAMES.items() if ours not in env and env.get(theirs)}


def _mpirun_size_var(env: Mapping[str, str]) -> Optional[str]:
    """The variable by which mpirun says this process is one of several; None when it does not."""
    for name in _MPI_SIZE_VARS:
        if env.get(name, "").isdigit() and int(env[name]) > 1:
            return name
    return None


def _under_accelerate_alone(env: Mapping[str, str]) -> bool:
    """`accelerate launch` without --multi_gpu started this one process although it was asked for several.

    NOTE: its plain launcher (``--cpu``, or no GPU) starts one process whatever --num_processes says, and sets
    MASTER_ADDR only when asked for more than one process or machine; ACCELERATE_USE_CPU marks that launcher.
    """
    return "ACCELERATE_USE_CPU" in env and "MASTER_ADDR" in env


def _under_srun(env: Mapping[str, str]) -> bool:
    """This process is a task of a SLURM job step (srun), not merely inside an allocation."""
    return all(name in env for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID"))


def is_first_process(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Rank 0 of a torchrun or srun job, or a plain process: the one that speaks before the ranks meet (every rank
    parses the same flags, so the others stay quiet). mpirun's rank 0 too, so that its refusal is said once."""
    env = os.environ if environ is None else environ
    return all(env.get(name, "0") == "0" for name in ("RANK", "SLURM_PROCID", *_MPI_RANK_VARS))


def resolve_devices(devices: int | str, num_nodes: int, device_type: str,
                    environ: Optional[Mapping[str, str]] = None) -> tuple[int, str]:
    """``--devices`` as a number of processes per node, and how ``auto`` (or ``-1``) was read ("" for a number).

    ``auto``: under torchrun, the processes it started on each node; under srun with one task per device, the
    tasks per node; otherwise every GPU this node sees (one process on a CPU, or with one srun task per node,
    which spawns them).
    """
    env = os.environ if environ is None else environ
    if devices not in ("auto", -1):
        if isinstance(devices, str) or devices < 1:
            raise ValueError(f"--devices {devices} must be a number of processes per node (1 or more), or auto / -1 "
                             "for every GPU of the node")
        return devices, ""
    if num_nodes < 1:
        raise ValueError(f"--num_nodes {num_nodes} must be at least 1")
    if _under_torchrun(env):
        env = {**env, **_with_torchrun_names(env)}
        world = int(env.get("WORLD_SIZE", "1"))
        if env.get("LOCAL_WORLD_SIZE"):
            per_node = int(env["LOCAL_WORLD_SIZE"])
            if per_node * num_nodes != world:
                fix = f"pass --num_nodes {world // per_node}" if world % per_node == 0 else "pass --devices N"
                raise ValueError(f"--devices {devices} reads {per_node} processes per node from the launcher, but "
                                 f"--num_nodes {num_nodes} × {per_node} is not the {world} it started in all; {fix}")
            return per_node, "the processes the launcher started on this node"
        if world % num_nodes:
            raise ValueError(f"--devices {devices}: the launcher started {world} processes, which --num_nodes "
                             f"{num_nodes} does not divide; pass --num_nodes to match, or --devices N")
        return world // num_nodes, f"{world} processes over {num_nodes} node(s)"
    if _under_srun(env):
        tasks = _first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or 1
        nodes = _first_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1
        if tasks % nodes:
            raise ValueError(f"--devices {devices}: SLURM runs {tasks} tasks on {nodes} nodes, which does not divide; "
                             "use --ntasks-per-node, or pass --devices N")
        if tasks // nodes > 1:
            return tasks // nodes, "SLURM's tasks per node"
    if device_type == "cuda":
        import torch

        count = torch.cuda.device_count()
        if count < 1:
            raise ValueError(f"--devices {devices}: this node sees no GPU; pass --accelerator cpu, or check "
                             "CUDA_VISIBLE_DEVICES")
        return count, "every GPU of this node"
    return 1, "one process on a CPU"


def plan_launch(devices: int, num_nodes: int, environ: Optional[Mapping[str, str]] = None) -> LaunchPlan:
    """Decide from the environment alone how the ``devices × num_nodes`` processes come about.

    Raises ValueError naming the numbers and the fix when the flags and the environment disagree.
    """
    env = os.environ if environ is None else environ
    if devices < 1 or num_nodes < 1:
        raise ValueError(f"--devices {devices} and --num_nodes {num_nodes} must both be at least 1")
    if _under_torchrun(env):
        return _plan_torchrun(devices, num_nodes, env)
    if _under_srun(env):
        return _plan_slurm(devices, num_nodes, env)
    mpi_size_var = _mpirun_size_var(env)
    if mpi_size_var:
        raise ValueError(
            f"mpirun started this process as one of {env[mpi_size_var]} ({mpi_size_var}), but llmtrain learns its "
            "rank from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK) or SLURM's, not MPI's, and each process "
            "would train alone. Start the processes with torchrun, srun, `accelerate launch --multi_gpu` (torchrun, "
            "on CPUs too) or the deepspeed launcher's default (pdsh), not with mpirun")
    if _under_accelerate_alone(env):
        _check_accelerate_alone(devices, num_nodes)
    if devices * num_nodes == 1:
        return LaunchPlan("single", devices, num_nodes)
    if num_nodes == 1:
        return LaunchPlan("local_spawn", devices, 1, run_id=f"llmtrain-{uuid.uuid4().hex[:12]}")
    raise ValueError(
        f"--num_nodes {num_nodes} needs a launcher on every node, and this is a plain process. Run on each "
        f"node:\n  {torchrun_command(devices, num_nodes)}\nor, under SLURM, start the same llmtrain command "
        f"with `srun --nodes {num_nodes} --ntasks-per-node 1` (llmtrain spawns the devices) or "
        f"`srun --nodes {num_nodes} --ntasks-per-node {devices}` (one task per device)")


def _check_accelerate_alone(devices: int, num_nodes: int) -> None:
    """`accelerate launch --cpu --num_processes N` is one process: llmtrain spawns the devices, or nobody does."""
    if num_nodes > 1:
        raise ValueError(
            f"--num_nodes {num_nodes}: `accelerate launch` without --multi_gpu starts one process per machine and "
            "does not tell it the machine's rank. Run on each machine `accelerate launch --multi_gpu --num_machines "
            f"{num_nodes} --machine_rank <0..{num_nodes - 1}> --main_process_ip HOST --main_process_port PORT "
            f"--num_processes {devices * num_nodes} -m llmtrain ... --devices {devices} --num_nodes {num_nodes}` "
            "(torchrun's ranks, on CPUs too)")
    if devices == 1:
        raise ValueError(
            "--devices 1, but `accelerate launch` was asked for several processes and, without --multi_gpu, "
            "started only this one (on CPUs its others would come from mpirun), which would train alone. Pass "
            "--devices N (llmtrain spawns the N workers), or start with `accelerate launch --multi_gpu "
            "--num_processes N -m llmtrain ... --devices N` (torchrun's ranks, on CPUs too)")


def _plan_torchrun(devices: int, num_nodes: int, env: Mapping[str, str]) -> LaunchPlan:
    rank_env = _with_torchrun_names(env)  # the deepspeed launcher's, for Runtime and the mesh to read
    env = {**env, **rank_env}
    world_size = int(env.get("WORLD_SIZE", "1"))
    local_world_size = int(env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE") else None
    if world_size != devices * num_nodes or local_world_size not in (None, devices):
        per_node = f" ({local_world_size} per node)" if local_world_size else ""
        fix = (f"; or pass --devices {local_world_size} --num_nodes {world_size // local_world_size}"
               if local_world_size and world_size % local_world_size == 0 else "")
        raise ValueError(
            f"--devices {devices} × --num_nodes {num_nodes} = {devices * num_nodes} processes, but the launcher "
            f"started {world_size}{per_node}. Start it with `torchrun --nproc_per_node {devices} --nnodes "
            f"{num_nodes} ...`{fix}")
    return LaunchPlan("env", devices, num_nodes, node_rank=int(env.get("GROUP_RANK", "0")),
                      master_addr=env.get("MASTER_ADDR", ""), run_id=env.get("TORCHELASTIC_RUN_ID", ""),
                      rank_env=rank_env)


def _plan_slurm(devices: int, num_nodes: int, env: Mapping[str, str]) -> LaunchPlan:
    num_tasks = _first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    slurm_nodes = _first_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if num_tasks is None or slurm_nodes is None:
        raise ValueError("inside srun, but SLURM_NTASKS or SLURM_NNODES is missing; start the job with srun")
    if slurm_nodes != num_nodes:
        raise ValueError(
            f"--num_nodes {num_nodes}, but SLURM runs this step on {slurm_nodes} node(s) (SLURM_NNODES). "
            f"Ask SLURM for --nodes {num_nodes}, or pass --num_nodes {slurm_nodes}")
    counts = _slurm_tasks_per_node(env, num_tasks, slurm_nodes)
    if len(set(counts)) != 1:
        raise ValueError(
            f"SLURM runs an uneven number of tasks per node ({', '.join(map(str, counts))}); use "
            f"--ntasks-per-node {devices} (one task per device) or --ntasks-per-node 1 (llmtrain spawns "
            "the devices)")
    tasks_per_node = counts[0]
    job_id, step_id = env["SLURM_JOB_ID"], env["SLURM_STEP_ID"]
    master_addr = env.get("MASTER_ADDR") or slurm_first_host(
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    master_port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else slurm_master_port(job_id, step_id)
    node_rank = int(env.get("SLURM_NODEID", "0"))
    common = dict(node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                  run_id=f"slurm-{job_id}-{step_id}")
    if tasks_per_node == devices:
        # NOTE: the rank comes from the node and the local id, not SLURM_PROCID: under --distribution cyclic task 1
        # runs on the second node, and the mesh needs a node's ranks consecutive (tensor-parallel groups and
        # HYBRID_SHARD's shards within a node), as torchrun and the spawning path number them.
        local_rank = int(env.get("SLURM_LOCALID", "0"))
        rank_env = {"RANK": str(global_rank(node_rank, local_rank, devices)), "WORLD_SIZE": str(num_tasks),
                    "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(devices),
                    "GROUP_RANK": str(node_rank), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
        return LaunchPlan("slurm_task_per_device", devices, num_nodes, rank_env=rank_env, **common)
    if tasks_per_node == 1:
        return LaunchPlan("slurm_task_per_node", devices, num_nodes, **common)
    raise ValueError(
        f"SLURM runs {tasks_per_node} tasks per node but --devices is {devices}: use --ntasks-per-node "
        f"{devices} (one task per device) or --ntasks-per-node 1 (one task per node; llmtrain spawns the "
        f"{devices} devices), or pass --devices {tasks_per_node}")


def _first_int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        if env.get(name):
            return int(env[name])
    return None


def _slurm_tasks_per_node(env: Mapping[str, str], num_tasks: int, num_nodes: int) -> list[int]:
    compact = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if compact:
        return parse_tasks_per_node(compact)
    if num_tasks % num_nodes:
        return [num_tasks // num_nodes + 1, num_tasks // num_nodes]  # uneven, reported as such
    return [num_tasks // num_nodes] * num_nodes


def parse_tasks_per_node(compact: str) -> list[int]:
    """SLURM's ``2(x3),1`` → [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in compact.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ValueError(f"cannot read SLURM's tasks per node {compact!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand SLURM's compact host list the way ``scontrol show hostnames`` does.

    ``node[1-3,5]`` → node1 node2 node3 node5; ``gpu-[01-02]`` → gpu-01 gpu-02 (zero padding kept);
    ``a1,b2`` → a1 b2; several bracket groups in one name multiply out.
    """
    hosts: list[str] = []
    for item in _split_outside_brackets(nodelist):
        hosts += _expand_host(item, nodelist)
    if not hosts:
        raise ValueError(f"the SLURM node list {nodelist!r} names no host")
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_host(pattern: str, nodelist: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern:
            raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    hosts = []
    for part in match.group(1).split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"cannot read the range [{match.group(1)}] in the SLURM node list {nodelist!r}")
        numbers = range(int(low), int(high) + 1) if dash else [int(low)]
        for number in numbers:
            hosts += [head + str(number).zfill(len(low)) + rest for rest in _expand_host(tail, nodelist)]
    return hosts


def slurm_first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``scontrol show hostnames`` where it exists, else our parser."""
    if not nodelist:
        raise ValueError("inside srun, but SLURM_JOB_NODELIST is not set; export MASTER_ADDR=<host of the first node>")
    scontrol = shutil.which("scontrol")
    if scontrol:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            hosts = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                   timeout=10, check=True).stdout.split()
            if hosts:
                return hosts[0]
    return expand_hostlist(nodelist)[0]


def slurm_master_port(job_id: str, step_id: str) -> int:
    """A port every task of one job step derives alike, in 10000-29999 (below Linux's ephemeral ports)."""
    return 10000 + zlib.crc32(f"{job_id}.{step_id}".encode()) % 20000


def torchrun_command(devices: int, num_nodes: int) -> str:
    """The torchrun line that starts this same command on each of ``num_nodes`` nodes."""
    return (f"torchrun --nnodes {num_nodes} --nproc_per_node {devices} --node_rank <0..{num_nodes - 1}> "
            f"--master_addr <host of node 0> --master_port 29500 {_this_command()}")


_INVOCATION: list[str] = []


def record_invocation(args: list[str]) -> None:
    """Remember the arguments that ``llmtrain`` runs with (llmtrain.cli.main), for :func:`invocation`."""
    _INVOCATION[:] = ["llmtrain", *args]


def invocation() -> list[str]:
    """The command being run, as ``llmtrain`` and its arguments, for messages that print a command to run next (a
    diverged run's resume); empty outside llmtrain.cli.main."""
    return list(_INVOCATION)


def _this_command() -> str:
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main_spec is not None and main_spec.name:
        module = main_spec.name.removesuffix(".__main__")
        return shlex.join(["-m", module, *sys.argv[1:]])
    if sys.argv and os.path.basename(sys.argv[0]) == "llmtrain":  # the console script
        return shlex.join(["-m", "llmtrain", *sys.argv[1:]])
    return shlex.join(sys.argv) if sys.argv and sys.argv[0] else "-m llmtrain ..."


# --------------------------------------------------------------------------------------------------
# Spawning workers with torch's elastic launcher


def spawn_workers(plan: LaunchPlan, entrypoint: Callable[..., None], args: tuple, kwargs: dict,
                  rdzv_timeout_s: float) -> None:
    """Start ``plan.devices`` workers on this node and wait for them; the nodes meet at ``plan.master_addr``.

    NOTE: the workers are ``python -c`` subprocesses rather than elastic's function mode, because a
    worker must be free to end with ``os._exit`` (see :func:`run_as_worker`), and a function-mode
    worker that does so never hands its result back to the launcher.
    """
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    call = _pickle_call(entrypoint, args, kwargs, plan.devices)
    port = plan.master_port or free_port(plan.master_addr)
    where = f"{plan.master_addr}:{port}"
    with tempfile.TemporaryDirectory(prefix="llmtrain-launch-") as tmp:
        path_file, call_file = os.path.join(tmp, "sys_path.json"), os.path.join(tmp, "call.pkl")
        with open(path_file, "w") as f:
            json.dump([entry for entry in sys.path if entry], f)
        with open(call_file, "wb") as f:
            f.write(call)
        config = LaunchConfig(
            min_nodes=plan.num_nodes, max_nodes=plan.num_nodes, nproc_per_node=plan.devices,
            run_id=plan.run_id or f"llmtrain-{uuid.uuid4().hex[:12]}", rdzv_backend="static",
            rdzv_endpoint=where, rdzv_configs={"rank": plan.node_rank, "timeout": max(1, math.ceil(rdzv_timeout_s))},
            max_restarts=0, logs_specs=DefaultLogsSpecs(log_dir=os.path.join(tmp, "logs")),
            local_addr=plan.master_addr if plan.num_nodes == 1 else None)
        if hasattr(config, "signals_to_handle"):  # torch >= 2.7 sets the variable from this field
            config.signals_to_handle = _ELASTIC_SIGNALS
        worker_env = {RDZV_TIMEOUT_ENV: str(rdzv_timeout_s), _SPAWNED_ENV: "1",
                      "TORCHELASTIC_SIGNALS_TO_HANDLE": _ELASTIC_SIGNALS}
        if "OMP_NUM_THREADS" not in os.environ:
            # NOTE: each worker would otherwise start one OpenMP thread per core of the machine, and
            # `devices` workers would fight over the cores; torchrun sets 1, a fair share is better on CPU.
            worker_env["OMP_NUM_THREADS"] = str(max(1, _usable_cores() // plan.devices))
        try:
            with _patched_environ(worker_env), _quiet_elastic_logs(), _forward_signals_to_workers():
                elastic_launch(config, sys.executable)("-u", "-c", _WORKER_BOOT, path_file, call_file)
        except ChildFailedError as err:
            if all(failure.exitcode == 130 for failure in err.failures.values()):  # Ctrl-C reached them first
                print("llmtrain: interrupted; the workers stopped", file=sys.stderr, flush=True)
                raise SystemExit(130) from None
            if all(failure.exitcode == PREEMPTED_EXIT_CODE for failure in err.failures.values()):
                _ignore_late_stop_signals()
                print("llmtrain: the workers stopped on a signal after writing a checkpoint; resume with "
                      "--resume auto", file=sys.stderr, flush=True)
                raise SystemExit(PREEMPTED_EXIT_CODE) from None
            raise _report_failures(err, plan.world_size) from None
        except SignalException as err:
            print(f"llmtrain: got {err.sigval.name}; stopped the workers", file=sys.stderr, flush=True)
            raise SystemExit(128 + int(err.sigval)) from None
        except DistError as err:
            if plan.num_nodes == 1:
                raise RuntimeError(f"could not open the meeting point {where} for the {plan.devices} workers "
                                   f"({str(err).strip()}); another process may have taken the port") from None
            raise RuntimeError(
                f"node {plan.node_rank} of {plan.num_nodes}: the nodes did not all meet at {where} within "
                f"{rdzv_timeout_s:g}s ({str(err).strip()}). Check that one task was started on every node "
                f"(srun --nodes {plan.num_nodes} --ntasks-per-node 1) and that {plan.master_addr} is "
                "reachable from each") from None


@contextlib.contextmanager
def _forward_signals_to_workers() -> Iterator[None]:
    """Pass TERM, USR1 and USR2 on to the workers while they run, and keep waiting for them.

    NOTE: srun hands USR1 (the time limit is near: checkpoint and stop) to every task, and SLURM or a
    user sends TERM on preemption. With one task per node that task is this launcher: USR1's default
    action would kill it and orphan the workers, and elastic's TERM handling would stop the workers
    and end with 143. Forwarded, TERM and USR1 make the workers checkpoint and exit with 75, which
    this launcher then exits with too. Elastic still passes INT, HUP and QUIT on as it stops the workers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        for pid in _child_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    forwarded = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    previous = {signum: signal.signal(signum, forward) for signum in forwarded}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _child_pids() -> list[int]:
    """This process's children (the workers the elastic agent started), read from /proc (Linux)."""
    me, children = os.getpid(), []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (command)": state, ppid, ...
            except (OSError, IndexError):
                continue
            if int(fields[1]) == me:
                children.append(int(entry))
    return children


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may run on, not all the machine's
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _pickle_call(entrypoint: Callable[..., None], args: tuple, kwargs: dict, devices: int) -> bytes:
    name = getattr(entrypoint, "__qualname__", repr(entrypoint))
    if getattr(entrypoint, "__module__", None) == "__main__":
        raise ValueError(f"launch() starts {devices} fresh interpreters that import {name} by name, but it is "
                         "defined in the __main__ script; move it into an importable module")
    try:
        return pickle.dumps((entrypoint, tuple(args), kwargs))
    except Exception as err:
        raise ValueError(
            f"launch() pickles {name} and its arguments to start {devices} workers, and that failed ({err}). "
            "Pass a module-level function and plain data (numbers, strings, paths, dataclasses), not lambdas, "
            "open files or built models") from err


@contextlib.contextmanager
def _patched_environ(updates: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    """The elastic agent narrates shutdowns and failures (naming whichever worker it polled first); we
    report the first failure ourselves, so only its crashes (CRITICAL) pass."""
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _report_failures(err: Any, world_size: int) -> WorkerFailedError:
    """The error that tells the first failure; print its traceback and one line per other failure first, unless
    it is told in one line (an input error a rank found, llmtrain.errors): then the returned error says it all."""
    failures = sorted(err.failures.items(), key=lambda item: _failure_order(item[1]))
    (rank, first), others = failures[0], failures[1:]
    message, callstack = _failure_text(first)
    told = first.error_file_data.get(_TOLD_KEY) if isinstance(first.error_file_data, dict) else None
    if isinstance(told, int) and not debugging():
        return WorkerFailedError(f"rank {rank} of {world_size}: {message}", exit_status=told)
    lines = [f"llmtrain: rank {rank} of {world_size} failed (exit code {first.exitcode}): {message}"]
    if callstack:
        lines.append(callstack.rstrip())
    for other, failure in others:
        lines.append(f"llmtrain: rank {other} also stopped: {_shorten(_failure_text(failure)[0])}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return WorkerFailedError(f"rank {rank} of {world_size} failed: {message}")


def _shorten(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _failure_order(failure: Any) -> tuple[bool, float]:
    """Sort key for "who failed first": workers the launcher stopped with SIGTERM after the first
    failure come last; then time, sub-second where our workers recorded it (elastic's is whole seconds)."""
    stopped_by_launcher = failure.exitcode == -signal.SIGTERM
    return stopped_by_launcher, float(failure.error_file_data.get("llmtrain_time", failure.timestamp))


def _failure_text(failure: Any) -> tuple[str, str]:
    if isinstance(failure.message, dict):
        extra = failure.message.get("extraInfo", {})
        return str(failure.message.get("message", "")), str(extra.get("py_callstack", ""))
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}", ""
    if not failure.error_file_data.get("message"):
        return f"exited with code {failure.exitcode} without an error report (see its output above)", ""
    return str(failure.message), ""


# --------------------------------------------------------------------------------------------------
# Inside a worker


def run_as_worker(entrypoint: Callable[..., None], args: tuple = (), kwargs: Optional[dict] = None) -> NoReturn:
    """Run one rank's share of the job, then end the process: barrier, destroy the group, flush, ``os._exit``.

    NOTE: with gloo, an interpreter that shuts down normally after training can abort
    ("terminate called without an active exception") while tearing the process group down; an
    orderly teardown followed by ``os._exit`` avoids it. Exit status: 0 on success, 1 on an exception
    (recorded in TORCHELASTIC_ERROR_FILE for the launcher), 130 on Ctrl-C, 75 when training stopped
    on SIGTERM or SIGUSR1 after writing a checkpoint (llmtrain.train.signals).
    """
    global _in_worker
    _in_worker = True
    rank = os.environ.get("RANK", "0")
    if rank != "0" and os.environ.get(ALL_RANKS_PRINT_ENV) != "1":
        sys.stdout.flush()
        sys.stdout = open(os.devnull, "w")
    try:
        try:
            entrypoint(*args, **(kwargs or {}))
        except SystemExit as exc:
            if _exit_status(exc) != 0:
                raise
        _close_process_group()
        status = 0
    except KeyboardInterrupt:
        print(f"[rank {rank}] interrupted", file=sys.stderr)
        status = 130
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(f"[rank {rank}] {exc.code}", file=sys.stderr)
        status = _exit_status(exc)
        if status == PREEMPTED_EXIT_CODE:
            _ignore_late_stop_signals()
    except BaseException as exc:  # noqa: BLE001  (every failure must reach the launcher)
        exc = _naming_hung_ranks(exc)
        _record_failure(exc, rank)
        status = told_status(exc) or 1
    _flush_std()
    os._exit(status)


class CollectiveTimeoutError(RuntimeError):
    """A collective waited --dist_timeout for ranks that never came; the message names them. Exit 1, in one line:
    the cause is on those ranks, and this rank's traceback shows only where it waited."""

    exit_status = 1


_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
"""What gloo's ("Timed out waiting 20000ms for recv operation") and NCCL's ("collective operation timeout") say."""


def _naming_hung_ranks(exc: BaseException) -> BaseException:
    """A collective's timeout, with the ranks that never arrived named (:func:`ranks_that_never_arrived`)."""
    if not isinstance(exc, RuntimeError) or not _TIMED_OUT.search(str(exc)):
        return exc
    hung = ranks_that_never_arrived()
    if not hung:
        return exc
    ranks = f"rank {hung[0]}" if len(hung) == 1 else "ranks " + ", ".join(map(str, hung[:16])) + (
        f" and {len(hung) - 16} more" if len(hung) > 16 else "")
    error = CollectiveTimeoutError(
        f"{ranks} never reached the collective the other ranks waited in for --dist_timeout: "
        f"{'it is' if len(hung) == 1 else 'they are'} hung or stopped (look at {ranks}'s process and host), or in host "
        f"work that takes longer than --dist_timeout (then raise it). The timeout: {' '.join(str(exc).split())}")
    error.__cause__ = exc
    return error


def _ignore_late_stop_signals() -> None:
    """After a clean stop on a signal only the exit remains; a late TERM must not turn 75 into 143.

    NOTE: the ranks leave at almost the same moment, and srun's --kill-on-bad-exit (75 is not 0) or
    the elastic agent then sends TERM to the ones still on their way out.
    """
    with contextlib.suppress(ValueError):  # outside the main thread, handlers cannot change
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_IGN)


def _worker_main(call_file: str) -> NoReturn:
    """The body of a spawned worker: load the pickled call, then run it as a rank."""
    try:
        with open(call_file, "rb") as f:
            entrypoint, args, kwargs = pickle.load(f)
    except BaseException as exc:  # noqa: BLE001
        _record_failure(exc, os.environ.get("RANK", "?"))
        _flush_std()
        os._exit(1)
    run_as_worker(entrypoint, args, kwargs)


def _close_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        host_barrier()  # rank 0 may still be closing its loggers (a W&B upload): host work, off the device
        dist.destroy_process_group()
        leave_in_order()  # rank 0 may host the store that the others' barrier read


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def _record_failure(exc: BaseException, rank: str) -> None:
    """Write the error where the elastic launcher looks for it; print it unless our launcher will (in one line if
    it is an error told so, llmtrain.errors)."""
    callstack = traceback.format_exc()
    recorded = _write_error_file(exc, callstack)
    report_failure(f"rank {rank} failed: {type(exc).__name__}: {exc}")  # after the record: the others fail later
    if recorded and os.environ.get(_SPAWNED_ENV) == "1":
        return
    if told_status(exc) is not None and not debugging():
        sys.stderr.write(f"[rank {rank}] error: {exc}\n")
    else:
        sys.stderr.write(f"[rank {rank}] {callstack}")


def _write_error_file(exc: BaseException, callstack: str) -> bool:
    """Record ``exc`` in TORCHELASTIC_ERROR_FILE (the format of torch's ErrorHandler) if there is one."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    now = time.time()
    told = told_status(exc)
    report = {"message": {"message": str(exc) if told is not None else f"{type(exc).__name__}: {exc}",
                          "extraInfo": {"py_callstack": callstack, "timestamp": str(int(now))}},
              "llmtrain_time": now, _TOLD_KEY: told}
    try:
        with open(error_file, "w") as f:
            json.dump(report, f)
    except OSError:
        return False
    return True


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
