"""Tokens/s of transformers' Trainer on a config.json (from hf_config.py), random weights and tokens.

Run with a venv that has transformers + accelerate (torch pinned as llmtrain's):

    /work/peers/hf-venv/bin/python bench/peers/hf_trainer_bench.py /tmp/peers/llama-debug \
        --precision 32-true --micro_batch_size 8 --seq_len 256 --steps 20 --warmup 5

Precision as llmtrain names it: 32-true (fp32), bf16-true (weights and compute in bf16: the model is
cast, Trainer's bf16 flag off), bf16-mixed (fp32 weights, Trainer's bf16=True: CPU autocast).
The optimizer is Trainer's `adamw_torch_fused` (fair to llmtrain, which fuses AdamW by default);
`--optim adamw_torch` gives Trainer's default. Prints one JSON line and appends it to --results.

`--recipe finetune_full` is the same step (the Trainer trains every weight either way) recorded as fine-tuning;
`--recipe finetune_lora` wraps the model with peft's LoRA (`pip install -c constraints.txt peft`) on the modules
llmtrain's flags name (query -> q_proj, value -> v_proj, projection -> o_proj, mlp -> gate/up/down_proj,
head -> lm_head), adapters in the model's dtype (also under bf16-true), the base frozen.

`--device cuda` runs on the GPU (each step timed up to a synchronize; peak memory torch.cuda.max_memory_allocated,
on CPU the process's peak RSS). `--compile` sets the Trainer's `torch_compile`. `--quantize bnb.nf4` (with
`--recipe finetune_lora`: QLoRA) loads the random base through bitsandbytes' 4-bit layers
(`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`, computing in the precision's dtype) before
peft wraps it; 4-bit loading goes through `from_pretrained`, so the random model is saved to a temporary folder first.
"""

import argparse
import json
import resource
import statistics
import tempfile
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from finetune_args import add_finetune_flags, lora_settings

PEFT_MODULES = {"query": ["q_proj"], "key": ["k_proj"], "value": ["v_proj"], "projection": ["o_proj"],
                "mlp": ["gate_proj", "up_proj", "down_proj"], "head": ["lm_head"]}


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self.start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize()
        self.times.append(time.perf_counter() - self.start)


def synchronize():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count, seq_len, vocab_size):
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab_size, (count, seq_len), generator=generator)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("config_dir")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true", "bf16-mixed"])
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--optim", default="adamw_torch_fused")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--compile", action="store_true", help="the Trainer's torch_compile")
    parser.add_argument("--quantize", choices=["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq"])
    parser.add_argument("--results", default="peers.jsonl")
    add_finetune_flags(parser)
    args = parser.parse_args()
    lora = lora_settings(args)
    if args.quantize and not lora:
        raise SystemExit("--quantize quantizes the frozen base of --recipe finetune_lora (QLoRA)")

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.config_dir)
    if args.quantize:
        model = quantized_model(config, args.quantize, args.precision, args.device)
    else:
        model = AutoModelForCausalLM.from_config(config)
        if args.precision == "bf16-true":
            model = model.to(torch.bfloat16)
    if lora:
        model = with_adapters(model, lora)
    total = args.warmup + args.steps
    data = Tokens(total * args.micro_batch_size, args.seq_len, config.vocab_size)
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out_dir:
        training = TrainingArguments(
            output_dir=out_dir, per_device_train_batch_size=args.micro_batch_size, max_steps=total,
            learning_rate=1e-3, lr_scheduler_type="constant", optim=args.optim, use_cpu=args.device == "cpu",
            torch_compile=args.compile,
            bf16=args.precision == "bf16-mixed", logging_strategy="no", save_strategy="no", report_to=[],
            dataloader_num_workers=0, disable_tqdm=True, seed=0, label_names=["labels"])
        Trainer(model=model, args=training, train_dataset=data, callbacks=[timer]).train()
    median = statistics.median(timer.times[args.warmup:])
    record = {"tool": "transformers.Trainer", "version": transformers.__version__, "recipe": args.recipe,
              "lora": lora, "quantize": args.quantize, "compile": args.compile, "device": args.device,
              "peak_memory_gb": peak_memory_gb(args.device), "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "torch": torch.__version__,
              "config": args.config_dir, "precision": args.precision, "optim": args.optim,
              "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len, "steps": len(timer.times[args.warmup:]),
              "step_time_median_s": median, "tokens_per_sec": args.micro_batch_size * args.seq_len / median,
              "threads": torch.get_num_threads()}
    print(json.dumps(record))
    with open(args.results, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def peak_memory_gb(device: str) -> float:
    """The run's peak: allocated CUDA memory on a GPU, the process's peak RSS on a CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def quantized_model(config, quantize: str, precision: str, device: str) -> torch.nn.Module:
    """The random model of ``config`` loaded back with its linear layers in bitsandbytes' 4-bit layers."""
    from transformers import BitsAndBytesConfig

    if "mixed" in precision:
        raise SystemExit(f"--quantize {quantize} with --precision {precision}: use bf16-true or 32-true")
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    settings = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantize.removeprefix("bnb.").removesuffix("-dq"),
                                  bnb_4bit_use_double_quant=quantize.endswith("-dq"), bnb_4bit_compute_dtype=dtype)
    with tempfile.TemporaryDirectory() as folder:
        AutoModelForCausalLM.from_config(config, torch_dtype=dtype).save_pretrained(folder)
        return AutoModelForCausalLM.from_pretrained(folder, quantization_config=settings, torch_dtype=dtype,
                                                    device_map={"": device})


def with_adapters(model: torch.nn.Module, lora: dict) -> torch.nn.Module:
    """The model wrapped by peft's LoRA on the modules llmtrain's flags name, only the adapters trainable."""
    import peft

    targets = [module for target, modules in PEFT_MODULES.items() if lora[f"lora_{target}"] for module in modules]
    settings = peft.LoraConfig(r=lora["lora_r"], lora_alpha=lora["lora_alpha"], lora_dropout=lora["lora_dropout"],
                               target_modules=targets, bias="none", task_type="CAUSAL_LM")
    # NOTE: peft makes bf16 models' adapters fp32 by default; llmtrain and LitGPT keep them in the model's dtype.
    return peft.get_peft_model(model, settings, autocast_adapter_dtype=False)


if __name__ == "__main__":
    main()
