"""Data throughput: tokenizing a text corpus (cores used, cache reuse) and the memory-mapped loader's tokens/s.

    .venv/bin/python bench/ab/data_throughput.py [--megabytes 64] [--batches 2000] [--micro_batch_size 8]
        [--seq_len 256] [--results out/benchmark/data.jsonl]

It writes a synthetic corpus of plain-text files (random words, about --megabytes of text) in a temporary
folder, then, each in a fresh cache directory:
1. tokenizes it through `TextFiles` (the `--data TextFiles` module) with the built-in stories' tokenizer and
   every core, and reports characters/s, tokens/s and the CPU time over the wall time (cores in use,
   tokenizer threads and worker processes counted);
2. prepares the same data again, as a restarted run does: the cache entry is reused, nothing is tokenized;
3. draws --batches micro-batches from the training loader (random windows of the memory-mapped tokens,
   prefetched in a background thread) and reports tokens/s, to compare with what training consumes
   (`llmtrain benchmark`).
It prints a table and appends a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the tokenizing worker processes)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def write_corpus(folder: Path, megabytes: float, files: int = 16, seed: int = 0) -> int:
    """Plain-text files of random words from a 5,000-word vocabulary; returns the characters written."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    folder.mkdir(parents=True)
    per_file, total = int(megabytes * 2**20 / files), 0
    for index in range(files):
        lines, size = [], 0
        while size < per_file:
            line = " ".join(rng.choices(words, k=rng.randint(8, 20))) + ".\n"
            lines.append(line)
            size += len(line)
        (folder / f"part{index:03d}.txt").write_text("".join(lines))
        total += size
    return total


def add_loader_arguments(parser: argparse.ArgumentParser, seq_len: int) -> None:
    """The flags of a loader measurement (bench/ab/loader_throughput.py has them too)."""
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=seq_len)
    parser.add_argument("--results", type=Path, default=Path("out/benchmark/data.jsonl"))


def loader_tokens_per_s(train_loader, args: argparse.Namespace) -> float:
    """Input tokens/s of --batches micro-batches drawn as training draws them (the prefetch thread running)."""
    loader = iter(train_loader)
    next(loader)  # the prefetch thread starts
    wall = time.perf_counter()
    for _ in range(args.batches):
        batch = next(loader)
    loader_s = time.perf_counter() - wall
    assert batch["input_ids"].shape == (args.micro_batch_size, args.seq_len)
    return args.batches * args.micro_batch_size * args.seq_len / loader_s


def append_record(results: Path, record: dict) -> None:
    results.parent.mkdir(parents=True, exist_ok=True)
    with open(results, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    print(f"appended to {results}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=64)
    add_loader_arguments(parser, seq_len=256)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="llmtrain-data-"))
    os.environ["LLMTRAIN_CACHE_DIR"] = str(work / "cache")  # a fresh cache: the first prepare tokenizes
    try:
        from llmtrain.data import BuiltinStories, TextFiles
        from llmtrain.data.tokens import available_cpu_count

        tokenizer = BuiltinStories().default_tokenizer()  # trained once, cached under the fresh cache dir
        chars = write_corpus(work / "corpus", args.megabytes)

        def prepared() -> TextFiles:
            data = TextFiles(work / "corpus", val_split_fraction=0.01)
            data.connect(tokenizer, args.micro_batch_size, args.seq_len)
            data.prepare_data()
            data.setup()
            return data

        wall, cpu = time.perf_counter(), cpu_seconds()
        data = prepared()
        tokenize_s, tokenize_cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        tokens = int(data._train_tokens.size + (data._val_tokens.size if data._val_tokens is not None else 0))

        wall = time.perf_counter()
        prepared()
        cached_s = time.perf_counter() - wall

        loader_rate = loader_tokens_per_s(data.train_dataloader(), args)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    record = {
        "corpus_chars": chars, "corpus_tokens": tokens, "cores": available_cpu_count(),
        "tokenize_s": tokenize_s, "tokenize_chars_per_s": chars / tokenize_s,
        "tokenize_tokens_per_s": tokens / tokenize_s,
        "tokenize_cores_used": tokenize_cpu / tokenize_s, "cached_prepare_s": cached_s,
        "loader_batches": args.batches, "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len,
        "loader_tokens_per_s": loader_rate,
        "command": "python bench/ab/data_throughput.py " + " ".join(sys.argv[1:]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(f"corpus            {chars / 2**20:,.1f} MiB of text, {tokens:,} tokens")
    print(f"tokenize          {tokenize_s:,.1f} s: {record['tokenize_chars_per_s'] / 2**20:,.2f} MiB/s, "
          f"{record['tokenize_tokens_per_s']:,.0f} tokens/s, {record['tokenize_cores_used']:.2f} of "
          f"{record['cores']} cores busy")
    print(f"prepare again     {cached_s:.3f} s (cache reused)")
    print(f"loader            {record['loader_tokens_per_s']:,.0f} tokens/s "
          f"({args.batches} batches of {args.micro_batch_size} x {args.seq_len})")
    append_record(args.results, record)


if __name__ == "__main__":
    main()
