"""The floor a training step cannot go below with torch's matrix products: the step's GEMMs alone, replayed.

    .venv/bin/python bench/ab/gemm_floor.py --model llama-20m --precision 32-true [--peer NAME=TOKENS_PER_SEC ...]

Records every matrix product (``mm``, ``addmm``, ``bmm``, ``baddbmm``) of one forward and backward of the recipes'
model and loss (random weights and tokens, micro batch 8 x 256 by default, freed host memory kept as training keeps
it), with its shapes, strides, dtype and scalars. Then it times, interleaved over ``--rounds``:
- the step itself (forward and backward, no optimizer);
- the same products replayed in the step's order on operands that stay in cache (each product on its own buffers,
  allocated once): what the GEMMs cost if nothing else ran and no operand were ever evicted;
- the same, each product on fresh buffers written just before it (cold outputs, as in a step).

Everything a step does besides its products (norms, RoPE, the activation, softmax, the loss's passes, the
optimizer) is left out, so no training code that calls these products can beat ``tokens / replayed time``. With
``--peer`` it prints that ceiling as a multiple of a peer's measured tokens/s: where it is below a target ratio, the
target is out of reach on this machine for any code that uses torch's CPU GEMMs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_ab

PRODUCTS = ("mm", "addmm", "bmm", "baddbmm")


class TensorSpec(NamedTuple):
    shape: tuple
    stride: tuple
    dtype: object


def product_flops(name: str, tensors: list) -> float:
    """FLOPs of one product from its tensor arguments or their specs (the bias or accumulator of addmm/baddbmm
    first; an ``out=`` tensor is not among them)."""
    a, b = tensors[-2], tensors[-1]
    return 2.0 * math.prod(a.shape) * b.shape[-1]


def materialize(value):
    """A tensor of the spec's shape, strides and dtype, freshly written; anything else as it is."""
    import torch

    if not isinstance(value, TensorSpec):
        return value
    return torch.empty_strided(value.shape, value.stride, dtype=value.dtype).normal_()


def record_products(step: Callable[[], object]) -> list[tuple]:
    """Every matrix product ``step()`` runs, in order: (the aten overload, its arguments and keyword arguments
    with each tensor replaced by its TensorSpec)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    def spec(value):
        return TensorSpec(tuple(value.shape), value.stride(), value.dtype) if isinstance(value, torch.Tensor) else value

    recorded = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket.__name__ in PRODUCTS:
                recorded.append((func, [spec(a) for a in args], {k: spec(v) for k, v in kwargs.items()}))
            return func(*args, **kwargs)

    with Record():
        step()
    return recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-20m")
    parser.add_argument("--precision", default="32-true", choices=("32-true", "bf16-true"))
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=TOKENS_PER_SEC",
                        help="a peer's measured tokens/s, to print the ceiling as a multiple of it")
    args = parser.parse_args()
    peers = {}
    for item in args.peer:
        name, _, value = item.partition("=")
        try:
            peers[name] = float(value)
        except ValueError:
            parser.error(f"--peer {item!r}: expected NAME=TOKENS_PER_SEC, e.g. litgpt=1328")

    import torch

    from step_ab import random_model

    model = random_model(args.model, args.precision, args.threads).train()
    tokens = torch.randint(0, model.config.vocab_size, (args.micro_batch_size, args.seq_len + 1))
    n_tokens = args.micro_batch_size * args.seq_len

    def step() -> float:
        start = time.perf_counter()
        model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for _ in range(3):
        step()
    recorded = record_products(step)
    if not recorded:
        sys.exit("no matrix product was recorded: nothing to replay")
    flops = sum(product_flops(op.overloadpacket.__name__, [a for a in args_ if isinstance(a, TensorSpec)])
                for op, args_, _ in recorded)
    hot = [(op, [materialize(a) for a in args_], {k: materialize(v) for k, v in kwargs.items()})
           for op, args_, kwargs in recorded]

    per_kind: dict[str, list[float]] = {}  # replayed in cache: each round's time per product kind

    def replay_hot() -> float:
        kinds: dict[str, float] = {}
        start = time.perf_counter()
        for op, operands, kwargs in hot:
            begin = time.perf_counter()
            op(*operands, **kwargs)
            kind = op.overloadpacket.__name__
            kinds[kind] = kinds.get(kind, 0.0) + time.perf_counter() - begin
        total = time.perf_counter() - start
        for kind, seconds in kinds.items():
            per_kind.setdefault(kind, []).append(seconds)
        return total

    def replay_cold() -> float:
        total = 0.0
        for op, args_, kwargs in recorded:
            operands = [materialize(a) for a in args_]  # written just now: in cache only as far as they fit
            named = {k: materialize(v) for k, v in kwargs.items()}
            start = time.perf_counter()
            op(*operands, **named)
            total += time.perf_counter() - start
        return total

    times = {"step": [], "GEMMs replayed, operands in cache": [], "GEMMs replayed, fresh operands": []}
    replay_hot(), replay_cold()
    per_kind.clear()
    for _ in range(args.rounds):
        times["step"].append(step())
        times["GEMMs replayed, operands in cache"].append(replay_hot())
        times["GEMMs replayed, fresh operands"].append(replay_cold())
    print(f"{args.model} {args.precision}, micro batch {args.micro_batch_size} x {args.seq_len}, {args.threads} threads, "
          f"{len(recorded)} products ({flops / 1e9:.1f} GFLOP) per forward and backward, medians of {args.rounds} rounds:")
    for name, values in times.items():
        median = statistics.median(values)
        line = f"  {name}: {median * 1e3:.1f} ms, {n_tokens / median:,.0f} tokens/s, {flops / median / 1e9:.0f} GFLOP/s"
        if name != "step":
            line += "".join(f"; {n_tokens / median / rate:.2f}x {peer}" for peer, rate in peers.items())
        print(line)
    step_median = statistics.median(times["step"])
    print("  in cache, per kind: " + ", ".join(
        f"{kind} {statistics.median(values) * 1e3:.1f} ms ({sum(1 for op, _, _ in recorded if op.overloadpacket.__name__ == kind)} calls)"
        for kind, values in sorted(per_kind.items())))
    print(f"  the step over its GEMMs in cache: {step_median / statistics.median(times['GEMMs replayed, operands in cache']):.3f}; "
          f"over its GEMMs on fresh operands: {step_median / statistics.median(times['GEMMs replayed, fresh operands']):.3f}")


if __name__ == "__main__":
    main()
