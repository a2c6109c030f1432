"""Loader throughput from prepared shards (`--data Prepared`), the cost of a mixture, and the order at 3T tokens.

    .venv/bin/python bench/ab/loader_throughput.py [--shards 32] [--shard_tokens 1048576] [--batches 2000]
        [--micro_batch_size 8] [--seq_len 2048] [--results out/benchmark/data.jsonl]

It writes two prepared folders of random token ids (--shards shards of --shard_tokens each, in the layout of
llmtrain.data.manifest; the loader's speed does not depend on what the tokens say) in a temporary folder,
then draws --batches micro-batches, each through the training loader as a run does (prefetched in a
background thread), from:
1. `--data Prepared` on one folder;
2. `--data Mixture` of both folders, 0.7 / 0.3;
and reports tokens/s of each. Last it builds the sample order of a 3T-token corpus (8M-token shards, windows
of --seq_len + 1) without any file, and reports how long the order takes to build and to answer a batch, and
the memory it holds. It prints a table and appends a JSON line.

The shards were just written, so they are read from the page cache: this measures the loader, not the disk.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "ab"))

from data_throughput import add_loader_arguments, append_record, loader_tokens_per_s  # noqa: E402  (after the path is set)

CORPUS_TOKENS = 3 * 10**12
"""The projection's corpus: TinyLlama's 3T tokens."""
CORPUS_SHARD_TOKENS = 8 * 2**20


def write_folder(root: Path, shards: int, shard_tokens: int, vocab_size: int, seed: int) -> Path:
    """A prepared folder of random ids under a manifest that a tokenizer with ``fingerprint`` "benchmark" made."""
    from llmtrain.data import manifest as layout

    rng = np.random.default_rng(seed)
    listed = []
    for index in range(shards):
        name = layout.shard_name("train", index, 0)
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        rng.integers(0, vocab_size, shard_tokens, dtype=np.uint16).tofile(root / name)
        listed.append(layout.Shard(name, shard_tokens, ""))
    layout.write_manifest(root, layout.Manifest("benchmark", "none", vocab_size, "uint16", shard_tokens,
                                                "random ids", {"train": layout.Split(listed, shards)}))
    return root


class BenchmarkTokenizer:
    """What connect() asks of a tokenizer, matching the manifests written above."""

    fingerprint, checkpoint_dir = "benchmark", "none"


def tokens_per_s(data, args: argparse.Namespace) -> float:
    data.validate()
    data.connect(BenchmarkTokenizer(), args.micro_batch_size, args.seq_len, seed=1)
    data.setup()
    return loader_tokens_per_s(data.train_dataloader(), args)


def corpus_order(seq_len: int, micro_batch_size: int) -> dict:
    """Build the order of a 3T-token corpus and draw batches from the middle of it: seconds and memory."""
    from llmtrain.data.prepared import ShardOrder

    shards = CORPUS_TOKENS // CORPUS_SHARD_TOKENS
    counts = np.full(shards, (CORPUS_SHARD_TOKENS - 1) // seq_len)
    tracemalloc.start()
    started = time.perf_counter()
    order = ShardOrder(counts, seed=1, group=8)
    positions = np.arange(micro_batch_size) + order.samples_per_epoch // 2
    order.indices(positions)
    first_s = time.perf_counter() - started
    started = time.perf_counter()
    for step in range(1, 101):
        order.indices(positions + step * micro_batch_size)
    batch_s = (time.perf_counter() - started) / 100
    memory = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"corpus_tokens": CORPUS_TOKENS, "corpus_shards": int(shards), "corpus_samples": order.samples_per_epoch,
            "order_first_batch_s": first_s, "order_batch_s": batch_s, "order_peak_memory_mb": memory / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--shard_tokens", type=int, default=2**20)
    add_loader_arguments(parser, seq_len=2048)
    args = parser.parse_args()

    from llmtrain.data import Mixture, MixtureSource, Prepared

    work = Path(tempfile.mkdtemp(prefix="llmtrain-loader-"))
    try:
        first = write_folder(work / "first", args.shards, args.shard_tokens, 32000, seed=0)
        second = write_folder(work / "second", args.shards, args.shard_tokens, 32000, seed=1)
        one = tokens_per_s(Prepared(first), args)
        mixed = tokens_per_s(Mixture([MixtureSource(first, 0.7), MixtureSource(second, 0.3)]), args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    corpus = corpus_order(args.seq_len, args.micro_batch_size)

    record = {
        "shards": args.shards, "shard_tokens": args.shard_tokens, "loader_batches": args.batches,
        "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len,
        "prepared_tokens_per_s": one, "mixture_tokens_per_s": mixed, "mixture_cost": one / mixed - 1, **corpus,
        "command": "python bench/ab/loader_throughput.py " + " ".join(sys.argv[1:]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(f"prepared folder   {one:,.0f} tokens/s ({args.batches} batches of {args.micro_batch_size} x "
          f"{args.seq_len}, {args.shards} shards of {args.shard_tokens:,} tokens)")
    print(f"mixture 0.7/0.3   {mixed:,.0f} tokens/s ({100 * record['mixture_cost']:+.1f}% time per token)")
    print(f"order of 3T       {corpus['corpus_shards']:,} shards, {corpus['corpus_samples']:,} samples: first batch "
          f"{corpus['order_first_batch_s']:.2f} s, then {1e3 * corpus['order_batch_s']:.3f} ms a batch, "
          f"peak {corpus['order_peak_memory_mb']:.1f} MiB")
    append_record(args.results, record)


if __name__ == "__main__":
    main()
