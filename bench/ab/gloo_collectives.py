"""FSDP's collectives over gloo on one host: what a unit's all-gather and reduce-scatter cost, and the alternative.

    GLOO_SOCKET_IFNAME=lo .venv/bin/torchrun --nproc_per_node 2 bench/ab/gloo_collectives.py [--numel 7000000 1000000]

For each buffer size (fp32 elements of a whole unit; the default is a pythia-160m Block and a smaller one), times
``all_gather_single`` (FSDP2's all-gather), ``reduce_scatter_single`` (FSDP2's default reduce-scatter) and an
in-place ``all_reduce`` plus the copy of this rank's slice, both averaging as FSDP2 asks
(``parallelize.reduce_scatter_by_all_reduce``), and both through shared memory as one host's FSDP runs them
(``llmtrain.distributed.shared_memory``, with the copy FSDP makes anyway into or out of the shared slot), in
rotation over ``--repeats`` rounds, one thread per process; rank 0 prints the medians in milliseconds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

from llmtrain.distributed.shared_memory import HostAllGather, HostReduceScatter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, nargs="+", default=[7_000_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    for numel in args.numel:
        numel -= numel % world
        shard, gathered = torch.randn(numel // world), torch.empty(numel)
        full, slice_ = torch.randn(numel), torch.empty(numel // world)

        def all_reduce_and_slice() -> None:
            dist.all_reduce(full, op=dist.ReduceOp.AVG)
            slice_.copy_(full.narrow(0, rank * (numel // world), numel // world))

        group = dist.group.WORLD
        host_gather, host_reduce = HostAllGather(group), HostReduceScatter(group, fallback=None)

        def shared_all_gather() -> None:  # as FSDP2 calls its comm: ask for the output, copy the shard in, call
            output = host_gather.allocate((numel,), dtype=torch.float32, device=torch.device("cpu"))
            output.view(world, -1)[rank].copy_(shard)
            host_gather(output, output.view(world, -1)[rank], group)
            gathered.copy_(output)  # FSDP's copy-out into the unsharded weights

        def shared_reduce_scatter() -> None:
            buffer = host_reduce.allocate((numel,), dtype=torch.float32, device=torch.device("cpu"))
            buffer.copy_(full)  # FSDP's copy-in of the gradients
            out = host_reduce.allocate((numel // world,), dtype=torch.float32, device=torch.device("cpu"))
            host_reduce(out, buffer, group, dist.ReduceOp.AVG)

        ops = {"all_gather_single": lambda: dist.all_gather_single(gathered, shard),
               "reduce_scatter_single": lambda: dist.reduce_scatter_single(slice_, full, op=dist.ReduceOp.AVG),
               "all_reduce + slice": all_reduce_and_slice,
               "shared-memory all-gather (+ copy-out)": shared_all_gather,
               "shared-memory reduce-scatter (+ copy-in)": shared_reduce_scatter}
        times: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(args.repeats):
            for name, op in ops.items():
                dist.barrier()
                start = time.perf_counter()
                op()
                times[name].append(time.perf_counter() - start)
        if rank == 0:
            print(f"{world} processes, {numel * 4 / 2**20:.1f} MiB: " + ", ".join(
                f"{name} {statistics.median(values) * 1e3:.1f} ms" for name, values in times.items()), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
