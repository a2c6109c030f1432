"""A/B of the weight-initialisation schemes of llmtrain.model on the README's debug pretraining.

    .venv/bin/python bench/ab/init_ab.py [--steps 300] [--seeds 1 2] [--schemes gpt2 neox] [--parallel 2]

Each (scheme, seed) pair runs `llmtrain pretrain --config config_hub/pretrain/debug.yaml` for --steps steps in
its own process with one thread (--parallel of them at a time, so pairs share the machine alike), the scheme set
as llmtrain.model.DEFAULT_INIT in that process. The same seed gives both schemes the same data order. Prints
each run's validation losses and, per scheme, the mean final validation loss over the seeds.
"""

import argparse
import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker(scheme: str, seed: int, steps: int, out_dir: Path) -> None:
    sys.path.insert(0, str(ROOT))
    import llmtrain.model
    from llmtrain.cli import main

    llmtrain.model.DEFAULT_INIT = scheme
    main(["pretrain", "--config", str(ROOT / "config_hub/pretrain/debug.yaml"), "--train.max_steps", str(steps),
          "--train.lr_warmup_steps", str(min(30, steps // 10)), "--train.save_interval", str(steps),
          "--eval.interval", str(max(steps // 4, 1)), "--eval.max_iters", "32", "--seed", str(seed),
          "--out_dir", str(out_dir)])


def val_losses(out_dir: Path) -> dict[int, float]:
    with open(out_dir / "metrics.csv") as handle:
        return {int(row["step"]): float(row["val_loss"]) for row in csv.DictReader(handle) if row.get("val_loss")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--schemes", nargs="+", default=["gpt2", "neox"])
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--out_dir", type=Path, default=ROOT / "out" / "init_ab")
    parser.add_argument("--worker", nargs=2, metavar=("SCHEME", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        scheme, seed = args.worker
        return worker(scheme, int(seed), args.steps, args.out_dir / f"{scheme}-{seed}")

    runs = [(scheme, seed) for seed in args.seeds for scheme in args.schemes]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pending, running = list(runs), []
    while pending or running:
        while pending and len(running) < args.parallel:
            scheme, seed = pending.pop(0)
            log = open(args.out_dir.with_name(f"{args.out_dir.name}-{scheme}-{seed}.log"), "w")
            command = [sys.executable, __file__, "--steps", str(args.steps), "--out_dir", str(args.out_dir),
                       "--worker", scheme, str(seed)]
            running.append((scheme, seed, subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)))
        scheme, seed, process = running.pop(0)
        if process.wait() != 0:
            raise SystemExit(f"{scheme} seed {seed} failed: see {args.out_dir.name}-{scheme}-{seed}.log")

    finals: dict[str, list[float]] = {scheme: [] for scheme in args.schemes}
    for scheme, seed in runs:
        losses = val_losses(args.out_dir / f"{scheme}-{seed}")
        finals[scheme].append(losses[max(losses)])
        print(f"{scheme:>6} seed {seed}: " + ", ".join(f"step {s} {v:.3f}" for s, v in sorted(losses.items())))
    for scheme, values in finals.items():
        print(f"{scheme:>6}: final validation loss {statistics.mean(values):.4f} (mean of {len(values)} seeds: "
              f"{', '.join(f'{v:.4f}' for v in values)})")


if __name__ == "__main__":
    main()
