#!/usr/bin/env python
"""A mixture of experts against a dense model of equal active parameters (moe-debug against llama-debug), one
thread, in interleaved rounds, so that a neighbour's load slows both alike.

    .venv/bin/python bench/ab/moe_vs_dense.py steps --pairs 20
    OMP_NUM_THREADS=1 .venv/bin/python bench/ab/moe_vs_dense.py benchmark --rounds 3 --steps 8 --warmup 2 \
        --out bench/results/moe_vs_dense.jsonl

- ``steps``: both models in one process (the recipes' GPT and fused loss, AdamW, random weights and tokens), two
  training steps of one then two of the other, alternating which goes first; finer on a shared machine.
- ``benchmark``: `llmtrain benchmark` of each (the whole recipe: loader, loop, logging), rounds A B, B A, ...

Prints, per model, the median tokens/s and MFU (by active FLOPs: llmtrain.flops counts the router, the token's k
experts and the shared ones, not the experts it skips; over the one-thread matmul peak measured in the same
process), and the median of the rounds' ratios.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def run(model: str, args: argparse.Namespace, results: Path) -> dict:
    """One `llmtrain benchmark` of ``model``; its record (the last line it appended to ``results``)."""
    with tempfile.TemporaryDirectory(prefix="moe-vs-dense-") as out_dir:
        command = [sys.executable, "-m", "llmtrain", "benchmark", "--model", model, "--baseline", "null",
                   "--micro_batch_size", str(args.micro_batch_size), "--seq_len", str(args.seq_len),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--out_dir", out_dir,
                   "--results", str(results)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return json.loads(results.read_text().splitlines()[-1])


def in_process(args: argparse.Namespace) -> None:
    """Alternating training steps of both models in this process, one thread."""
    import torch

    from llmtrain.config import Config
    from llmtrain.flops import active_parameters, flops_per_token, measure_matmul_peak, num_parameters
    from llmtrain.model import GPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    steps, configs = {}, {}
    for name in (args.moe, args.dense):
        config = configs[name] = Config.from_name(name)
        model = GPT(config)
        model.init_weights()
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, config.vocab_size, (args.micro_batch_size, args.seq_len + 1))

        def step(model=model, optimizer=optimizer, tokens=tokens) -> None:
            loss = model(tokens[:, :-1], labels=tokens[:, 1:]) / tokens[:, 1:].numel()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[name] = step
    for step in steps.values():  # warm-up: allocator, optimizer state
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for pair in range(args.pairs):
        order = list(steps) if pair % 2 == 0 else list(reversed(steps))
        for name in order:
            for _ in range(2):
                started = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - started)
    peak, size = measure_matmul_peak(torch.float32)
    tokens_per_step = args.micro_batch_size * args.seq_len
    print(f"{torch.get_num_threads()} thread, fp32, micro batch {args.micro_batch_size} × seq {args.seq_len}, "
          f"{args.pairs} pairs of 2 steps each; matmul peak {peak / 1e9:.1f} GFLOP/s (n = {size})")
    for name, config in configs.items():
        median = statistics.median(times[name])
        flops = flops_per_token(config, args.seq_len)
        print(f"{name}: {num_parameters(config) / 1e6:.2f}M parameters, {active_parameters(config) / 1e6:.2f}M "
              f"active, {flops / 1e6:.1f} MFLOP per token; median step {median * 1e3:.0f} ms, "
              f"{tokens_per_step / median:,.0f} tokens/s, MFU {tokens_per_step / median * flops / peak:.1%}")
    ratio = statistics.median(times[args.dense]) / statistics.median(times[args.moe])
    print(f"{args.moe} / {args.dense} tokens/s: {ratio:.2f} (ratio of the median steps)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("steps", "benchmark"))
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--moe", default="moe-debug")
    parser.add_argument("--dense", default="llama-debug")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "moe_vs_dense.jsonl")
    args = parser.parse_args()
    if args.mode == "steps":
        return in_process(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records: dict[str, list[dict]] = {args.moe: [], args.dense: []}
    for index in range(args.rounds):
        order = [args.moe, args.dense] if index % 2 == 0 else [args.dense, args.moe]
        for model in order:
            record = run(model, args, args.out)
            records[model].append(record)
            print(f"round {index + 1} {model}: {record['tokens_per_sec']:,.0f} tokens/s, MFU {record['mfu']:.1%}, "
                  f"load {record['load_average']}", flush=True)
    for model, rows in records.items():
        first = rows[0]
        print(f"{model}: {first['parameters'] / 1e6:.2f}M parameters, {first['active_parameters'] / 1e6:.2f}M active, "
              f"{first['flops_per_token'] / 1e6:.1f} MFLOP per token; median tokens/s "
              f"{statistics.median(r['tokens_per_sec'] for r in rows):,.0f}, median MFU "
              f"{statistics.median(r['mfu'] for r in rows):.1%}, median step "
              f"{statistics.median(r['step_time_median_s'] for r in rows) * 1e3:.0f} ms")
    ratios = [moe["tokens_per_sec"] / dense["tokens_per_sec"]
              for moe, dense in zip(records[args.moe], records[args.dense])]
    print(f"{args.moe} / {args.dense} tokens/s: median {statistics.median(ratios):.2f} "
          f"(rounds: {', '.join(f'{ratio:.2f}' for ratio in ratios)})")


if __name__ == "__main__":
    main()
