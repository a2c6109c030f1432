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
Models: llama-debug and llama-20m (their llmtrain shapes, written as LitGPT Configs), a JSON file of Config fields
(side_by_side.py writes llmtrain's zoo entry as one; fields LitGPT's Config lacks are left out) or any LitGPT name.

`--device cuda` runs on the GPU (the step timed up to a synchronize; peak memory is torch.cuda.max_memory_allocated,
on CPU the process's peak RSS). `--quantize bnb.nf4` (with `--recipe finetune_lora`: QLoRA) keeps the frozen base
in bitsandbytes layers through Fabric's BitsandbytesPrecision, as `litgpt finetune_lora --quantize` does.
"""

import argparse
import dataclasses
import json
import resource
import statistics
import time
from pathlib import Path

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
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quantize", choices=["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8-training"])
    parser.add_argument("--results", default="peers.jsonl")
    add_finetune_flags(parser)
    args = parser.parse_args()
    lora = lora_settings(args)
    if args.quantize and not lora:
        raise SystemExit("--quantize quantizes the frozen base of --recipe finetune_lora (QLoRA)")

    from importlib.metadata import version

    fabric = L.Fabric(accelerator=args.device, devices=1, **precision_flags(args.precision, args.quantize))
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
    elif args.quantize:  # finetune/lora.py under BitsandbytesPrecision: paged AdamW, a StableEmbedding
        optimizer = bnb_optimizer_and_embedding(model)
    else:  # NOTE: every parameter, as finetune/lora.py passes them; the frozen ones have no gradient to step
        optimizer = instantiate_torch_optimizer("AdamW", model.parameters())
    optimizer = fabric.setup_optimizers(optimizer)
    generator = torch.Generator().manual_seed(0)
    total = args.warmup + args.steps
    data = torch.randint(0, vocab_size, (total, args.micro_batch_size, args.seq_len + 1), generator=generator)
    times = []
    for step in range(total):
        tokens = data[step].to(fabric.device)
        synchronize(fabric.device)
        start = time.perf_counter()
        loss = step_loss(model, tokens, args.recipe)
        fabric.backward(loss)
        if args.max_norm:
            fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        synchronize(fabric.device)
        times.append(time.perf_counter() - start)
    median = statistics.median(times[args.warmup:])
    record = {"tool": "litgpt", "version": version("litgpt"), "recipe": args.recipe, "lora": lora,
              "quantize": args.quantize, "device": args.device, "peak_memory_gb": peak_memory_gb(fabric.device),
              "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "max_norm": args.max_norm,
              "torch": torch.__version__, "model": args.model, "precision": args.precision, "compile": args.compile,
              "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len, "steps": args.steps,
              "step_time_median_s": median, "tokens_per_sec": args.micro_batch_size * args.seq_len / median,
              "threads": torch.get_num_threads(), "final_loss": float(loss)}
    if Path(args.model).suffix == ".json":
        record["model"] = json.loads(Path(args.model).read_text())["name"]
    print(json.dumps(record))
    with open(args.results, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def precision_flags(precision: str, quantize: str) -> dict:
    """Fabric's precision, or with ``quantize`` the bitsandbytes plugin in its place, as finetune/lora.py makes it."""
    if not quantize:
        return {"precision": precision}
    from lightning.fabric.plugins import BitsandbytesPrecision

    if "mixed" in precision:
        raise SystemExit(f"--quantize {quantize} with --precision {precision}: LitGPT refuses mixed precision there")
    dtype = {"bf16-true": torch.bfloat16, "32-true": torch.float32}[precision]
    return {"plugins": BitsandbytesPrecision(quantize.removeprefix("bnb."), dtype), "precision": None}


def bnb_optimizer_and_embedding(model: torch.nn.Module) -> torch.optim.Optimizer:
    """What finetune/lora.py does after setting up a quantized model: bitsandbytes' PagedAdamW over every parameter
    (``instantiate_bnb_optimizer``), and the token embedding swapped for bitsandbytes' StableEmbedding."""
    from bitsandbytes.nn import StableEmbedding
    from litgpt.utils import instantiate_bnb_optimizer

    optimizer = instantiate_bnb_optimizer("AdamW", model.parameters())
    old_embedding = model.transformer.wte
    model.transformer.wte = StableEmbedding(old_embedding.num_embeddings, old_embedding.embedding_dim)
    with torch.no_grad():
        model.transformer.wte.weight.copy_(old_embedding.weight)
    model.transformer.wte = model.transformer.wte.to(device=old_embedding.weight.device,
                                                     dtype=old_embedding.weight.dtype)
    return optimizer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gb(device: torch.device) -> float:
    """The step's peak: allocated CUDA memory on a GPU, the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def config_fields(name: str, config_class: type) -> dict:
    """``name``'s shape: our own entries, or a JSON file's fields that ``config_class`` has (else None: LitGPT's name)."""
    if name in OWN_SHAPES:
        return OWN_SHAPES[name]
    if Path(name).suffix == ".json":
        known = {field.name for field in dataclasses.fields(config_class)}
        return {key: value for key, value in json.loads(Path(name).read_text()).items() if key in known}
    return None


def build_model(fabric: L.Fabric, name: str, recipe: str, lora: dict) -> torch.nn.Module:
    """GPT as pretrain.py builds and initialises it, or as the fine-tuning scripts build it before loading a
    checkpoint (its own init, our random base); with ``lora``, LitGPT's LoRA GPT with only the adapters trainable."""
    from litgpt import lora as litgpt_lora

    kind, config_class = (litgpt_lora.GPT, litgpt_lora.Config) if lora else (GPT, Config)
    fields = lora or {}
    shape = config_fields(name, config_class)
    config = config_class(**shape, **fields) if shape is not None else config_class.from_name(name, **fields)
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
