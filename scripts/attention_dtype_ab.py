"""Interleaved A/B inside one process: training attention in bfloat16 against float32 (the rule of
``llmtrain.model.attention_dtype``) in a bfloat16 model on the CPU, forward and backward of the whole model.

    .venv/bin/python scripts/attention_dtype_ab.py --model llama-20m --seq_len 256 --micro_batch_size 8 --pairs 20

Each pair times two steps with the native bfloat16 attention and two with float32 attention, in alternating order,
so that a drift in the machine's speed hits both; prints the medians and their ratio. The model and its
loss are the recipes' (``GPT(..., labels=...)``, the fused loss), with random weights and tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-debug")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from llmtrain import model as model_module
    from llmtrain.config import Config
    from llmtrain.distributed.host_memory import keep_freed_host_memory

    torch.set_num_threads(args.threads)
    keep_freed_host_memory()
    torch.manual_seed(0)
    model = model_module.GPT(Config.from_name(args.model)).to(torch.bfloat16)
    model.init_weights()
    model.train()
    tokens = torch.randint(0, model.config.vocab_size, (args.micro_batch_size, args.seq_len + 1))

    def step() -> float:
        start = time.perf_counter()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    sides = {"bfloat16": 0, "float32": args.seq_len}  # the rule's length bound: 0 turns float32 attention off
    times: dict[str, list[float]] = {side: [] for side in sides}
    step()  # warm-up
    for pair in range(args.pairs):
        for side in (sides if pair % 2 else reversed(list(sides))):
            model_module.CPU_FLOAT32_ATTENTION_MAX_SEQ = sides[side]
            times[side].extend(step() for _ in range(2))
    medians = {side: statistics.median(values) * 1e3 for side, values in times.items()}
    print(f"{args.model} bf16, micro batch {args.micro_batch_size} x {args.seq_len}, {args.pairs} pairs, "
          f"{args.threads} threads: step median " + ", ".join(f"attention in {side} {ms:.1f} ms"
                                                             for side, ms in medians.items())
          + f"; bfloat16 / float32 = {medians['bfloat16'] / medians['float32']:.3f}")


if __name__ == "__main__":
    main()
