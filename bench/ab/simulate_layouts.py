"""The layouts tests/plan/test_simulate.py checks, simulated once more with their numbers printed as Markdown tables.

For BENCHMARKS.md and tutorials/parallelism.md: per simulated rank, torch's measured peak beside the dry run's estimate,
and each mesh dimension's bytes per step, measured beside estimated. No GPU needed:

    .venv/bin/python bench/ab/simulate_layouts.py            # every layout, about a minute on 2 CPU cores
    .venv/bin/python bench/ab/simulate_layouts.py 70b        # the layouts whose name contains "70b"
"""

from __future__ import annotations

import sys
import time

from llmtrain.recipes import simulate
from llmtrain.args import FSDPArgs, TrainArgs
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan

SEQ_LEN = 2048
GiB = 2**30

# name: (model, devices, nodes, micro batch, accumulation, tp, pp, sharding strategy)
LAYOUTS = {
    "tiny-llama 8x4 HYBRID_SHARD": ("tiny-llama-1.1b", 8, 4, 4, 1, 1, 1, None),
    "tiny-llama 8x4 FULL_SHARD": ("tiny-llama-1.1b", 8, 4, 4, 1, 1, 1, "FULL_SHARD"),
    "tiny-llama dp 8 x tp 4": ("tiny-llama-1.1b", 8, 4, 4, 1, 4, 1, None),
    "tiny-llama 1 node dp 2 x tp 4": ("tiny-llama-1.1b", 8, 1, 2, 1, 4, 1, None),
    "tiny-llama pp 2 x dp 4 x tp 4": ("tiny-llama-1.1b", 8, 4, 2, 2, 4, 2, None),
    "llama-3-8b 64 ranks tp 8": ("llama-3-8b", 8, 8, 1, 1, 8, 1, None),
    "llama-3-70b 512 ranks pp 8 x dp 8 x tp 8": ("llama-3-70b", 8, 64, 1, 8, 8, 8, None),
}


def layout(model: str, devices: int, nodes: int, micro: int, accumulation: int, tp: int, pp: int,
           strategy: str | None):
    config = Config.from_name(model)
    data_parallel = devices * nodes // (tp * pp)
    train = TrainArgs(global_batch_size=data_parallel * micro * accumulation, micro_batch_size=micro,
                      max_seq_length=SEQ_LEN)
    plan = ParallelPlan.resolve(devices=devices, num_nodes=nodes, train=train, precision="bf16-mixed",
                                fsdp=FSDPArgs(sharding_strategy=strategy), device_type="cuda", accelerator="cuda",
                                gpu="H100", tp=tp, pp=pp)
    return config, plan, train


def main(pattern: str = "") -> None:
    memory = ["| layout | rank | measured peak | estimate | estimate / measured | simulated in |",
              "|---|---|---|---|---|---|"]
    traffic = ["| layout | rank | mesh dimension | measured per step | estimate | collectives |", "|---|---|---|---|---|---|"]
    for name, spec in LAYOUTS.items():
        if pattern.lower() not in name.lower():
            continue
        config, plan, train = layout(*spec)
        started = time.perf_counter()
        reports = simulate.simulate(config, plan, seq_len=SEQ_LEN, optimizer_spec="AdamW", train=train,
                                    checkpoint=False)
        seconds = time.perf_counter() - started
        for report in reports:
            where = f"{report.rank} ({report.why})"
            memory.append(f"| {name} | {where} | {report.peak_total / GiB:.2f} GiB | {report.estimate.total / GiB:.2f} GiB "
                          f"| {report.agreement:.2f} | {seconds:.0f} s |")
            if report is not reports[0] and report.step == reports[0].step:
                continue  # the same traffic as the layout's first rank
            for dim, ops in sorted(report.step.items()):
                sent = sum(found.bytes for found in ops.values())
                expected = report.comm_estimate.get(dim)
                what = ", ".join(f"{found.count} {op.rstrip('_')}" for op, found in sorted(ops.items()))
                traffic.append(f"| {name} | {report.rank} | {dim} | {sent / GiB:.3f} GiB | "
                               f"{'-' if expected is None else f'{expected / GiB:.3f} GiB'} | {what} |")
        print(f"{name}: {seconds:.1f}s", file=sys.stderr, flush=True)
    print("\n".join(memory))
    print()
    print("\n".join(traffic))


if __name__ == "__main__":
    main(*sys.argv[1:])
