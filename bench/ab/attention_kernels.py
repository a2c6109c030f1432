"""Training attention alone, forward and backward: CPU flash attention (SDPA) against block attention.

    .venv/bin/python bench/ab/attention_kernels.py --heads 4 --groups 2 --seq_lens 128,256,512,1024 --blocks 32,64

Each sequence length runs with 2,048 tokens per batch (batch = 2048 / T), head size 64, inputs laid out as the
model hands them over (transposed views of (B, T, heads, hs)) and the output as the model takes it, (B, T, nh * hs).
Prints medians in ms over rounds that alternate the kernels, and each kernel's error: the largest relative distance
(norm of the difference over the norm) of the output and the three input gradients from float64 SDPA.
``--dtype bfloat16`` runs each kernel on bfloat16 inputs (what a bfloat16 model on a CPU with AMX tiles runs), and
adds each on float32 copies of them, cast back ("on float32"), as the model does where it upcasts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmtrain.attention import block_causal_attention  # noqa: E402
from llmtrain.distributed.host_memory import keep_freed_host_memory  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--seq_lens", default="128,256,512,1024")
    parser.add_argument("--blocks", default="32,64")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_host_memory()  # as a training process does: freed blocks are reused, not faulted in again
    dtype = getattr(torch, args.dtype)
    hs = 64

    def sdpa(q, k, v):
        B, _, T, _ = q.shape
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(B, T, -1)

    def upcast(kernel):
        return lambda q, k, v: kernel(q.float(), k.float(), v.float()).to(q.dtype)

    kernels = {"sdpa": sdpa}
    for block in (int(b) for b in args.blocks.split(",")):
        kernels[f"blocks of {block}"] = lambda q, k, v, block=block: block_causal_attention(q, k, v, block)
    if dtype != torch.float32:
        kernels.update({f"{name} on float32": upcast(kernel) for name, kernel in kernels.items()})
    for T in (int(t) for t in args.seq_lens.split(",")):
        B = max(1, 2048 // T)
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(B, T, args.heads, hs, generator=generator, dtype=torch.float64).transpose(1, 2)
        k, v = (torch.randn(B, T, args.groups, hs, generator=generator, dtype=torch.float64).transpose(1, 2)
                for _ in "kv")
        grad = torch.randn(B, T, args.heads * hs, generator=generator, dtype=torch.float64)

        def run(kernel, dtype=dtype):
            inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
            out = kernel(*inputs)
            out.backward(grad.to(dtype))
            return [out] + [t.grad for t in inputs]

        exact = run(sdpa, torch.float64)
        errors = {name: max(((a.double() - b).norm() / b.norm()).item() for a, b in zip(run(kernel), exact))
                  for name, kernel in kernels.items()}
        times = {name: [] for name in kernels}
        for _ in range(args.rounds):
            for name, kernel in kernels.items():
                start = time.perf_counter()
                run(kernel)
                times[name].append(time.perf_counter() - start)
        medians = "  ".join(f"{name} {statistics.median(t[3:]) * 1e3:.2f}" for name, t in times.items())
        worst = "  ".join(f"{name} {error:.1e}" for name, error in errors.items())
        print(f"T={T} B={B} heads {args.heads}/{args.groups} {args.dtype}: {medians} ms; error {worst}", flush=True)


if __name__ == "__main__":
    main()
