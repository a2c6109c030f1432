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
   take cuda:0, not cuda:LOCAL_RANK (skipped where the deepspeed package is not installed);
7. ``--fsdp.cpu_offload true`` on a 2-D mesh (HYBRID_SHARD's replicate × shard, 1 × 1 on one GPU): the process group
   of two backends started as a multi-node run starts it, the plan's mesh, FSDP with CPU offload and two steps with
   gradient clipping (a probe in this script: the CLI gives one device a 1-D mesh);
8. whether torch splits a default group of two backends bound to its GPU (``split_group``, as ``init_device_mesh``
   does for a dimension smaller than the world when the group is bound): the question behind the runtime's
   ``bound_device``. Its answer is recorded; it fails nothing (llmtrain no longer binds such a group).

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
import math
import os
import platform
import shutil
import socket
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
OFFLOAD_MESH_CHECK = "fsdp cpu_offload on a 2-D mesh (probe)"
SPLIT_CHECK = "torch: split_group of a bound group of two backends (probe)"
PROBES = {OFFLOAD_MESH_CHECK: "offload_mesh", SPLIT_CHECK: "split"}
"""The checks that run a probe of this script (``--probe NAME``) rather than an llmtrain command."""
PROBE_TIMEOUT_S = 180.0
INFORMATIONAL = {SPLIT_CHECK}
"""Checks that record what torch does; their outcome does not fail the run."""


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
        (OFFLOAD_MESH_CHECK, ["--probe", "offload_mesh", *(["--cpu"] if cpu else [])], None),
        (SPLIT_CHECK, ["--probe", "split", *(["--cpu"] if cpu else [])], None),
    ]


def probe_offload_mesh(cpu: bool) -> dict[str, Any]:
    """One rank of a run with ``--fsdp.cpu_offload true`` whose plan has a 2-D mesh, on one device.

    The default group is started as every multi-rank run starts it (the rendezvous at MASTER_ADDR:MASTER_PORT, then
    ``process_group_backend``'s backend: ``cuda:nccl,cpu:gloo`` on a GPU), the mesh comes from the plan, and the
    model goes through parallelize and materialize as a recipe's does; two AdamW steps clip the offloaded gradients,
    whose norm is reduced on the host.
    """
    import dataclasses

    import torch
    import torch.distributed as dist

    from llmtrain.args import FSDPArgs, TrainArgs
    from llmtrain.config import Config
    from llmtrain.distributed.grad_norm import clip_grad_norm_
    from llmtrain.distributed.parallel_plan import ParallelPlan
    from llmtrain.distributed.parallelize import materialize, parallelize
    from llmtrain.distributed.runtime import Runtime, process_group_backend, start_process_group
    from llmtrain.model import GPT

    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    # NOTE: the flags refuse offloading on a CPU run and HYBRID_SHARD on one node, and give one device a 1-D mesh;
    # the plan resolved for one device takes both afterwards, which makes its mesh replicate 1 × shard 1.
    plan = ParallelPlan.resolve(devices=1, num_nodes=1, train=TrainArgs(global_batch_size=2, micro_batch_size=2),
                                precision="32-true", strategy="fsdp", accelerator=device.type,
                                fsdp=FSDPArgs(cpu_offload=not cpu))
    plan = dataclasses.replace(plan, sharding_strategy="HYBRID_SHARD", cpu_offload=True)
    if not cpu:
        torch.cuda.set_device(device)
    start_process_group(device, rank=0, world_size=1, timeout_s=600.0, rdzv_timeout_s=60.0,
                        backend=process_group_backend(device.type, plan.cpu_offload), local_layout=(0, 1))
    runtime = Runtime.for_plan(plan, timeout_s=600.0)
    config = Config.from_name("llama-debug")
    with torch.device("meta"):
        model = GPT(config)
    model.max_seq_length = 64
    model = parallelize(model, plan, device=runtime.device)
    materialize(model, runtime.device, 0, cpu_offload=plan.cpu_offload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0)).to(device)
    losses, norms = [], []
    for _ in range(2):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        norms.append(float(clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weight = next(model.parameters())
    record = {"backend": str(dist.get_backend()), "bound_device": str(dist.group.WORLD.bound_device_id),
              "mesh": plan.describe_mesh(), "mesh_ndim": weight.device_mesh.ndim, "weights_on": weight.device.type,
              "losses": losses, "grad_norms": norms}
    dist.destroy_process_group()
    if record["mesh_ndim"] != 2 or not all(map(math.isfinite, losses + norms)):
        raise SystemExit(f"error: expected a 2-D mesh and finite losses and norms: {record}")
    return record


def probe_split(cpu: bool) -> dict[str, Any]:
    """Whether torch splits a default group of NCCL and gloo that is bound to its GPU, and the split group then
    all-reduces a GPU tensor and a host one: what ``init_device_mesh`` does with a bound group."""
    if cpu:
        return {"skipped": "split_group needs an accelerator"}
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group(backend="cuda:nccl,cpu:gloo", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        group = dist.split_group(split_ranks=[[0]])
        for tensor in (torch.ones(1, device="cuda"), torch.ones(1)):
            dist.all_reduce(tensor, group=group)
        outcome = "split, and the split group all-reduces on the GPU and the host"
    except Exception as error:  # noqa: BLE001  (the answer to record)
        outcome = f"fails: {type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
    dist.destroy_process_group()
    return {"torch_split_of_two_backends": outcome}


def run_probe(name: str, cpu: bool) -> int:
    """``--probe NAME``: run one probe here and print its record as the last line (``probe: {...}``)."""
    record = {"offload_mesh": probe_offload_mesh, "split": probe_split}[name](cpu)
    print("probe: " + json.dumps(record), flush=True)
    return 0


def probe_env() -> dict[str, str]:
    """A probe's environment: one rank of one, meeting itself at a free port on this machine."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}


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
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="run only the checks whose name contains TEXT (repeatable): to rerun the ones that failed")
    parser.add_argument("--probe", choices=sorted(set(PROBES.values())),
                        help="run one probe in this process (the checks start them so)")
    args = parser.parse_args(argv)
    if args.probe:
        return run_probe(args.probe, args.cpu)
    import torch

    record: dict[str, Any] = {"device": device_name(args.cpu), "mode": "cpu" if args.cpu else "gpu",
                              "torch": torch.__version__, "commit": commit(),
                              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "checks": []}
    if args.out_dir.exists():
        shutil.rmtree(args.out_dir)
    args.out_dir.mkdir(parents=True)
    for name, arguments, metrics_dir in checks(args.out_dir, args.cpu):
        if args.only and not any(text in name for text in args.only):
            continue
        if name == DEEPSPEED_CHECK and importlib.util.find_spec("deepspeed") is None:
            record["checks"].append({"name": name, "skipped": "the deepspeed package is not installed"})
            print(f"skip {name}: the deepspeed package is not installed (scripts/install.sh installs it)", flush=True)
            continue
        env = {**os.environ, **TASK_ENV} if name == DEEPSPEED_CHECK else None
        command, timeout = [*LLMTRAIN, *arguments], args.timeout
        if name in PROBES:  # a tiny model: minutes mean a hang (a split that never returns), not work
            env = {**os.environ, **probe_env()}
            command = [sys.executable, str(Path(__file__).resolve()), *arguments]
            timeout = min(args.timeout, PROBE_TIMEOUT_S)
        started = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, cwd=args.out_dir,
                                  check=False, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as expired:
            output = expired.stdout or b""
            text = output.decode(errors="replace") if isinstance(output, bytes) else output
            done = subprocess.CompletedProcess(expired.cmd, 124, "", text + f"\nstopped after {timeout:g} s")
        seconds = round(time.perf_counter() - started, 1)
        numbers = last_metrics(args.out_dir / metrics_dir) if metrics_dir else {}
        if name.startswith("benchmark"):
            numbers = benchmark_numbers(Path(arguments[arguments.index("--results") + 1]))
        decided = [line for line in done.stdout.splitlines() if line.startswith("--compile auto:")]
        if decided:  # what the default --compile auto chose, and why
            numbers["compile_auto"] = decided[0]
        if name == "sharded resume" and done.returncode == 0 and "resumed from" not in done.stdout:
            done.returncode, done.stderr = 1, "the second run did not resume from the sharded checkpoint"
        probed = [line for line in done.stdout.splitlines() if line.startswith("probe: ")]
        if probed:
            numbers = json.loads(probed[-1][len("probe: "):])
        entry = {"name": name, "command": " ".join(["scripts/gpu_check.py" if name in PROBES else "llmtrain",
                                                    *arguments]), "returncode": done.returncode,
                 "seconds": seconds, "numbers": numbers}
        if name in INFORMATIONAL:
            entry["informational"] = True
        if done.returncode != 0:
            entry["error"] = (done.stderr or done.stdout)[-2000:]
        record["checks"].append(entry)
        print(f"{'ok  ' if done.returncode == 0 else 'FAIL'} {name:<46} {seconds:>7.1f}s  "
              f"{json.dumps(numbers)}", flush=True)
        if done.returncode != 0:
            print(entry["error"], file=sys.stderr)
    record["ok"] = all(entry.get("returncode", 0) == 0 for entry in record["checks"] if not entry.get("informational"))
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
