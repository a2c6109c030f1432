"""Who this process is: rank, world, device, data-parallel shard.

Everything that depends on the process layout asks a :class:`Runtime` instead of assuming one
process, so the same training loop runs on one CPU or on many GPU nodes.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist


RDZV_TIMEOUT_ENV = "LLMTRAIN_RDZV_TIMEOUT"
"""Seconds the processes of a run wait for each other to meet; :func:`llmtrain.distributed.launch.launch` sets it."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def _env_float(name: str) -> Optional[float]:
    value = os.environ.get(name)
    return float(value) if value not in (None, "") else None


@dataclass
class Runtime:
    """The process layout. ``data_parallel_*`` equal ``rank``/``world_size`` unless a mesh says otherwise."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    data_parallel_rank: int = 0
    data_parallel_size: int = 1

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
        meet within ``rdzv_timeout_s`` (default: ``$LLMTRAIN_RDZV_TIMEOUT``, else ``timeout_s``), and
        each collective afterwards must finish within ``timeout_s``.
        """
        return cls._start(pick_device(accelerator, _env_int("LOCAL_RANK", 0)), None, timeout_s, rdzv_timeout_s)

    @classmethod
    def for_plan(cls, plan: Any, timeout_s: float = 600.0) -> "Runtime":
        """This rank of ``plan`` (a :class:`~llmtrain.distributed.parallel_plan.ParallelPlan`): its device, the
        process group the plan needs (also a one-rank group for FSDP on one device), its data-parallel shard."""
        world_size = _env_int("WORLD_SIZE", 1)
        if world_size != plan.world_size:
            raise RuntimeError(f"the launcher started {world_size} processes but the parallel plan has "
                               f"{plan.world_size}; the launcher checks this before any worker starts")
        device = pick_device(plan.device_type, _env_int("LOCAL_RANK", 0))
        runtime = cls._start(device, plan, timeout_s, None)
        if plan.uses_process_group and not dist.is_initialized():
            # NOTE: FSDP on one device still needs a process group; a one-rank group meets nobody.
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1, **({"device_id": device} if device.type == "cuda" else {}))
        return runtime

    @classmethod
    def _start(cls, device: torch.device, plan: Any, timeout_s: float, rdzv_timeout_s: Optional[float]) -> "Runtime":
        world_size = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        if world_size > 1 and not dist.is_initialized():
            if rdzv_timeout_s is None:
                rdzv_timeout_s = _env_float(RDZV_TIMEOUT_ENV) or timeout_s
            start_process_group(device, rank, world_size, timeout_s, rdzv_timeout_s)
        # Ranks are laid out pp × dp_replicate × dp_shard × tp, tp innermost: consecutive ranks share a
        # data-parallel shard only under tensor parallelism.
        tp = plan.tp if plan is not None else 1
        dp_size = plan.data_parallel_size if plan is not None else world_size
        return cls(rank=rank, world_size=world_size, local_rank=_env_int("LOCAL_RANK", 0),
                   local_world_size=_env_int("LOCAL_WORLD_SIZE", world_size), device=device,
                   data_parallel_rank=(rank // tp) % dp_size, data_parallel_size=dp_size)

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

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


def start_process_group(device: torch.device, rank: int, world_size: int, timeout_s: float,
                        rdzv_timeout_s: float) -> None:
    """Meet the other ranks at MASTER_ADDR:MASTER_PORT, then create the default process group.

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
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            **({"device_id": device} if device.type == "cuda" else {}))


def pick_device(accelerator: str, local_rank: int) -> torch.device:
    """``auto`` takes this rank's GPU when there is one, else the CPU.

    A process that sees exactly one GPU (SLURM's ``--gpus-per-task 1`` hides the others) uses it
    whatever its local rank.
    """
    if accelerator not in ("auto", "cpu", "cuda", "gpu"):
        raise ValueError(f"--accelerator {accelerator!r} must be auto, cpu, cuda or gpu")
    want_cuda = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    if want_cuda:
        if not torch.cuda.is_available():
            raise ValueError(f"--accelerator {accelerator} was asked for but no CUDA device is visible")
        count = torch.cuda.device_count()
        index = 0 if count == 1 else local_rank
        if index >= count:
            raise ValueError(f"local rank {local_rank} needs GPU {index} but this process sees {count} "
                             "(CUDA_VISIBLE_DEVICES); start at most one process per visible GPU")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def configure_process(runtime: Optional[Runtime] = None, precision: Any = None) -> None:
    """Per-process settings; spawned workers are fresh interpreters, so every entrypoint calls this.

    ``precision``: the run's :class:`~llmtrain.train.precision.Precision`; float32 matmuls use TF32 where
    it says so (see ``Precision.uses_tf32``).
    """
    import warnings

    if runtime is not None and precision is not None and precision.uses_tf32(runtime.device.type):
        torch.set_float32_matmul_precision("high")

    # Warnings read as one line for people, not as a source listing.
    warnings.formatwarning = lambda message, category, *_: f"warning: {message}\n"
    if runtime is not None and not runtime.is_main:
        # Every rank sees the same configuration: rank 0 says it once. Errors still come from every rank.
        warnings.simplefilter("ignore")
