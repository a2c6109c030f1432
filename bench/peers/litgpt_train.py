"""Train LitGPT's GPT on the batches loss_parity.py exported, as `litgpt pretrain` trains, then write a transformers
folder. Run with a venv that has litgpt (torch pinned as llmtrain's):

    /work/peers/litgpt-venv/bin/python bench/peers/litgpt_train.py SEED_DIR/data.pt SEED_DIR/hf-litgpt \
        [--schedule litgpt|llmtrain] [--threads 2]

What is `litgpt pretrain`'s (litgpt/pretrain.py): Fabric on one CPU device in fp32, `fabric.seed_everything(seed)`
and then `initialize_weights` (GPT-NeoX's small init, Wang's for the two residual projections), AdamW built by
`instantiate_torch_optimizer` over `model.parameters()` (one group: every weight decays, norms and embeddings
included; fused only on CUDA), `chunked_cross_entropy` divided by the micro-batches per step, gradient clipping,
and with ``--schedule litgpt`` the rate of `get_lr`, set before every micro-batch from the micro-batch counter
(warmup and decay counted in micro-batches), so an optimizer step uses the rate of its last micro-batch.
What is not: the model is not compiled (`litgpt pretrain` always compiles; the arithmetic is the same) and the
batches are the exported ones, in their order, rather than LitGPT's data loader's.

The folder holds config.json (llmtrain's transformers config of the same shape), model.safetensors (the weights
mapped by LitGPT's own convert_lit_checkpoint.copy_weights_llama), parity_check.pt (LitGPT's logits on a random
input, which parity_judge.py compares with transformers') and train_log.json (loss and rate of every step).
"""

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import lightning as L
import torch
from litgpt import GPT, Config
from litgpt.pretrain import get_lr, initialize_weights
from litgpt.scripts.convert_lit_checkpoint import copy_weights_llama
from litgpt.utils import chunked_cross_entropy, instantiate_torch_optimizer
from litgpt_bench import LLAMA_DEBUG
from safetensors.torch import save_file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data", type=Path, help="data.pt written by loss_parity.py")
    parser.add_argument("out_dir", type=Path, help="the transformers folder to write")
    parser.add_argument("--schedule", choices=["litgpt", "llmtrain"], default="litgpt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--init_seed", type=int, help="seed the initial weights with this instead of the run's seed: "
                        "the same batches from another draw of the weights, to see how far the draw alone moves the loss")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run = torch.load(args.data)
    train = run["train"]  # (steps, micro-batches per step, micro batch, max_seq_length + 1)
    steps, accum, _, window = train.shape

    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    fabric.seed_everything(run["seed"] if args.init_seed is None else args.init_seed)
    config = Config(**LLAMA_DEBUG)
    with fabric.init_module(empty_init=True):
        gpt = GPT(config)
    initialize_weights(fabric, gpt, n_layer=config.n_layer, n_embd=config.n_embd)
    gpt.max_seq_length = window - 1
    model = fabric.setup(gpt)
    optimizer = instantiate_torch_optimizer(
        {"class_path": "torch.optim.AdamW",
         "init_args": {"lr": run["lr"], "betas": tuple(run["betas"]), "weight_decay": run["weight_decay"]}},
        model.parameters(), fused=fabric.device.type == "cuda")
    optimizer = fabric.setup_optimizers(optimizer)

    warmup_iters, max_iters = run["warmup_steps"] * accum, steps * accum
    log, iteration, started = [], 0, time.perf_counter()
    for step in range(steps):
        step_loss = 0.0
        for micro in range(accum):
            if args.schedule == "litgpt":
                lr = get_lr(optimizer.defaults["lr"], iteration, warmup_iters, max_iters, run["min_lr"])
            else:
                lr = run["llmtrain_lrs"][step]
            for group in optimizer.param_groups:
                group["lr"] = lr
            iteration += 1
            rows = train[step, micro].long()
            logits = model(rows[:, :-1].contiguous())
            loss = chunked_cross_entropy(logits, rows[:, 1:].contiguous())
            fabric.backward(loss / accum)
            step_loss += float(loss.detach()) / accum
        fabric.clip_gradients(model, optimizer, max_norm=run["max_norm"])
        optimizer.step()
        optimizer.zero_grad()
        log.append({"step": step + 1, "loss": step_loss, "lr": lr})
        if (step + 1) % 10 == 0 or step + 1 == steps:
            print(f"step {step + 1} | loss {step_loss:.4f} | lr {lr:.3e} | {time.perf_counter() - started:.0f}s",
                  flush=True)
    write_hf_folder(gpt, config, run["hf_config"], log, args.out_dir)
    print(f"wrote {args.out_dir}")


@torch.no_grad()
def write_hf_folder(gpt: GPT, config: Config, hf_config: dict, log: list[dict], out_dir: Path) -> None:
    """The weights in transformers' Llama names, the config, the logits check and the log; all or nothing."""
    gpt.eval()
    lit_weights = {name: param.detach() for name, param in gpt.named_parameters()}
    state_dict: dict[str, torch.Tensor] = {}
    copy_weights_llama(config, state_dict, lit_weights)
    missing = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} - set(state_dict)
    assert not missing, f"copy_weights_llama left out {sorted(missing)}"
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (2, gpt.max_seq_length), generator=generator)
    check = {"input_ids": input_ids, "logits": gpt(input_ids)}

    temp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    save_file({name: tensor.contiguous() for name, tensor in state_dict.items()}, temp / "model.safetensors",
              metadata={"format": "pt"})
    (temp / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": "float32"}, indent=2) + "\n")
    torch.save(check, temp / "parity_check.pt")
    (temp / "train_log.json").write_text(json.dumps(log) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(temp, out_dir)


if __name__ == "__main__":
    main()
