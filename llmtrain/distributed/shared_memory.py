"""FSDP's all-gathers and reduce-scatters between the processes of one CPU host, through shared memory.

gloo moves every byte between two processes on one host through loopback TCP: the sender's kernel copies it in,
the receiver's copies it out, in chunks, on the cores that also compute. An all-gather of a pythia-160m Block's
27 MiB took 27.9 ms that way and 8.7 ms through shared memory (FSDP's copy out of the buffer included), where each
process writes its shard once and FSDP reads the others' once (BENCHMARKS.md, "FSDP through shared memory").

Each process group gets two slots of shared memory per kind of collective (a file in /dev/shm that every process
maps and rank 0 unlinks at once, so nothing is left behind), used in turn. A collective writes this rank's part
into the current slot, waits at a barrier of the group (gloo's), and reads the others' parts. A rank writes a slot
again two collectives later, after a barrier that every rank reaches only once it has read the slot: so one
barrier per collective is enough. The slots grow, collectively, to the largest collective asked for.

Where shared memory cannot be had (another host in the group, /dev/shm too small: ``posix_fallocate`` says so
before anything is written), every rank of the group falls back to gloo's collectives, together, and rank 0 says
so on stderr.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (  # NOTE: private in torch, as FSDP2's comm API is
    DefaultAllGather,
    DefaultReduceScatter,
)

SHARED_MEMORY_DIR = "/dev/shm"
_GRANULE = 2**20  # slots grow in whole MiB


def pair_bytes(nbytes: int) -> int:
    """What a collective of ``nbytes`` maps: two slots (used in turn), each grown to whole MiB."""
    return 2 * (-(-nbytes // _GRANULE) * _GRANULE)

calls = {"all_gather": 0, "reduce_scatter": 0}
"""Collectives that went through shared memory in this process, per kind (tests count them)."""

mapped = {"all-gather": 0, "reduce-scatter": 0}
"""The largest pair of slots this process mapped, in bytes, per kind (tests compare it with the dry run's figure,
``llmtrain.plan.memory.host_collective_bytes``)."""


def enabled() -> bool:
    """``LLMTRAIN_HOST_COLLECTIVES=0`` keeps gloo's collectives (for an A/B); 1, the default, uses shared memory."""
    value = os.environ.get("LLMTRAIN_HOST_COLLECTIVES", "1")
    if value not in ("0", "1"):
        raise ValueError(f"LLMTRAIN_HOST_COLLECTIVES={value!r}: use 1 (the default: FSDP's collectives between "
                         "processes of one CPU host go through shared memory) or 0 (through gloo)")
    return value == "1" and os.path.isdir(SHARED_MEMORY_DIR)


class _Slots:
    """Two slots of shared memory for one process group and one kind of collective."""

    def __init__(self, group: dist.ProcessGroup, kind: str) -> None:
        self.group, self.kind = group, kind
        self.slot_bytes = 0
        self.memory: Optional[torch.Tensor] = None  # uint8, two slots
        self.turn = 0
        self.unavailable = False

    def next(self, nbytes: int) -> Optional[torch.Tensor]:
        """The next slot's first ``nbytes`` bytes (uint8), or None where the group cannot share memory."""
        if self.unavailable or (nbytes > self.slot_bytes and not self._grow(nbytes)):
            return None
        start = (self.turn % 2) * self.slot_bytes
        self.turn += 1
        return self.memory[start:start + nbytes]

    def _grow(self, nbytes: int) -> bool:
        """Map two slots of at least ``nbytes`` each; collective over the group. False (on every rank) where any
        rank could not: the group then keeps gloo's collectives for this kind."""
        slot_bytes = pair_bytes(nbytes) // 2
        path = None
        if self.group.rank() == 0:
            path = _create(2 * slot_bytes, self.kind)
        paths = [path]
        dist.broadcast_object_list(paths, group=self.group, group_src=0)
        memory, error = None, None
        if paths[0] is not None:
            try:
                memory = torch.from_file(paths[0], shared=True, size=2 * slot_bytes, dtype=torch.uint8)
            except (OSError, RuntimeError) as e:  # another host: the file is not there
                error = f"{type(e).__name__}: {e}"
        errors = [None] * self.group.size()
        dist.all_gather_object(errors, error if paths[0] is not None else "not enough room", group=self.group)
        if self.group.rank() == 0 and paths[0] is not None:
            os.unlink(paths[0])  # every rank has it mapped (or gave up): the memory lives as long as the mappings
        if any(errors):
            if self.group.rank() == 0:
                reason = next(e for e in errors if e)
                print(f"llmtrain: FSDP's {self.kind}s go through gloo: no shared memory for two slots of "
                      f"{slot_bytes / 2**20:,.0f} MiB in {SHARED_MEMORY_DIR} ({reason})", file=sys.stderr, flush=True)
            self.unavailable, self.memory, self.slot_bytes = True, None, 0
            return False
        self.memory, self.slot_bytes = memory, slot_bytes
        mapped[self.kind] = max(mapped[self.kind], 2 * slot_bytes)
        return True


def _create(nbytes: int, kind: str) -> Optional[str]:
    """A file of ``nbytes`` in /dev/shm with its pages reserved, or None where there is not enough room."""
    try:
        fd, path = tempfile.mkstemp(prefix=f"llmtrain-{kind}-", dir=SHARED_MEMORY_DIR)
    except OSError:
        return None
    try:
        # NOTE: a tmpfs file merely truncated to size would deliver SIGBUS on the first write past the space left;
        # posix_fallocate reserves the pages now, or fails with ENOSPC.
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)
    return path


def _in(tensor: torch.Tensor, region: Optional[torch.Tensor]) -> bool:
    return region is not None and tensor.data_ptr() == region.data_ptr()


class HostAllGather(DefaultAllGather):
    """FSDP2's all-gather of a unit's shards within ``group``, through shared memory (module docstring).

    FSDP asks its comm for the output buffer, copies this rank's shard into it, then calls the comm: so the buffer
    handed out is the shared slot itself, and the collective is a barrier. FSDP copies the unit's weights out of the
    buffer before it asks for the next one (its next all-gather, here two turns later, waits for that). Gloo's
    all-gather where the group cannot share memory."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._slots = _Slots(group, "all-gather")
        self._handed_out: Optional[torch.Tensor] = None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(size)
        slot = self._slots.next(numel * dtype.itemsize) if device.type == "cpu" else None
        self._handed_out = slot.view(dtype).view(size) if slot is not None else None
        return self._handed_out if slot is not None else super().allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        shared, self._handed_out = _in(output_tensor, self._handed_out) and group is self.group, None
        if not shared:
            return super().__call__(output_tensor, input_tensor, group, async_op)
        if not _in(input_tensor, output_tensor[group.rank() * input_tensor.numel():]):
            output_tensor.view(group.size(), -1)[group.rank()].copy_(input_tensor.view(-1))
        dist.barrier(group=group)  # every rank's shard is in the slot
        calls["all_gather"] += 1
        return None  # done: FSDP waits only on a Work


class HostReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter (sum or average) of a unit's gradients within ``group``, through shared memory.

    FSDP asks its comm for the input buffer, copies the unit's gradients into it, asks for the output buffer, then
    calls the comm. The input handed out is this rank's part of the shared slot; after the barrier each rank sums
    every rank's copy of its own shard, in rank order (the same on every rank). ``fallback``'s reduce-scatter where
    the group cannot share memory, or for an operation other than a sum or an average."""

    def __init__(self, group: dist.ProcessGroup, fallback: DefaultReduceScatter) -> None:
        self.group = group
        self._slots = _Slots(group, "reduce-scatter")
        self._fallback = fallback
        self._handed_out: Optional[torch.Tensor] = None  # this rank's part of the slot
        self._slot: Optional[torch.Tensor] = None  # the whole slot, (world, numel)
        self._input_next = True  # FSDP asks for the input buffer, then for the output

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        asks_input, self._input_next = self._input_next, not self._input_next
        if not asks_input or device.type != "cpu":
            return super().allocate(size, dtype=dtype, device=device)
        numel, world = math.prod(size), self.group.size()
        slot = self._slots.next(world * numel * dtype.itemsize)
        if slot is None:
            self._handed_out = self._slot = None
            return super().allocate(size, dtype=dtype, device=device)
        self._slot = slot.view(dtype).view(world, numel)
        self._handed_out = self._slot[self.group.rank()].view(size)
        return self._handed_out

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op,
                 async_op: bool = False):
        average = op == dist.ReduceOp.AVG
        shared = (_in(input_tensor, self._handed_out) and group is self.group and not async_op
                  and (average or op == dist.ReduceOp.SUM) and output_tensor.dtype == input_tensor.dtype)
        slot, self._handed_out, self._slot, self._input_next = self._slot, None, None, True
        if not shared:
            return self._fallback(output_tensor, input_tensor, group, op, async_op)
        rank, world = group.rank(), group.size()
        dist.barrier(group=group)  # every rank's gradients are in the slot
        parts = slot.view(world, world, -1)[:, rank]  # [writer, element]: every rank's copy of this rank's shard
        output = output_tensor.view(-1)
        output.copy_(parts[0])
        for writer in range(1, world):
            output.add_(parts[writer])
        if average:
            output.div_(world)
        calls["reduce_scatter"] += 1
        return None
