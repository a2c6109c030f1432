"""Tokens/s per process of each parallel layout against FSDP at the same world size and global batch.

    .venv/bin/python bench/ab/parallel_layouts.py [--model pythia-160m] [--world 2 4] [--micro_batch_size 2]
        [--seq_len 128] [--steps 5] [--warmup 2] [--results out/benchmark/layouts.jsonl]

For each world size it runs `llmtrain benchmark` (the real pretrain recipe: same loader, parallel setup and
training step as any run) once per layout that fits: FSDP alone, then tensor parallel, pipeline parallel
(each schedule) and tensor × pipeline, all at one global batch: the FSDP run's micro batch × world. The
split layouts have fewer data-parallel ranks, so each gets a larger share; a pipeline splits its share into
--pp_size micro-batches (one per stage in flight, what 1F1B needs).
It prints a table of median step time, tokens/s per process and the ratio to FSDP, and appends every
record to --results. On a CPU box the split layouts are expected to lose: see BENCHMARKS.md for why.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYOUTS = {  # name -> (tp, pp, schedule)
    "fsdp": (1, 1, None),
    "tp": (2, 1, None),
    "pp gpipe": (1, 2, "gpipe"),
    "pp 1f1b": (1, 2, "1f1b"),
    "pp interleaved": (1, 2, "interleaved_1f1b"),
    "tp × pp": (2, 2, "1f1b"),
}


def layouts_for(world: int) -> list[tuple[str, int, int, str | None]]:
    return [(name, tp, pp, schedule) for name, (tp, pp, schedule) in LAYOUTS.items() if world % (tp * pp) == 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="pythia-160m")
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro_batch_size", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--results", type=Path, default=ROOT / "out" / "benchmark" / "layouts.jsonl")
    args = parser.parse_args()
    rows = []
    for world in args.world:
        global_batch = args.micro_batch_size * world  # FSDP's: one micro-batch per rank, no accumulation
        fsdp_rate = None
        for name, tp, pp, schedule in layouts_for(world):
            data_parallel = world // (tp * pp)
            micro = global_batch // (data_parallel * pp)  # a pipeline gets pp micro-batches per step
            command = [sys.executable, "-m", "llmtrain", "benchmark", "--model", args.model, "--devices", str(world),
                       "--tp_size", str(tp), "--pp_size", str(pp), "--micro_batch_size", str(micro),
                       "--global_batch_size", str(global_batch), "--seq_len", str(args.seq_len),
                       "--steps", str(args.steps), "--warmup", str(args.warmup), "--results", str(args.results),
                       "--baseline", "null", *(["--pp_schedule", schedule] if schedule else [])]
            print("$", " ".join(command[1:]), flush=True)
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-2000:], done.stderr[-3000:], sep="\n")
                rows.append((world, name, None, None, None))
                continue
            record = json.loads(args.results.read_text().splitlines()[-1])
            rate = record["tokens_per_sec_per_device"]
            fsdp_rate = fsdp_rate or (rate if name == "fsdp" else None)
            rows.append((world, name, record["step_time_median_s"], rate, rate / fsdp_rate if fsdp_rate else None))
    print(f"\n{'world':>5}  {'layout':<16} {'median step':>12} {'tokens/s/process':>17} {'vs FSDP':>8}")
    for world, name, step, rate, ratio in rows:
        if step is None:
            print(f"{world:>5}  {name:<16} {'failed':>12}")
            continue
        print(f"{world:>5}  {name:<16} {step:>11.2f}s {rate:>17,.0f} {ratio:>7.2f}x")


if __name__ == "__main__":
    main()
