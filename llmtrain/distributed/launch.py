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

This module decides, from the environment alone (SLURM's variables read by :mod:`llmtrain.distributed.slurm`);
:mod:`llmtrain.distributed.supervise` spawns the workers, watches them and turns their failures into exit codes.
Every rank runs ``fn`` inside :func:`~llmtrain.distributed.supervise.run_as_worker`, which tears the process
group down and ends the process itself, so ``launch`` returns only in the ``single`` and spawning paths.
Spawned workers are fresh interpreters that unpickle ``fn`` and its arguments: both must be picklable by
reference (module-level functions, plain data), not lambdas, open files or built models.
"""

from __future__ import annotations

import os
import shlex
import sys
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Optional

from llmtrain.distributed import slurm, supervise
from llmtrain.distributed.parallel_plan import global_rank
from llmtrain.distributed.runtime import RDZV_TIMEOUT_ENV, rendezvous_timeout_s

LaunchMode = Literal["single", "env", "slurm_task_per_device", "slurm_task_per_node", "local_spawn"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# The deepspeed launcher sets torchrun's three, but names the processes of a node and the node's rank its own way.
_DEEPSPEED_NAMES = {"LOCAL_WORLD_SIZE": "LOCAL_SIZE", "GROUP_RANK": "CROSS_RANK"}
# How mpirun tells a process the size of its job: Open MPI, PMI (MPICH, Intel MPI), MVAPICH.
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")


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
    if supervise.in_worker():
        entrypoint(*args, **kwargs)
        return
    try:
        plan = plan_launch(devices, num_nodes)
    except ValueError as exc:
        supervise.write_error_file(exc, traceback.format_exc())  # under torchrun, its summary then shows the reason
        raise
    if plan.mode == "single":
        entrypoint(*args, **kwargs)
        return
    if rdzv_timeout_s is None:
        rdzv_timeout_s = rendezvous_timeout_s()
    if plan.mode in ("env", "slurm_task_per_device"):
        os.environ.update(plan.rank_env)
        os.environ[RDZV_TIMEOUT_ENV] = str(rdzv_timeout_s)
        supervise.run_as_worker(entrypoint, args, kwargs)
    supervise.spawn_workers(plan, entrypoint, args, kwargs, rdzv_timeout_s)


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
        tasks = slurm.first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or 1
        nodes = slurm.first_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1
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
    num_tasks = slurm.first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    slurm_nodes = slurm.first_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if num_tasks is None or slurm_nodes is None:
        raise ValueError("inside srun, but SLURM_NTASKS or SLURM_NNODES is missing; start the job with srun")
    if slurm_nodes != num_nodes:
        raise ValueError(
            f"--num_nodes {num_nodes}, but SLURM runs this step on {slurm_nodes} node(s) (SLURM_NNODES). "
            f"Ask SLURM for --nodes {num_nodes}, or pass --num_nodes {slurm_nodes}")
    counts = slurm.tasks_per_node(env, num_tasks, slurm_nodes)
    if len(set(counts)) != 1:
        raise ValueError(
            f"SLURM runs an uneven number of tasks per node ({', '.join(map(str, counts))}); use "
            f"--ntasks-per-node {devices} (one task per device) or --ntasks-per-node 1 (llmtrain spawns "
            "the devices)")
    tasks_per_node = counts[0]
    job_id, step_id = env["SLURM_JOB_ID"], env["SLURM_STEP_ID"]
    master_addr = env.get("MASTER_ADDR") or slurm.slurm_first_host(
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    master_port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else slurm.slurm_master_port(job_id, step_id)
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


