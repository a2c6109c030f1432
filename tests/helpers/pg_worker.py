"""Ranks for tests/distributed/test_process_groups.py: process groups set up as llmtrain sets them up, on gloo (CPU).

``dist_worker.launch(world_size, suites, workdir, script=pg_worker.py)`` starts the ranks; for each suite of
``suites`` ("a+b"), the suite's first ranks meet through ``llmtrain.distributed.runtime.start_process_group`` (the
rendezvous every multi-rank run takes) with the backend, collective timeout and world size the suite names, run the
suite, and rank 0 saves the results to ``workdir/SUITE.pt``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import dist_worker
from llmtrain.args import FSDPArgs
from llmtrain.distributed.runtime import Runtime, start_process_group

TWO_BACKENDS = "cpu:gloo,cuda:gloo"
"""A default group of two backends, as --fsdp.cpu_offload gives a GPU run (``cuda:nccl,cpu:gloo``), that gloo
serves on a CPU."""

HSDP_OFFLOAD = FSDPArgs(sharding_strategy="HYBRID_SHARD", cpu_offload=True)
SHORT_TIMEOUT_S = 3.0
"""The slow-load suite's --dist_timeout: any collective that waits longer for another rank fails."""
SLOW_READ_S = 8.0
"""How long the last rank's reads of a sharded checkpoint take there: well past SHORT_TIMEOUT_S."""


def suite_offload_mesh(runtime: Runtime, workdir: Path) -> dict:
    """HYBRID_SHARD with CPU offload on 2 "nodes" of 2 ranks (a 2 × 2 mesh) over a default group of two backends:
    8 steps of the tiny model, and one all-reduce of a host tensor over each mesh dimension's group."""
    plan = dist_worker.layout(runtime, fsdp=HSDP_OFFLOAD, num_nodes=2)
    mesh = plan.build_mesh()
    sums = {}
    for name in mesh.mesh_dim_names:
        value = torch.tensor([float(runtime.rank)])
        dist.all_reduce(value, group=mesh.get_group(name))
        sums[name] = value.item()
    result = dist_worker.train(runtime, fsdp=HSDP_OFFLOAD, num_nodes=2)
    result.update(default_backend=dist.get_backend(), bound_device=dist.group.WORLD.bound_device_id,
                  mesh_dims=dict(zip(mesh.mesh_dim_names, mesh.shape)),
                  dim_backends={name: dist.get_backend(mesh.get_group(name)) for name in mesh.mesh_dim_names},
                  rank_sums=runtime.all_gather_object(sums))
    return result


def suite_slow_load(runtime: Runtime, workdir: Path) -> dict:
    """FULL_SHARD on 2 ranks resumes the single process's sharded step-4 checkpoint and trains on to step 8, with a
    collective timeout of SHORT_TIMEOUT_S, while the last rank's reads of the shards take SLOW_READ_S."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    read_data, load = FileSystemReader.read_data, dcp.load
    timings: dict[str, float] = {}

    def slow_read_data(self, plan, planner):  # a shared filesystem, slow for one rank: the reads, then waits
        if runtime.rank == runtime.world_size - 1:
            time.sleep(SLOW_READ_S)
        return read_data(self, plan, planner)

    def timed_load(*args, **kwargs):
        started = time.perf_counter()
        try:
            return load(*args, **kwargs)
        finally:
            timings["load_s"] = time.perf_counter() - started

    FileSystemReader.read_data, dcp.load = slow_read_data, timed_load
    try:
        result = dist_worker.train(runtime, fsdp=FSDPArgs(sharding_strategy="FULL_SHARD"),
                                   resume_from=workdir / "single" / "sharded" / "step-00000004")
    finally:
        FileSystemReader.read_data, dcp.load = read_data, load
    result["load_s"] = timings["load_s"]
    return result


SUITES = {"offload_mesh": (suite_offload_mesh, TWO_BACKENDS, dist_worker.COLLECTIVE_TIMEOUT_S, 4),
          "slow_load": (suite_slow_load, "gloo", SHORT_TIMEOUT_S, 2)}
"""Each suite: its function, the backend and collective timeout of its process group, and its world size."""


def worker_main(suites: str, workdir: Path) -> None:
    """One rank: for each suite of ``suites`` ("a+b": a, then b, in the same processes), start the suite's process
    group over its first ranks (the other ranks skip it), run the suite, save rank 0's results, and end the group;
    then leave without the interpreter's teardown (dist_worker.worker_main's ending).

    A group after the first meets on a port that rank 0 picked (dist_worker.end_group_for_the_next)."""
    code = 0
    try:
        torch.set_num_threads(1)
        rank = int(os.environ["RANK"])
        names = suites.split("+")
        for index, name in enumerate(names):
            run, backend, timeout_s, world_size = SUITES[name]
            if rank >= world_size:
                continue
            if index:
                dist_worker.meet_for(workdir, name, world_size)
            else:
                os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
            start_process_group(torch.device("cpu"), rank, world_size, timeout_s, rdzv_timeout_s=120.0,
                                backend=backend)
            runtime = Runtime.from_env("cpu", timeout_s=timeout_s)  # the group above, already started
            results = run(runtime, workdir)
            if runtime.is_main:
                torch.save(results, workdir / f"{name}.pt")
            if index + 1 < len(names):
                dist_worker.end_group_for_the_next(runtime, workdir, names[index + 1])
            else:
                runtime.barrier()
                dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: with gloo a rank may abort in interpreter teardown after training; skip the teardown.
    os._exit(code)


if __name__ == "__main__":
    worker_main(sys.argv[1], Path(sys.argv[2]))
