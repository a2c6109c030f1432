"""Preparation throughput: `llmtrain prepare_data` on a synthetic text corpus, in tokens/s, on every core.

    .venv/bin/python bench/ab/prepare_throughput.py [--megabytes 64] [--repeats 3]
        [--layouts pool threads ranks] [--results out/benchmark/prepare.jsonl]

It writes a corpus of plain-text files of random words (bench/ab/data_throughput.py's, about --megabytes of
text) in a temporary folder and trains the built-in stories' tokenizer once, then prepares the corpus
--repeats times per layout, each into a fresh folder, through the real command line:
- ``pool``: one rank, a spawn pool of one process per core (the default);
- ``threads``: one rank, one process (``--num_workers 1``): the tokenizer's own threads use the cores;
- ``ranks``: ``--devices <cores>`` ranks of one process each (gloo on loopback).
For each it reports the median over the repeats of the tokens/s the command itself measured (from the start
of the work to the manifest) and of the command's whole wall time (interpreter start, imports and the
tokenizer included), and the CPU time over the wall time (cores busy). It prints a table and appends a
JSON line per layout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "ab")]

from data_throughput import write_corpus  # noqa: E402  (a sibling script)

LAYOUTS = {"pool": [], "threads": ["--num_workers", "1"], "ranks": ["--devices", "{cores}", "--num_workers", "1"]}


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def prepare_once(corpus: Path, tokenizer_dir: Path, out_dir: Path, extra: list[str]) -> dict:
    command = [sys.executable, "-m", "llmtrain", "prepare_data", "--data", "TextFiles", "--data.train_data_path",
               str(corpus), "--tokenizer_dir", str(tokenizer_dir), "--out_dir", str(out_dir), *extra]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    wall, cpu = time.perf_counter(), children_cpu_seconds()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    wall, cpu = time.perf_counter() - wall, children_cpu_seconds() - cpu
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    match = re.search(r"this run tokenized ([\d,]+) tokens in ([\d.]+)s", done.stdout)
    assert match is not None, done.stdout
    tokens, work_s = int(match.group(1).replace(",", "")), float(match.group(2))
    # The load average says how much of the machine other work took meanwhile (it changes the times).
    return {"tokens": tokens, "work_s": work_s, "wall_s": wall, "cores_busy": cpu / wall, "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--results", type=Path, default=Path("out/benchmark/prepare.jsonl"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="llmtrain-prepare-"))
    os.environ["LLMTRAIN_CACHE_DIR"] = str(work / "cache")
    records = []
    try:
        from llmtrain.data import BuiltinStories
        from llmtrain.data.tokens import available_cpu_count

        cores = available_cpu_count()
        tokenizer_dir = Path(BuiltinStories().default_tokenizer().checkpoint_dir)
        chars = write_corpus(work / "corpus", args.megabytes)
        for layout in args.layouts:
            extra = [flag.format(cores=cores) for flag in LAYOUTS[layout]]
            runs = []
            for repeat in range(args.repeats):
                runs.append(prepare_once(work / "corpus", tokenizer_dir, work / f"{layout}-{repeat}", extra))
                shutil.rmtree(work / f"{layout}-{repeat}")
            median = {key: statistics.median(run[key] for run in runs) for key in ("work_s", "wall_s", "cores_busy", "load")}
            tokens = runs[0]["tokens"]
            records.append({
                "layout": layout, "flags": " ".join(extra), "corpus_chars": chars, "tokens": tokens, "cores": cores,
                "repeats": args.repeats, "work_s": median["work_s"], "wall_s": median["wall_s"],
                "tokens_per_s": tokens / median["work_s"], "tokens_per_s_wall": tokens / median["wall_s"],
                "cores_busy": median["cores_busy"], "load_average": median["load"], "runs": runs,
                "command": "python bench/ab/prepare_throughput.py " + " ".join(sys.argv[1:]),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            })
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"corpus: {chars / 2**20:,.1f} MiB of text, {records[0]['tokens']:,} tokens; medians of {args.repeats}")
    print(f"{'layout':<8} {'flags':<32} {'work':>8} {'tokens/s':>12} {'whole command':>14} {'tokens/s':>12} "
          f"{'cores busy':>10} {'load':>5}")
    for record in records:
        print(f"{record['layout']:<8} {record['flags'] or '(defaults)':<32} {record['work_s']:>7.1f}s "
              f"{record['tokens_per_s']:>12,.0f} {record['wall_s']:>13.1f}s {record['tokens_per_s_wall']:>12,.0f} "
              f"{record['cores_busy']:>10.2f} {record['load_average']:>5.1f}")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    print(f"appended to {args.results}")


if __name__ == "__main__":
    main()
