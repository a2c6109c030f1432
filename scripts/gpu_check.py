#!/usr/bin/env python
"""The GPU check: the paths the CPU test suite cannot reach, run end to end through the real CLI.

On a machine with one NVIDIA GPU::

    .venv/bin/python scripts/gpu_check.py                 # writes out/gpu_check/gpu_check.json

runs, each as its own ``llmtrain`` command:

1. pretraining in bf16-mixed, with the default ``--compile auto`` (its decision recorded) and ``--compile true``
   (pythia-160m on the built-in corpus);
2. ``llmtrain benchmark`` of the same model, with its MFU against the measured matmul peak, and of a 1.1B
   model (TinyLlama's shape) eager and compiled, in bf16-true, on 2,048-token sequences: a size that fills a GPU,
   where the ratio is what ``--compile auto`` counts on;
3. a QLoRA (bnb.nf4) fine-tune of a 1.1B-shaped model (TinyLlama's shape, random weights from one
   pretraining step), with the peak GPU memory it reports;
4. ``llmtrain generate`` from the fine-tuned model;
5. a sharded (DCP) checkpoint save and a ``--resume auto`` from it (FSDP on one GPU);
6. DeepSpeed ZeRO-2 as local rank 1 of a task that sees one GPU (SLURM's ``--gpus-per-task 1``): the engine must
   take cuda:0, not cuda:LOCAL_RANK (skipped where the deepspeed package is not installed).

It exits 1 if any command fails, and writes one JSON record: the device, torch, the commit, and for each
check its command, exit code, seconds and the numbers it read from the run (tokens/s, MFU, loss, peak
memory). ``--cpu`` runs the same checks on this machine's CPU with tiny models (llama-debug for every model,
a few steps), to check the script and the commands themselves where no GPU is lent.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
LLMTRAIN = [sys.executable, "-m", "llmtrain"]
STORIES = ["--data", "BuiltinStories", "--data.num_documents", "2000", "--data.num_val_documents", "50"]
DEEPSPEED_CHECK = "deepspeed stage 2, local rank 1 on one GPU"
TASK_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0"}
"""The DeepSpeed check's environment: a launcher's rank that is local rank 1 but sees only one GPU."""


def checks(out: Path, cpu: bool) -> list[tuple[str, list[str], Optional[str]]]:
    """(name, llmtrain arguments, the run folder whose metrics to read) for each check, in order."""
    device = ["--accelerator", "cpu"] if cpu else ["--accelerator", "cuda"]
    small = "llama-debug" if cpu else "pythia-160m"
    base = "llama-debug" if cpu else "tiny-llama"
    steps, seq = ("4", "64") if cpu else ("40", "512")
    pretrain = ["pretrain", small, *device, *STORIES, "--precision", "bf16-mixed", "--train.max_steps", steps,
                "--train.global_batch_size", "8", "--train.micro_batch_size", "4", "--train.max_seq_length", seq,
                "--train.lr_warmup_steps", "2", "--train.save_interval", "null", "--eval.max_iters", "2",
                "--eval.interval", "1000"]
    # The built-in instructions need more than 64 tokens: shorter windows cut every answer off, leaving no target.
    qlora_seq = "256" if cpu else seq
    return [
        ("pretrain bf16-mixed", [*pretrain, "--out_dir", str(out / "pretrain")], "pretrain"),
        ("pretrain bf16-mixed --compile", [*pretrain, "--compile", "true", "--out_dir", str(out / "compiled")],
         "compiled"),
        ("benchmark", ["benchmark", "--model", small, "--precision", "bf16-mixed", "--out_dir", str(out / "bench"),
                       "--results", str(out / "bench" / "results.jsonl"), *(["--short", "true"] if cpu else [])],
         None),
        *[(f"benchmark 1.1B bf16-true {'--compile' if compiled == 'true' else 'eager'}",
           ["benchmark", "--model", base, "--precision", "bf16-true", "--compile", compiled,
            "--micro_batch_size", "1" if cpu else "4", "--seq_len", "128" if cpu else "2048", "--out_dir",
            str(out / f"bench_large_{compiled}"), "--results", str(out / f"bench_large_{compiled}" / "results.jsonl"),
            *(["--short", "true"] if cpu else [])], None) for compiled in ("false", "true")],
        ("base model for QLoRA (1.1B shape, one step)",
         ["pretrain", base, *device, *STORIES, "--precision", "bf16-true", "--train.max_steps", "1",
          "--train.global_batch_size", "1", "--train.micro_batch_size", "1", "--train.max_seq_length", "64",
          "--train.save_interval", "null", "--eval.max_iters", "1", "--out_dir", str(out / "base")], None),
        ("QLoRA bnb.nf4", ["finetune_lora", str(out / "base" / "final"), *device, "--quantize", "bnb.nf4",
                           "--precision", "bf16-true", "--train.max_steps", steps, "--train.global_batch_size",
                           "4", "--train.micro_batch_size", "1", "--train.max_seq_length", qlora_seq,
                           "--train.lr_warmup_steps", "1", "--eval.max_iters", "2", "--out_dir",
                           str(out / "qlora")], "qlora"),
        ("generate", ["generate", str(out / "qlora" / "final"), *device, "--prompt", "What is 2 + 3?",
                      "--max_new_tokens", "16", "--temperature", "0"], None),
        ("sharded save", ["pretrain", "llama-debug", *device, *STORIES, "--strategy", "fsdp",
                          "--fsdp.state_dict_type", "sharded", "--train.max_steps", "4", "--train.save_interval", "2",
                          "--train.global_batch_size", "8", "--train.micro_batch_size", "4",
                          "--train.max_seq_length", "64", "--eval.max_iters", "1", "--out_dir",
                          str(out / "sharded")], None),
        ("sharded resume", ["pretrain", "llama-debug", *device, *STORIES, "--strategy", "fsdp",
                            "--fsdp.state_dict_type", "sharded", "--train.max_steps", "6", "--train.save_interval",
                            "2", "--train.global_batch_size", "8", "--train.micro_batch_size", "4",
                            "--train.max_seq_length", "64", "--eval.max_iters", "1", "--resume", "auto",
                            "--out_dir", str(out / "sharded")], "sharded"),
        (DEEPSPEED_CHECK, ["pretrain", "llama-debug", *device, *STORIES, "--strategy", "deepspeed_stage_2",
                           "--devices", "1", "--train.max_steps", "2", "--train.global_batch_size", "8",
                           "--train.micro_batch_size", "4", "--train.max_seq_length", "64", "--train.save_interval",
                           "null", "--eval.max_iters", "1", "--out_dir", str(out / "deepspeed")], "deepspeed"),
    ]


def last_metrics(run_dir: Path) -> dict[str, Any]:
    """The last logged step of a run's metrics.csv: loss, tokens/s per device, MFU, peak memory."""
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return {}
    with open(path) as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("loss")]
    if not rows:
        return {}
    keep = ("step", "loss", "tokens_per_sec_per_device", "mfu", "peak_memory_gb")
    return {key: _number(rows[-1][key]) for key in keep if rows[-1].get(key)}


def _number(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def benchmark_numbers(results: Path) -> dict[str, Any]:
    if not results.is_file():
        return {}
    record = json.loads(results.read_text().splitlines()[-1])
    return {key: record[key] for key in ("tokens_per_sec_per_device", "mfu", "step_time_median_s", "peak_memory_gb")
            if key in record}


def commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=7"],
                          capture_output=True, text=True, check=False)
    # A copied tree (a lent machine's) may carry a stale .git: GPU_CHECK_COMMIT names the commit instead.
    return os.environ.get("GPU_CHECK_COMMIT") or done.stdout.strip() or "unknown"


def device_name(cpu: bool) -> str:
    if cpu:
        return f"CPU: {platform.processor() or platform.machine()}"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device is visible; run with --cpu to check the script on this CPU")
    return torch.cuda.get_device_name()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny models on this CPU: checks the script, not a GPU")
    parser.add_argument("--out_dir", type=Path, default=ROOT / "out" / "gpu_check")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds each check may run before it is stopped and counted as failed")
    args = parser.parse_args(argv)
    import torch

    record: dict[str, Any] = {"device": device_name(args.cpu), "mode": "cpu" if args.cpu else "gpu",
                              "torch": torch.__version__, "commit": commit(),
                              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "checks": []}
    if args.out_dir.exists():
        shutil.rmtree(args.out_dir)
    args.out_dir.mkdir(parents=True)
    for name, arguments, metrics_dir in checks(args.out_dir, args.cpu):
        if name == DEEPSPEED_CHECK and importlib.util.find_spec("deepspeed") is None:
            record["checks"].append({"name": name, "skipped": "the deepspeed package is not installed"})
            print(f"skip {name}: the deepspeed package is not installed (scripts/install.sh installs it)", flush=True)
            continue
        env = {**os.environ, **TASK_ENV} if name == DEEPSPEED_CHECK else None
        started = time.perf_counter()
        try:
            done = subprocess.run([*LLMTRAIN, *arguments], capture_output=True, text=True, cwd=args.out_dir,
                                  check=False, timeout=args.timeout, env=env)
        except subprocess.TimeoutExpired as expired:
            output = expired.stdout or b""
            text = output.decode(errors="replace") if isinstance(output, bytes) else output
            done = subprocess.CompletedProcess(expired.cmd, 124, "", text + f"\nstopped after {args.timeout:g} s")
        seconds = round(time.perf_counter() - started, 1)
        numbers = last_metrics(args.out_dir / metrics_dir) if metrics_dir else {}
        if name.startswith("benchmark"):
            numbers = benchmark_numbers(Path(arguments[arguments.index("--results") + 1]))
        decided = [line for line in done.stdout.splitlines() if line.startswith("--compile auto:")]
        if decided:  # what the default --compile auto chose, and why
            numbers["compile_auto"] = decided[0]
        if name == "sharded resume" and done.returncode == 0 and "resumed from" not in done.stdout:
            done.returncode, done.stderr = 1, "the second run did not resume from the sharded checkpoint"
        entry = {"name": name, "command": "llmtrain " + " ".join(arguments), "returncode": done.returncode,
                 "seconds": seconds, "numbers": numbers}
        if done.returncode != 0:
            entry["error"] = (done.stderr or done.stdout)[-2000:]
        record["checks"].append(entry)
        print(f"{'ok  ' if done.returncode == 0 else 'FAIL'} {name:<46} {seconds:>7.1f}s  "
              f"{json.dumps(numbers)}", flush=True)
        if done.returncode != 0:
            print(entry["error"], file=sys.stderr)
    record["ok"] = all(entry.get("returncode", 0) == 0 for entry in record["checks"])
    rates = {entry["name"]: entry.get("numbers", {}).get("tokens_per_sec_per_device") for entry in record["checks"]}
    eager, compiled = rates.get("benchmark 1.1B bf16-true eager"), rates.get("benchmark 1.1B bf16-true --compile")
    if eager and compiled:  # what --compile auto counts on at a size that fills the device
        record["compile_speedup_1.1b"] = round(compiled / eager, 3)
        print(f"1.1B bf16-true: compiled {compiled / eager:.2f}x eager")
    path = args.out_dir / "gpu_check.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'all checks passed' if record['ok'] else 'some checks FAILED'}; record in {path}")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
