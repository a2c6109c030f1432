"""The forward and backward of a training step, per operator and input shape: which GEMM, which elementwise pass.

    .venv/bin/python bench/ab/profile_shapes.py --model llama-20m --precision 32-true [--top 30]

The model and its loss are the recipes' (``GPT(..., labels=...)``, the fused loss) with random weights and tokens,
micro batch 8 x 256 by default, in a process that keeps freed host memory as training does; no optimizer. After 3
warm-up steps, 3 steps run under torch.profiler with shapes recorded. Prints a Markdown table: self time per step,
calls per step, operator, input shapes, and for matrix products the GFLOP/s they ran at. ``bench/ab/profile_step.py``
gives the same step per phase and per operator group, through the recipe.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STEPS = 3


def matmul_flops(name: str, shapes: list) -> float:
    """FLOPs of one call of a matrix product with these input shapes (0 for anything else)."""
    if name in ("aten::mm", "aten::bmm"):
        a, b = shapes[0], shapes[1]
    elif name in ("aten::addmm", "aten::baddbmm"):
        a, b = shapes[1], shapes[2]
    else:
        return 0.0
    return 2.0 * math.prod(a) * b[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-debug")
    parser.add_argument("--precision", default="32-true", choices=("32-true", "bf16-true"))
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from llmtrain.config import Config
    from llmtrain.distributed.host_memory import keep_freed_host_memory
    from llmtrain.model import GPT

    keep_freed_host_memory()
    torch.manual_seed(0)
    model = GPT(Config.from_name(args.model))
    model.init_weights()
    model = model.to(torch.bfloat16 if args.precision == "bf16-true" else torch.float32).train()
    tokens = torch.randint(0, model.config.vocab_size, (args.micro_batch_size, args.seq_len + 1))

    def step() -> None:
        model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(STEPS):
            step()
    rows = sorted(prof.key_averages(group_by_input_shape=True), key=lambda row: -row.self_cpu_time_total)
    total_ms = sum(row.self_cpu_time_total for row in rows) / 1e3 / STEPS
    print(f"{args.model} {args.precision}, micro batch {args.micro_batch_size} x {args.seq_len}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads: {total_ms:.1f} ms of operator self time per step\n")
    print("| ms per step | calls | operator | input shapes | GFLOP/s |\n| --- | --- | --- | --- | --- |")
    for row in rows[:args.top]:
        ms = row.self_cpu_time_total / 1e3 / STEPS
        calls = row.count // STEPS
        flops = matmul_flops(row.key, row.input_shapes) * calls
        rate = f"{flops / ms / 1e6:.0f}" if flops else ""
        print(f"| {ms:.2f} | {calls} | `{row.key}` | {row.input_shapes} | {rate} |")


if __name__ == "__main__":
    main()
