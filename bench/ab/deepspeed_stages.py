"""Tokens/s and peak memory of each DeepSpeed ZeRO strategy against FSDP, on 2 processes of this machine.

    .venv/bin/python bench/ab/deepspeed_stages.py [--model pythia-70m] [--devices 2] [--micro_batch_size 4]
        [--seq_len 128] [--steps 6] [--warmup 2] [--rounds 2] [--results out/benchmark/deepspeed.jsonl]

Every round runs `llmtrain benchmark` (the real pretrain recipe) once per strategy, in the same order: FSDP
(FULL_SHARD), then deepspeed_stage_1, _2, _2_offload, _3, _3_offload, all at the same micro and global batch
(on a machine without a GPU not the _offload ones, which a CPU run refuses: they would save nothing there).
It prints the median over rounds of each one's tokens/s per process, its ratio to FSDP's, and rank 0's peak
memory (on a CPU: the process's peak resident set, which includes building the model and torch itself), and
appends every record to --results. Needs the deepspeed extra (./scripts/install.sh installs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = ("fsdp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3",
              "deepspeed_stage_3_offload")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="pythia-70m")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--results", type=Path, default=ROOT / "out" / "benchmark" / "deepspeed.jsonl")
    args = parser.parse_args()
    strategies = STRATEGIES if torch.cuda.is_available() else [name for name in STRATEGIES if "offload" not in name]
    measured: dict[str, list[dict]] = {name: [] for name in strategies}
    for round_index in range(args.rounds):
        for strategy in strategies:
            command = [sys.executable, "-m", "llmtrain", "benchmark", "--model", args.model, "--devices",
                       str(args.devices), "--strategy", strategy, "--micro_batch_size", str(args.micro_batch_size),
                       "--seq_len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--results", str(args.results), "--baseline", "null"]
            print(f"round {round_index + 1}: $", " ".join(command[1:]), flush=True)
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-2000:], done.stderr[-3000:], sep="\n")
                continue
            measured[strategy].append(json.loads(args.results.read_text().splitlines()[-1]))
    fsdp = statistics.median(r["tokens_per_sec_per_device"] for r in measured["fsdp"]) if measured["fsdp"] else None
    print(f"\n{'strategy':<27} {'median step':>12} {'tokens/s/process':>17} {'vs FSDP':>8} {'peak RSS rank 0':>16}")
    for strategy, records in measured.items():
        if not records:
            print(f"{strategy:<27} {'failed':>12}")
            continue
        rate = statistics.median(r["tokens_per_sec_per_device"] for r in records)
        step = statistics.median(r["step_time_median_s"] for r in records)
        memory = statistics.median(r["peak_memory_gb"] for r in records)
        ratio = f"{rate / fsdp:.2f}x" if fsdp else "-"
        print(f"{strategy:<27} {step:>11.3f}s {rate:>17,.0f} {ratio:>8} {memory:>13.2f} GB")


if __name__ == "__main__":
    main()
