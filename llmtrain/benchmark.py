"""``llmtrain benchmark``: tokens/s, step time, MFU against this machine's measured matmul peak.

It runs the real pretrain recipe (the same ``fit()``, data loader and parallel setup as any run) for
``warmup + steps`` optimizer steps with a log row per step, and reads the step times back from the
run's metrics.csv. MFU is the model's FLOPs per token (llmtrain.flops, the convention the training
log uses) times tokens/s per device, over the peak FLOP/s of a square matmul measured just before, in
the same dtype and thread count: the real ceiling of this machine, not a datasheet's.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from llmtrain.train.precision import Precision, PrecisionName

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE = ROOT / "scripts" / "benchmark_baseline.json"
BASELINE_FLOOR = 0.3  # the short mode fails below this fraction of the stored MFU: a regression, not noise


def measure_matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5, device: str = "cpu") -> float:
    """Best FLOP/s of ``size``³ matmuls in ``dtype`` (2·n³ FLOPs each), after two warm-up products."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for index in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        if index >= 2:
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "cpu"


def git_commit() -> str:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def benchmark(
    model: str = "llama-debug",
    precision: PrecisionName = "32-true",
    micro_batch_size: int = 8,
    seq_len: int = 256,
    steps: int = 20,
    warmup: int = 5,
    devices: int = 1,
    compile: bool = False,
    short: bool = False,
    results: Path = Path("benchmarks.jsonl"),
    baseline: Optional[Path] = DEFAULT_BASELINE,
) -> dict:
    """Measure training speed of a zoo model on this machine and append the numbers to a JSON-lines file.

    Args:
        model: A zoo name (`llmtrain pretrain list`).
        precision: 32-true, bf16-true, bf16-mixed, 16-true or 16-mixed.
        micro_batch_size: Sequences per device per step (no accumulation: global = micro × devices).
        seq_len: Tokens per sequence.
        steps: Timed optimizer steps.
        warmup: Steps run first and not timed (allocator, caches, compilation).
        devices: Processes, as `pretrain --devices` (FSDP when more than one).
        compile: torch.compile every block, as `pretrain --compile`.
        short: A quick check for CI: 3 timed steps after 2, and a comparison with
            the stored baseline that fails on a large regression.
        results: JSON-lines file that each run appends one record to.
        baseline: JSON file of reference MFUs per setting; the run prints its ratio to the matching one.
    """
    from llmtrain.cli import main
    from llmtrain.config import Config
    from llmtrain.flops import flops_per_token

    if steps < 1 or warmup < 0 or micro_batch_size < 1 or seq_len < 2 or devices < 1:
        raise ValueError("--steps, --micro_batch_size and --devices must be at least 1, --seq_len at least 2 and "
                         "--warmup at least 0")
    if short:
        steps, warmup = 3, 2
    config = Config.from_name(model)
    dtype = Precision(precision).compute_dtype
    threads = max(1, torch.get_num_threads() // devices) if devices > 1 else torch.get_num_threads()
    # Each of several processes gets its share of the cores, so its ceiling is a matmul on that share.
    all_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        peak = measure_matmul_peak(dtype, size=2048, repeats=5)
    finally:
        torch.set_num_threads(all_threads)
    with tempfile.TemporaryDirectory(prefix="llmtrain-benchmark-") as tmp:
        out_dir = Path(tmp) / "run"
        main(["pretrain", model, "--out_dir", str(out_dir), "--precision", precision, "--devices", str(devices),
              "--compile", str(compile).lower(), "--train.micro_batch_size", str(micro_batch_size),
              "--train.global_batch_size", str(micro_batch_size * devices), "--train.max_seq_length", str(seq_len),
              "--train.max_steps", str(warmup + steps), "--train.log_interval", "1", "--train.lr_warmup_steps", "1",
              "--eval.initial_validation", "false", "--eval.final_validation", "false",
              "--eval.interval", "1000000"])
        rows = _train_rows(out_dir / "metrics.csv")
    timed = [row for row in rows if row["step"] > warmup]
    step_times = [row["elapsed_s"] - previous["elapsed_s"] for previous, row in zip(rows, rows[1:])
                  if row["step"] > warmup]
    if not step_times:
        raise RuntimeError("the benchmark run logged no timed steps")
    median = statistics.median(step_times)
    tokens_per_sec_per_device = micro_batch_size * seq_len / median
    record = {
        "model": model, "precision": precision, "micro_batch_size": micro_batch_size, "seq_len": seq_len,
        "devices": devices, "compile": compile, "steps": len(step_times), "warmup": warmup,
        "tokens_per_sec_per_device": tokens_per_sec_per_device,
        "step_time_median_s": median, "step_time_min_s": min(step_times), "step_time_max_s": max(step_times),
        "mfu": flops_per_token(config, seq_len) * tokens_per_sec_per_device / peak,
        "matmul_peak_flops": peak, "data_wait_fraction": statistics.mean(r["data_wait_fraction"] for r in timed),
        "peak_memory_gb": max(r["peak_memory_gb"] for r in timed),
        "device": device_name(), "threads_per_process": threads, "torch": torch.__version__, "commit": git_commit(),
        "command": "llmtrain benchmark " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["benchmark"] else sys.argv[1:]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    _print_table(record)
    if baseline is not None:
        _compare(record, Path(baseline), short)
    results = Path(results)
    results.parent.mkdir(parents=True, exist_ok=True)
    with open(results, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    print(f"appended to {results}")
    return record


def baseline_key(record: dict) -> str:
    return "|".join(str(record[k]) for k in ("model", "precision", "micro_batch_size", "seq_len", "devices", "compile"))


def _compare(record: dict, path: Path, short: bool) -> None:
    """Print MFU relative to the stored baseline (MFU, not tokens/s, so a faster or slower machine
    compares fairly); in the short mode a ratio below BASELINE_FLOOR is an error."""
    if not path.is_file():
        print(f"no baseline at {path}")
        return
    stored = json.loads(path.read_text()).get(baseline_key(record))
    if stored is None:
        print(f"no baseline for {baseline_key(record)} in {path}")
        return
    ratio = record["mfu"] / stored["mfu"]
    record["baseline_ratio"] = ratio
    print(f"MFU vs baseline: {ratio:.2f}x ({record['mfu']:.1%} now, {stored['mfu']:.1%} stored at commit "
          f"{stored.get('commit', '?')})")
    if short and ratio < BASELINE_FLOOR:
        raise RuntimeError(f"MFU is {ratio:.2f}x the baseline in {path} (below {BASELINE_FLOOR}x): a performance "
                           "regression")


def _train_rows(path: Path) -> list[dict]:
    import csv

    with open(path) as handle:
        rows = [row for row in csv.DictReader(handle) if row["loss"]]
    numeric = ("step", "elapsed_s", "data_wait_fraction", "peak_memory_gb")
    return [{key: (float(row[key]) if row.get(key) else 0.0) if key != "step" else int(row[key]) for key in numeric}
            for row in rows]


def _print_table(record: dict) -> None:
    lines = [
        ("setting", f"{record['model']} {record['precision']} micro {record['micro_batch_size']} × seq "
                    f"{record['seq_len']}, {record['devices']} process(es){', compiled' if record['compile'] else ''}"),
        ("device", f"{record['device']}, {record['threads_per_process']} threads per process, torch {record['torch']}"),
        ("tokens/s per device", f"{record['tokens_per_sec_per_device']:,.0f}"),
        ("step time", f"median {record['step_time_median_s'] * 1000:.1f} ms (min {record['step_time_min_s'] * 1000:.1f}, "
                      f"max {record['step_time_max_s'] * 1000:.1f}) over {record['steps']} steps"),
        ("matmul peak", f"{record['matmul_peak_flops'] / 1e9:,.1f} GFLOP/s (measured)"),
        ("MFU", f"{record['mfu']:.1%}"),
        ("waiting for data", f"{record['data_wait_fraction']:.1%} of step time"),
        ("peak memory", f"{record['peak_memory_gb']:.2f} GB"),
    ]
    width = max(len(name) for name, _ in lines)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in lines))
