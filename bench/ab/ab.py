"""Interleaved A/B of one benchmark under two settings: what a change is worth, measured, not assumed.

    .venv/bin/python bench/ab/ab.py --rounds 3 --a LLMTRAIN_HOST_MALLOC=default --b "" -- --model llama-debug

Each round runs ``llmtrain benchmark ARGS`` once with A's environment variables and once with B's (the order
alternates from round to round, so a drift in the machine's speed hits both alike), then prints each side's
tokens/s per device per round, their medians and B's median over A's. ``--a``/``--b`` take space-separated
NAME=VALUE pairs (empty: the environment as it is). Every run's record is appended to ``--results``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse_env(text: str) -> dict[str, str]:
    pairs = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: {item!r} is not NAME=VALUE")
        pairs[name] = value
    return pairs


def run(args: list[str], env: dict[str, str], results: Path) -> dict:
    before = results.read_text().count("\n") if results.exists() else 0
    command = [str(ROOT / ".venv" / "bin" / "llmtrain"), "benchmark", *args, "--baseline", "null",
               "--results", str(results)]
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    lines = results.read_text().splitlines()
    assert len(lines) == before + 1, "the benchmark appended no record"
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--a", default="", help="A's environment: NAME=VALUE ...")
    parser.add_argument("--b", default="", help="B's environment: NAME=VALUE ...")
    parser.add_argument("--results", type=Path, default=Path(tempfile.gettempdir()) / "ab.jsonl")
    parser.add_argument("benchmark_args", nargs=argparse.REMAINDER, help="-- then `llmtrain benchmark` flags")
    args = parser.parse_args()
    bench = args.benchmark_args[1:] if args.benchmark_args[:1] == ["--"] else args.benchmark_args
    sides = {"A": parse_env(args.a), "B": parse_env(args.b)}
    speeds: dict[str, list[float]] = {"A": [], "B": []}
    for round_index in range(args.rounds):
        order = ["A", "B"] if round_index % 2 == 0 else ["B", "A"]
        for side in order:
            record = run(bench, sides[side], args.results)
            speeds[side].append(record["tokens_per_sec_per_device"])
            print(f"round {round_index + 1} {side}: {record['tokens_per_sec_per_device']:,.0f} tokens/s, "
                  f"MFU {record['mfu']:.1%}, peak RSS {record['peak_memory_gb']:.2f} GB", flush=True)
    medians = {side: statistics.median(values) for side, values in speeds.items()}
    print(f"\nbenchmark {' '.join(bench)}; commit {record['commit']}; {args.rounds} rounds")
    print("| side | environment | tokens/s per device (rounds) | median |\n| --- | --- | --- | --- |")
    for side in ("A", "B"):
        print(f"| {side} | {args.a if side == 'A' else args.b or '(as is)'} | "
              f"{', '.join(f'{v:,.0f}' for v in speeds[side])} | {medians[side]:,.0f} |")
    print(f"B / A: {medians['B'] / medians['A']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
