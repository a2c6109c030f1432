"""Who this process is: rank, world, device, data-parallel shard.

Everything that depends on the process layout asks a :class:`Runtime` instead of assuming one
process, so the same training loop runs on one CPU or on many GPU nodes.

Two kinds of waiting. A collective (an all-reduce of gradients, of the step's token count) waits for the
other ranks' devices, and ``--dist_timeout`` bounds it: past it, the run is hung and NCCL's watchdog ends
it. Waiting for host work that one rank does alone (rank 0 tokenizing a corpus under
:meth:`Runtime.main_process_first`, reading or writing a full checkpoint, writing ``final/``) can
legitimately take much longer; it goes around the device, through the store the ranks met at
(:func:`host_barrier`) or a gloo group (:func:`host_group`), and allows at least ``HOST_WAIT_S``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist


HOST_WAIT_S = 2 * 3600.0
"""The least time a wait for host work allows (:func:`host_barrier`); a longer --dist_timeout raises it."""

RDZV_TIMEOUT_ENV = "LLMTRAIN_RDZV_TIMEOUT"
"""Seconds the processes of a run wait for each other to meet; :func:`llmtrain.distributed.launch.launch` sets it
for the ranks, from the caller's value or the user's own setting (:func:`rendezvous_timeout_s`)."""

RDZV_TIMEOUT_S = 900.0
"""How long the processes of a run wait for each other to meet unless ``$LLMTRAIN_RDZV_TIMEOUT`` says otherwise.

NOTE: torchrun's 900 s, not less. Under srun with a task per GPU every task imports torch, checks ``--resume auto``,
validates the tokenizer and maps ``training_state.pt`` before it meets the others, each from a shared filesystem
that a thousand tasks read at once; rank 0's store waited 60 s for its peers, and a slow filesystem failed
healthy jobs at the start. A task that never comes still fails the run, after this long.
"""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def rendezvous_timeout_s() -> float:
    """Seconds the processes of a run wait for each other to meet: ``$LLMTRAIN_RDZV_TIMEOUT`` when set (by the user,
    or by :func:`llmtrain.distributed.launch.launch` for the ranks), else :data:`RDZV_TIMEOUT_S`."""
    value = os.environ.get(RDZV_TIMEOUT_ENV, "").strip()
    if not value:
        return RDZV_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{RDZV_TIMEOUT_ENV}={value!r} must be a number of seconds above 0 (how long the processes "
                         f"wait for each other to meet); unset it for the default {RDZV_TIMEOUT_S:g}")
    return seconds


@dataclass
class Runtime:
    """The process layout. ``data_parallel_*``, ``tp_*`` and ``pp_*`` are this rank's place in the plan's
    ``mesh`` (:meth:`~llmtrain.distributed.parallel_plan.ParallelPlan.coordinates`); without a plan,
    ``data_parallel_*`` equal ``rank``/``world_size``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    data_parallel_rank: int = 0
    data_parallel_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    mesh: Any = None
    """The plan's DeviceMesh, built once its process group exists (None for one process, and for DeepSpeed)."""

    @property
    def counts_batch(self) -> bool:
        """Whether this rank's batch numbers (tokens, loss sums) count in a sum over all ranks.

        The tensor-parallel ranks of a data-parallel shard and its pipeline stages all read the same batch;
        one of them counts it: tensor rank 0 of the last stage, which alone has the loss under a pipeline.
        """
        return self.tp_rank == 0 and self.pp_rank == self.pp_size - 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs and writes shared files."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, accelerator: str = "auto", timeout_s: float = 600.0,
                 rdzv_timeout_s: Optional[float] = None) -> "Runtime":
        """Build the runtime from torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, ...).

        Without them this is a single process. With them, the default process group is created here
        (NCCL on CUDA, gloo on CPU). Two bounds keep a broken job from hanging: the processes must all
        meet within ``rdzv_timeout_s`` (default: :func:`rendezvous_timeout_s`), and
        each collective afterwards must finish within ``timeout_s``.
        """
        device = pick_device(accelerator, *_local_layout())
        return cls._start(device, None, timeout_s, rdzv_timeout_s, process_group_backend(device.type, False))

    @classmethod
    def for_plan(cls, plan: Any, timeout_s: float = 600.0) -> "Runtime":
        """This rank of ``plan`` (a :class:`~llmtrain.distributed.parallel_plan.ParallelPlan`): its device, the
        process group the plan needs (also a one-rank group for FSDP on one device), the plan's mesh once that group
        exists, and its place on the mesh (data-parallel shard, tensor and pipeline rank)."""
        world_size = _env_int("WORLD_SIZE", 1)
        if world_size != plan.world_size:
            raise RuntimeError(f"the launcher started {world_size} processes but the parallel plan has "
                               f"{plan.world_size}; the launcher checks this before any worker starts")
        device = pick_device(plan.device_type, *_local_layout())
        backend = process_group_backend(device.type, plan.cpu_offload)
        runtime = cls._start(device, plan, timeout_s, None, backend)
        if plan.uses_process_group and not dist.is_initialized():
            # NOTE: FSDP on one device still needs a process group; a one-rank group meets nobody. Its one-rank mesh
            # is built where the model is sharded (parallelize): one rank has no place to find in it.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                    **bound_device(device, backend))
        return runtime

    @classmethod
    def _start(cls, device: torch.device, plan: Any, timeout_s: float, rdzv_timeout_s: Optional[float],
               backend: str) -> "Runtime":
        world_size = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        if world_size > 1 and not dist.is_initialized():
            if rdzv_timeout_s is None:
                rdzv_timeout_s = rendezvous_timeout_s()
            # Without LOCAL_WORLD_SIZE nobody knows how many peers to compare GPUs with (NCCL still refuses a
            # shared GPU, in its own words).
            known = os.environ.get("LOCAL_WORLD_SIZE")
            start_process_group(device, rank, world_size, timeout_s, rdzv_timeout_s, backend,
                                local_layout=_local_layout()[:2] if known else None)
        return cls._at(rank, world_size, plan, device, local_rank=_env_int("LOCAL_RANK", 0),
                       local_world_size=_env_int("LOCAL_WORLD_SIZE", world_size))

    @classmethod
    def simulated(cls, plan: Any, rank: int) -> "Runtime":
        """Rank ``rank`` of ``plan`` as ``--dry_run.simulate`` runs it: in this process, on the CPU, under a fake
        process group that the caller created (:func:`llmtrain.recipes.simulate.fake_world`)."""
        return cls._at(rank, plan.world_size, plan, torch.device("cpu"), local_rank=plan.node_and_local_rank(rank)[1],
                       local_world_size=plan.devices)

    @classmethod
    def _at(cls, rank: int, world_size: int, plan: Any, device: torch.device, *, local_rank: int,
            local_world_size: int) -> "Runtime":
        """This rank, and with a plan of several ranks the plan's mesh (the process group exists): its place in the
        plan is the mesh's coordinates, the one source of every data-parallel, tensor and pipeline rank."""
        if plan is None:
            return cls(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
                       device=device, data_parallel_rank=rank, data_parallel_size=world_size)
        mesh = plan.build_mesh() if world_size > 1 else None
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
                   device=device, mesh=mesh, **plan.coordinates(mesh, rank))

    def barrier(self) -> None:
        """Wait until every rank gets here: a wait for host work, around the device (:func:`host_barrier`)."""
        if self.is_distributed:
            host_barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce over every rank (identity in a single process)."""
        if self.is_distributed:
            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            dist.all_reduce(tensor, op=ops[op])
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.is_distributed:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.is_distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def ranks_not_seeing(self, folder: Path) -> list[int]:
        """The ranks that do not see what rank 0 writes into ``folder`` (created if missing): none when every
        node shares it. Rank 0 leaves a note with a fresh token there, every rank reads it back, and rank 0
        removes it. Every rank gets the same answer; call it on every rank."""
        if self.world_size == 1:
            return []
        token = uuid.uuid4().hex if self.is_main else None
        token = self.broadcast_object(token)
        note = Path(folder) / f".llmtrain-shared-check-{token}"
        if self.is_main:
            note.parent.mkdir(parents=True, exist_ok=True)
            note.write_text(token)
        self.barrier()
        sees = note.is_file() and note.read_text() == token
        blind = [rank for rank, seen in enumerate(self.all_gather_object(sees)) if not seen]
        self.barrier()  # every rank has looked before the note goes
        if self.is_main:
            note.unlink(missing_ok=True)
        return blind

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True) -> Iterator[None]:
        """Run the body on (local) rank 0 first, then on every other rank: for cached, once-only work."""
        first = self.local_rank == 0 if local else self.rank == 0
        if not first:
            self.barrier()
        yield
        if first:
            self.barrier()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        _keep_for_host_waits(_HostWaits())


def process_group_backend(device_type: str, cpu_offload: bool) -> str:
    """The default process group's backend: NCCL for a GPU run, gloo for a CPU run.

    A GPU run that offloads to the CPU gets both, chosen by the tensor's device: FSDP2 keeps offloaded
    gradients in host memory, and gradient clipping all-reduces their norm there, which NCCL refuses.
    NOTE: only then. A gloo backend connects every pair of ranks as the group is created, over the
    interface GLOO_SOCKET_IFNAME names (else the one the host name resolves to): for a run that never
    reduces a host tensor, that is a slower start and one more way for a multi-node job to fail.
    """
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"
    raise ValueError(f"no process group backend for device type {device_type!r}; llmtrain runs on cpu or cuda")


def bound_device(device: torch.device, backend: str) -> dict[str, torch.device]:
    """``init_process_group``'s ``device_id`` for this rank's GPU: NCCL then connects as the group is created, and
    ``init_device_mesh`` creates each dimension's groups with one ``ncclCommSplit`` per dimension.

    NOTE: not for a group of several backends (``cuda:nccl,cpu:gloo``, --fsdp.cpu_offload), as torchtitan does.
    With a bound device, ``init_device_mesh`` makes every dimension smaller than the world (HYBRID_SHARD's, the
    default on several nodes; any tensor- or pipeline-parallel run's) with ``split_group``, which splits each of
    the parent's backends. Older torch refused a multi-backend parent ("Unknown c10d backend type CUDA:NCCL",
    pytorch/pytorch#159200). torch 2.13 no longer refuses it in Python and splits gloo beside NCCL in C++ (handed
    the options split_group copies from NCCL's backend, which gloo's split replaces by its defaults, with a warning);
    whether that split works is only seen on a GPU (scripts/gpu_check.py tries it). Unbound, the mesh takes
    ``new_group`` per dimension: the path every CPU run takes, and torchtitan's offloading runs, at the price of
    NCCL connecting at the first collective rather than at the start.
    """
    if device.type != "cuda" or "," in backend:
        return {}
    return {"device_id": device}


def start_process_group(device: torch.device, rank: int, world_size: int, timeout_s: float,
                        rdzv_timeout_s: float, backend: str, local_layout: Optional[tuple[int, int]] = None) -> None:
    """Meet the other ranks at MASTER_ADDR:MASTER_PORT, then create the default process group.

    ``local_layout`` is (local rank, processes on this node), where known: on GPUs, the local ranks then
    check through the meeting's store that each has a GPU of its own before NCCL starts.

    NOTE: the meeting gets its own, short timeout. Giving ``init_process_group`` a short timeout
    instead would also bound every later collective, and a barrier that waits while rank 0
    tokenizes a corpus or writes a checkpoint legitimately takes minutes.
    """
    try:
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size,
                                           timeout=datetime.timedelta(seconds=rdzv_timeout_s)))
    except dist.DistError as err:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise RuntimeError(
            f"rank {rank} of {world_size}: the processes did not all meet at {where} within "
            f"{rdzv_timeout_s:g}s ({str(err).strip()}). Check that every node and task was started and "
            "that this address is reachable from all of them") from None
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt:
        # NOTE: torchrun's static rendezvous keeps one store across restarts (--max-restarts); without a
        # prefix per attempt, restarted ranks can read the addresses the failed attempt left there and
        # fail to connect (pytorch/pytorch#135712).
        store = dist.PrefixStore(f"llmtrain/attempt_{attempt}", store)
    if device.type == "cuda" and local_layout is not None:
        check_own_gpu(store, rank, *local_layout, gpu_id=str(torch.cuda.get_device_properties(device).uuid))
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **bound_device(device, backend))
    _keep_for_host_waits(_HostWaits(store, rank, world_size, max(timeout_s, HOST_WAIT_S)))


# ------------------------------------------------------------------------------ waits for host work
class _HostWaits:
    """What :func:`host_barrier` and :func:`host_group` use: the store the ranks met at, and how long to wait."""

    def __init__(self, store: Any = None, rank: int = 0, world_size: int = 1, timeout_s: float = HOST_WAIT_S) -> None:
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.barriers = 0
        self.group: Any = None


_host_waits = _HostWaits()


def _keep_for_host_waits(waits: _HostWaits) -> None:
    global _host_waits
    _host_waits = waits


def host_barrier() -> None:
    """Wait for every rank through the store the ranks met at, for up to max(--dist_timeout, HOST_WAIT_S).

    For waits on host work (rank 0 tokenizing, reading or writing a checkpoint): a barrier on the device
    would be bound by the collective timeout, and NCCL's watchdog would end a healthy run. A process
    group created by someone else (no store here) gets its ordinary barrier.
    """
    waits = _host_waits
    if waits.store is None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return
    waits.barriers += 1  # every rank counts the same barriers in the same order: the count names this one
    key = _barrier_key(waits.barriers)
    if waits.store.add(key, 1) == waits.world_size:
        waits.store.set(f"{key}/open", "1")
    try:
        waits.store.wait([f"{key}/open"], datetime.timedelta(seconds=waits.timeout_s))
    except dist.DistError:
        raise RuntimeError(
            f"rank {waits.rank}: waited {waits.timeout_s:g}s for the other ranks to finish their host work "
            "(tokenizing data, reading or writing a checkpoint) and some never arrived: one is stuck or died. If "
            "that work takes longer, raise --dist_timeout") from None
    if waits.store.check([_FAILURE_KEY]):
        raise RuntimeError(f"rank {waits.rank}: stopped waiting for the other ranks: "
                           f"{waits.store.get(_FAILURE_KEY).decode()}")


LEAVE_WAIT_S = 30.0
"""How long rank 0 waits, at the very end, for the other ranks to be done with the store (:func:`leave_in_order`)."""


def leave_in_order() -> None:
    """After the last :func:`host_barrier` of a run: every other rank counts itself out, and rank 0 leaves last.

    NOTE: without torchrun's agent (srun with a task per device, the deepspeed launcher) the store lives in rank 0's
    process. Rank 0, which saves and logs last, often opens the last barrier and exits at once, and a peer still
    reading the barrier's outcome then failed with "Connection reset by peer" after a successful run. Rank 0 waits
    for the count at most LEAVE_WAIT_S: a peer gone meanwhile had nothing left to do.
    """
    waits = _host_waits
    if waits.store is None or waits.world_size == 1:
        return
    if waits.rank != 0:
        with contextlib.suppress(Exception):  # rank 0 already gave up waiting: nothing is lost
            waits.store.add(_LEFT_KEY, 1)
        return
    deadline = time.monotonic() + LEAVE_WAIT_S
    with contextlib.suppress(Exception):
        while waits.store.add(_LEFT_KEY, 0) < waits.world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.01)


_LEFT_KEY = "llmtrain/left"
_FAILURE_KEY = "llmtrain/failed"


def _barrier_key(count: int) -> str:
    return f"llmtrain/host_barrier/{count}"


def report_failure(message: str) -> None:
    """Tell the ranks that wait in :func:`host_barrier` that this rank failed (``message`` says how): they stop now.

    NOTE: torchrun and the elastic launcher stop the other ranks when one fails, but srun does so only with
    --kill-on-bad-exit; without it they would wait out the host-wait timeout (two hours) for a rank that never
    comes. They can wait only in this rank's last barrier or its next one: both open, and they read the message.
    """
    waits = _host_waits
    if waits.store is None:
        return
    with contextlib.suppress(Exception):  # the store may have gone with rank 0; the others then fail on their own
        if not waits.store.check([_FAILURE_KEY]):  # the first failure is the one to report
            waits.store.set(_FAILURE_KEY, message)
        for count in (waits.barriers, waits.barriers + 1):
            waits.store.set(f"{_barrier_key(count)}/open", "1")


HUNG_RANKS_WAIT_S = 10.0
"""How long a rank whose collective timed out waits for the others' to time out too, before naming the ranks that
did not."""
_TIMED_OUT_KEY = "llmtrain/timed_out"


def ranks_that_never_arrived() -> Optional[list[int]]:
    """After a collective timed out on this rank: the ranks whose own collectives did not time out within
    HUNG_RANKS_WAIT_S, so never reached the one the others waited in (hung, stopped, or lost in host work).
    None when that cannot be told (one process, no store, the store gone).

    Each rank that times out counts itself in the store the ranks met at; the first to count waits for the others
    (every rank but the hung one, in the usual case, at once), checks each rank once and leaves the list there for
    the others. NOTE: nothing is written before a timeout, so a healthy run pays nothing, at any scale; the store
    calls wait at most HUNG_RANKS_WAIT_S, also when the store lives in the rank that hangs (srun, a task a device).
    """
    waits = _host_waits
    if waits.store is None or waits.world_size == 1:
        return None
    store, listed = waits.store, f"{_TIMED_OUT_KEY}/hung"
    try:
        store.set_timeout(datetime.timedelta(seconds=HUNG_RANKS_WAIT_S))
        store.set(f"{_TIMED_OUT_KEY}/{waits.rank}", "1")
        if store.add(_TIMED_OUT_KEY, 1) > 1:  # another rank lists them
            store.wait([listed])
            return [int(rank) for rank in store.get(listed).decode().split()]
        deadline = time.monotonic() + HUNG_RANKS_WAIT_S
        while store.add(_TIMED_OUT_KEY, 0) < waits.world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        hung = [rank for rank in range(waits.world_size) if not store.check([f"{_TIMED_OUT_KEY}/{rank}"])]
        store.set(listed, " ".join(map(str, hung)))
        return hung
    except Exception:  # noqa: BLE001  (the timeout's own message still reaches the user)
        return None


def host_group() -> Any:
    """A gloo group over every rank that waits as long as :func:`host_barrier`, for collectives around host work
    (torch.distributed.checkpoint's writes). Created on the first call, which every rank makes at the same point."""
    if _host_waits.group is None:
        _host_waits.group = dist.new_group(backend="gloo",
                                           timeout=datetime.timedelta(seconds=_host_waits.timeout_s))
    return _host_waits.group


def pick_device(accelerator: str, local_rank: int, local_world_size: int = 1,
                ranks_share_gpus: bool = True) -> torch.device:
    """``auto`` takes this rank's GPU when there is one, else the CPU; :func:`gpu_index` says which GPU."""
    if accelerator not in ("auto", "cpu", "cuda", "gpu"):
        raise ValueError(f"--accelerator {accelerator!r} must be auto, cpu, cuda or gpu")
    want_cuda = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    if want_cuda:
        if not torch.cuda.is_available():
            raise ValueError(f"--accelerator {accelerator} was asked for but no CUDA device is visible")
        index = gpu_index(local_rank, local_world_size, torch.cuda.device_count(), ranks_share_gpus=ranks_share_gpus)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def gpu_index(local_rank: int, local_world_size: int, visible: int, *, ranks_share_gpus: bool) -> int:
    """Which of the ``visible`` GPUs this process takes: ``local_rank`` modulo ``visible``.

    - One GPU visible: that one, whatever the local rank (SLURM's ``--gpus-per-task 1`` and
      ``--gpu-bind single:1`` show each task only its own).
    - At least one per local rank (every GPU of the node visible): GPU ``local_rank``.
    - Fewer than the node's processes: with ``ranks_share_gpus`` (the processes are one launcher's
      children, torchrun's or llmtrain's, and see the same GPUs) some would have to share one, which
      is an error. SLURM's tasks may each see a set of their own (``--gpu-bind closest`` shows a task the
      GPUs of its socket: local ranks 4-7 see GPUs 4-7 as 0-3), where local rank modulo that count
      picks distinct GPUs; the ranks check that they did once they meet (:func:`check_own_gpu`).
    """
    if visible < 1:
        raise ValueError(f"local rank {local_rank} sees no GPU (CUDA_VISIBLE_DEVICES); use --accelerator cpu, or "
                         "make the node's GPUs visible to its processes")
    if ranks_share_gpus and visible < local_world_size:
        raise ValueError(
            f"{local_world_size} processes on this node share {visible} visible GPU{'s' * (visible > 1)}, so local "
            f"rank {local_rank} has none of its own. Start at most {visible} per node (--devices {visible}, or "
            f"torchrun --nproc_per_node {visible}), or make more GPUs visible (CUDA_VISIBLE_DEVICES, SLURM's --gpus)")
    return local_rank % visible


def check_own_gpu(store: Any, rank: int, local_rank: int, local_world_size: int, gpu_id: str,
                  host: Optional[str] = None) -> None:
    """Raise unless each process of this node has a GPU of its own (``gpu_id``: its UUID, the same from every
    process that sees it, whatever CUDA_VISIBLE_DEVICES calls it). The local ranks swap ids through ``store``."""
    host = host or socket.gethostname()
    store.set(f"llmtrain/gpu/{host}/{local_rank}", f"{rank} {gpu_id}")
    gpu_of_rank = {}
    for peer in range(local_world_size):
        peer_rank, peer_gpu = store.get(f"llmtrain/gpu/{host}/{peer}").decode().split(" ", 1)
        gpu_of_rank[int(peer_rank)] = peer_gpu
    shared = shared_gpus(gpu_of_rank)
    if shared:
        clashes = "; ".join(f"ranks {', '.join(map(str, ranks))} all use GPU {gpu}" for gpu, ranks in shared.items())
        raise RuntimeError(
            f"on {host}, {clashes}: each rank needs a GPU of its own. Start at most one process per GPU, and give "
            "SLURM tasks distinct GPUs (srun --gpus-per-task 1, or --ntasks-per-node equal to the GPUs per node "
            "without --gpu-bind)")


def shared_gpus(gpu_of_rank: dict[int, str]) -> dict[str, list[int]]:
    """The GPUs that more than one rank took, each with those ranks (in order)."""
    ranks_of_gpu: dict[str, list[int]] = {}
    for rank, gpu in sorted(gpu_of_rank.items()):
        ranks_of_gpu.setdefault(gpu, []).append(rank)
    return {gpu: ranks for gpu, ranks in ranks_of_gpu.items() if len(ranks) > 1}


def _local_layout() -> tuple[int, int, bool]:
    """(local rank, processes on this node, whether they see the same GPUs) from the launcher's variables.

    The children of one elastic agent (torchrun, or llmtrain spawning its workers) inherit one
    CUDA_VISIBLE_DEVICES; SLURM's tasks (one per device) and unknown launchers may each have their own.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    return (_env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", world_size),
            "TORCHELASTIC_RUN_ID" in os.environ)


def configure_process(runtime: Optional[Runtime] = None, precision: Any = None) -> None:
    """Per-process settings; spawned workers are fresh interpreters, so every entrypoint calls this.

    ``precision``: the run's :class:`~llmtrain.precision.Precision`; float32 matmuls use TF32 where
    it says so (see ``Precision.uses_tf32``).
    """
    import warnings

    if runtime is not None and precision is not None and precision.uses_tf32(runtime.device.type):
        torch.set_float32_matmul_precision("high")
    if runtime is not None and runtime.device.type == "cpu":
        from llmtrain.distributed.host_memory import keep_freed_host_memory

        keep_freed_host_memory()  # tensors live in host memory: reuse its blocks (see host_memory)

    # Warnings read as one line for people, not as a source listing.
    warnings.formatwarning = lambda message, category, *_: f"warning: {message}\n"
    if runtime is not None and not runtime.is_main:
        # Every rank sees the same configuration: rank 0 says it once. Errors still come from every rank.
        warnings.simplefilter("ignore")
