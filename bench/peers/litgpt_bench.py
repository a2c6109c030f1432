"""Tokens/s of LitGPT's pretraining or fine-tuning step on the same architecture, random weights and tokens.

Run with a venv that has litgpt (torch pinned as llmtrain's):

    /work/peers/litgpt-venv/bin/python bench/peers/litgpt_bench.py llama-debug --precision 32-true \
        --micro_batch_size 8 --seq_len 256 --steps 20 --warmup 5 [--compile]

The step is LitGPT's `pretrain.fit` inner loop: Fabric-wrapped GPT, `chunked_cross_entropy`,
`fabric.backward`, gradient clipping at 1.0, AdamW built as pretrain.py builds it (fused only on CUDA),
one optimizer step per micro batch. `litgpt pretrain` always compiles the model; `--compile` does too.

`--recipe finetune_full` / `finetune_lora` times the step of LitGPT's `finetune/full.py` / `finetune/lora.py`
(the sequence is its own label, shifted by one; LoRA's model from `litgpt.lora` with `mark_only_lora_as_trainable`
and its logits in chunks of 128 rows of the head, AdamW as `instantiate_torch_optimizer("AdamW")` builds it)
on the same random weights the pretraining bench starts from, plus gradient clipping at --max_norm 1.0 (LitGPT's
fine-tuning scripts do not clip; 0 leaves it out as they do). LoRA flags as llmtrain's (finetune_args.py).
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
from litgpt.utils import chunked_cross_entropy, instantiate_torch_optimizer

from finetune_args import add_finetune_flags, lora_settings

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
    parser.add_argument("--max_norm", type=float, default=1.0, help="gradient clipping; 0: none")
    parser.add_argument("--results", default="peers.jsonl")
    add_finetune_flags(parser)
    args = parser.parse_args()
    lora = lora_settings(args)

    from importlib.metadata import version

    fabric = L.Fabric(accelerator="cpu", devices=1, precision=args.precision)
    fabric.seed_everything(0)
    model = build_model(fabric, args.model, args.recipe, lora)
    model.max_seq_length = args.seq_len
    vocab_size = model.config.vocab_size
    if args.compile:
        model = torch.compile(model)
    model = fabric.setup(model)
    if args.recipe == "pretrain":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95),
                                      fused=fabric.device.type == "cuda")
    else:  # NOTE: every parameter, as finetune/lora.py passes them; the frozen ones have no gradient to step
        optimizer = instantiate_torch_optimizer("AdamW", model.parameters())
    optimizer = fabric.setup_optimizers(optimizer)
    generator = torch.Generator().manual_seed(0)
    total = args.warmup + args.steps
    data = torch.randint(0, vocab_size, (total, args.micro_batch_size, args.seq_len + 1), generator=generator)
    times = []
    for step in range(total):
        start = time.perf_counter()
        loss = step_loss(model, data[step], args.recipe)
        fabric.backward(loss)
        if args.max_norm:
            fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    median = statistics.median(times[args.warmup:])
    record = {"tool": "litgpt", "version": version("litgpt"), "recipe": args.recipe, "lora": lora,
              "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "max_norm": args.max_norm,
              "torch": torch.__version__, "model": args.model, "precision": args.precision, "compile": args.compile,
              "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len, "steps": args.steps,
              "step_time_median_s": median, "tokens_per_sec": args.micro_batch_size * args.seq_len / median,
              "threads": torch.get_num_threads(), "final_loss": float(loss)}
    print(json.dumps(record))
    with open(args.results, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def build_model(fabric: L.Fabric, name: str, recipe: str, lora: dict) -> torch.nn.Module:
    """GPT as pretrain.py builds and initialises it, or as the fine-tuning scripts build it before loading a
    checkpoint (its own init, our random base); with ``lora``, LitGPT's LoRA GPT with only the adapters trainable."""
    from litgpt import lora as litgpt_lora

    kind, config_class = (litgpt_lora.GPT, litgpt_lora.Config) if lora else (GPT, Config)
    fields = lora or {}
    config = config_class(**OWN_SHAPES[name], **fields) if name in OWN_SHAPES else config_class.from_name(name, **fields)
    with fabric.init_module(empty_init=recipe == "pretrain"):
        model = kind(config)
    if recipe == "pretrain":
        initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    if lora:
        litgpt_lora.mark_only_lora_as_trainable(model)
    return model


def step_loss(model: torch.nn.Module, tokens: torch.Tensor, recipe: str) -> torch.Tensor:
    """The loss of one micro batch of ``tokens`` (micro batch, seq_len + 1) as LitGPT's script for ``recipe`` computes it."""
    if recipe == "pretrain":  # pretrain.py: seq_len inputs, the next seq_len tokens as targets
        return chunked_cross_entropy(model(tokens[:, :-1].contiguous()), tokens[:, 1:].contiguous())
    input_ids = tokens[:, :-1].contiguous()  # fine-tuning: a sequence is its own label, shifted inside the step
    if recipe == "finetune_full":  # finetune/full.py
        return chunked_cross_entropy(model(input_ids)[..., :-1, :], input_ids[..., 1:])
    logits = model(input_ids, lm_head_chunk_size=128)  # finetune/lora.py
    logits[-1] = logits[-1][..., :-1, :]
    return chunked_cross_entropy(logits, input_ids[..., 1:])


if __name__ == "__main__":
    main()
