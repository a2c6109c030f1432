"""Interleaved A/B of the training step with the fused linear cross-entropy against the generic chunked path.

    .venv/bin/python bench/ab/loss_ab.py [--model llama-debug] [--precision 32-true|bf16-true] [--steps 12]

One process, one model, the same batch: steps alternate between the two loss paths (the generic one is
what a head that is not a plain nn.Linear takes: each chunk under activation checkpointing, log_softmax +
nll_loss), so drift in the machine's speed hits both alike. A step is forward, backward, gradient
clipping and a fused AdamW update, as in training. Prints the median step time of each and their ratio.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from llmtrain.config import Config  # noqa: E402
from llmtrain.model import GPT  # noqa: E402


class GenericHead(torch.nn.Linear):
    """A Linear that is not exactly nn.Linear, so llmtrain.loss.head_loss_sum takes its generic path."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-debug")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"])
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = Config.from_name(args.model)
    model = GPT(config)
    if args.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    shape = (args.micro_batch_size, args.seq_len)
    tokens, labels = torch.randint(0, config.vocab_size, shape), torch.randint(0, config.vocab_size, shape)

    def step(fused: bool) -> float:
        model.lm_head.__class__ = torch.nn.Linear if fused else GenericHead
        start = time.perf_counter()
        (model(tokens, labels=labels) / tokens.numel()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for _ in range(2):  # warm-up, both paths
        step(True), step(False)
    times = {True: [], False: []}
    for _ in range(args.steps):
        for fused in (True, False):
            times[fused].append(step(fused))
    fused, generic = statistics.median(times[True]), statistics.median(times[False])
    print(f"{args.model} {args.precision}, micro batch {args.micro_batch_size} x {args.seq_len}, "
          f"{args.steps} steps each, interleaved")
    print(f"fused linear cross-entropy  {fused * 1e3:8.1f} ms per step (median)")
    print(f"generic chunked path        {generic * 1e3:8.1f} ms per step (median)")
    print(f"speed-up                    {generic / fused:8.2f}x")


if __name__ == "__main__":
    main()
