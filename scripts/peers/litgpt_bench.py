"""Tokens/s of LitGPT's pretraining step on the same architecture, random weights and tokens.

Run with a venv that has litgpt (torch pinned as llmtrain's):

    /work/peers/litgpt-venv/bin/python scripts/peers/litgpt_bench.py llama-debug --precision 32-true \
        --micro_batch_size 8 --seq_len 256 --steps 20 --warmup 5 [--compile]

The step is LitGPT's `pretrain.fit` inner loop: Fabric-wrapped GPT, `chunked_cross_entropy`,
`fabric.backward`, gradient clipping at 1.0, AdamW built as pretrain.py builds it (fused only on CUDA),
one optimizer step per micro batch. `litgpt pretrain` always compiles the model; `--compile` does too.
Models: llama-debug and llama-20m (their llmtrain shapes, written as LitGPT Configs) or any LitGPT name (pythia-70m).
"""

import argparse
import json
import statistics
import time

import lightning as L
import torch
from litgpt import GPT, Config
from litgpt.pretrain import initialize_weights
from litgpt.utils import chunked_cross_entropy

LLAMA_DEBUG = dict(name="llama-debug", block_size=512, vocab_size=4096, padding_multiple=64, n_layer=4, n_head=4,
                   n_embd=256, n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
                   norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=640, norm_eps=1e-5,
                   rope_base=10000)
# llmtrain's llama-20m (llmtrain/config.py): the same fields at another size, with an 8k vocabulary.
LLAMA_20M = {**LLAMA_DEBUG, "name": "llama-20m", "block_size": 2048, "vocab_size": 8192, "n_layer": 8, "n_head": 6,
             "n_embd": 384, "intermediate_size": 1024}
OWN_SHAPES = {"llama-debug": LLAMA_DEBUG, "llama-20m": LLAMA_20M}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true", "bf16-mixed"])
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--results", default="peers.jsonl")
    args = parser.parse_args()

    from importlib.metadata import version

    fabric = L.Fabric(accelerator="cpu", devices=1, precision=args.precision)
    fabric.seed_everything(0)
    config = Config(**OWN_SHAPES[args.model]) if args.model in OWN_SHAPES else Config.from_name(args.model)
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    model.max_seq_length = args.seq_len
    if args.compile:
        model = torch.compile(model)
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95),
                                  fused=fabric.device.type == "cuda")
    optimizer = fabric.setup_optimizers(optimizer)
    generator = torch.Generator().manual_seed(0)
    total = args.warmup + args.steps
    data = torch.randint(0, config.vocab_size, (total, args.micro_batch_size, args.seq_len + 1), generator=generator)
    times = []
    for step in range(total):
        start = time.perf_counter()
        input_ids, targets = data[step, :, :-1].contiguous(), data[step, :, 1:].contiguous()
        logits = model(input_ids)
        loss = chunked_cross_entropy(logits, targets)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    median = statistics.median(times[args.warmup:])
    record = {"tool": "litgpt", "version": version("litgpt"),
              "torch": torch.__version__, "model": args.model, "precision": args.precision, "compile": args.compile,
              "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len, "steps": args.steps,
              "step_time_median_s": median, "tokens_per_sec": args.micro_batch_size * args.seq_len / median,
              "threads": torch.get_num_threads(), "final_loss": float(loss)}
    print(json.dumps(record))
    with open(args.results, "a") as handle:
        handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
