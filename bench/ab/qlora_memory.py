"""Peak host memory (RSS) of one QLoRA step on a TinyLlama-1.1B-shaped model with random weights.

    python bench/ab/qlora_memory.py [--work_dir /tmp/qlora_memory] [--quantize bnb.nf4]

Writes, once, a transformers folder of the TinyLlama-1.1B architecture (random bf16 weights, 2.05 GiB, and a
small BPE tokenizer whose vocabulary fits the 32000 embedding rows), then runs under ``/usr/bin/time -v``:

    llmtrain finetune_lora FOLDER --quantize bnb.nf4 --precision bf16-true --train.max_steps 1
        --train.micro_batch_size 1 --train.global_batch_size 1 --train.max_seq_length 64 --eval.max_iters 1

twice: ``cold`` converts the folder to a llmtrain model directory on the way (as a first fine-tuning run
does), ``warm`` finds the conversion cached. Each prints the largest resident set size of the command's
processes (time's "Maximum resident set size"). ``--eval.max_iters 1`` only saves time: a validation batch
of 64 tokens holds no memory worth measuring, but a hundred of them through a 1.1B model take many minutes
on a CPU. It needs about 7 GiB of free memory; run it on a quiet machine, since the numbers are for the
process alone but the time is not.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# TinyLlama-1.1B (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T): 1.10e9 parameters.
TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
TOKENIZER_TEXTS = ["Once upon a time there was a little model that wanted to learn.",
                   "Give three tips for staying healthy. Eat well, sleep, and move every day."] * 50


def write_hf_folder(folder: Path) -> None:
    """The random bf16 TinyLlama-shaped model and a tiny tokenizer, as transformers' save_pretrained writes them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.tokenizer import train_bpe_tokenizer

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    config = LlamaConfig(**TINYLLAMA)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the model is created in bf16: it never exists in fp32
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(tmp)
    del model
    tokenizer_dir = tmp / "tokenizer"
    train_bpe_tokenizer(iter(TOKENIZER_TEXTS), vocab_size=400, out_dir=tokenizer_dir)
    for file in tokenizer_dir.iterdir():
        shutil.move(str(file), tmp / file.name)
    tokenizer_dir.rmdir()
    tmp.rename(folder)


def measure(folder: Path, out_dir: Path, cache_dir: Path, quantize: str) -> dict:
    """Run the fine-tuning command under /usr/bin/time -v: its peak RSS in GiB and its wall time in seconds."""
    shutil.rmtree(out_dir, ignore_errors=True)
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "llmtrain", "finetune_lora", str(folder),
               "--quantize", quantize, "--precision", "bf16-true", "--train.max_steps", "1",
               "--train.micro_batch_size", "1", "--train.global_batch_size", "1", "--train.max_seq_length", "64",
               "--eval.max_iters", "1", "--out_dir", str(out_dir)]
    env = {**__import__("os").environ, "LLMTRAIN_CACHE_DIR": str(cache_dir),
           "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"the command failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    peak_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", result.stderr).group(1)
    seconds = sum(float(part) * 60**index for index, part in enumerate(reversed(wall.split(":"))))
    return {"peak_rss_gib": round(peak_kib / 2**20, 2), "wall_s": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work_dir", type=Path, default=Path("/tmp/qlora_memory"))
    parser.add_argument("--quantize", default="bnb.nf4")
    args = parser.parse_args()
    folder = args.work_dir / "tinyllama-1.1b-random"
    if not (folder / "config.json").is_file():
        print(f"writing {folder}", flush=True)
        write_hf_folder(folder)
    weights_gib = sum(file.stat().st_size for file in folder.glob("*.safetensors")) / 2**30
    cache_dir = args.work_dir / "cache"
    shutil.rmtree(cache_dir, ignore_errors=True)  # the cold run converts
    results = {"weights_gib": round(weights_gib, 2)}
    for run in ("cold", "warm"):
        results[run] = measure(folder, args.work_dir / "out", cache_dir, args.quantize)
        print(run, results[run], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
