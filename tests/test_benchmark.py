"""The benchmark's short mode, as CI runs it: sane numbers, a JSON record, the ratio to the baseline."""

import json
import math
import os
import subprocess
import sys

import torch

from llmtrain.benchmark import DEFAULT_BASELINE, baseline_key, measure_matmul_peak


def test_short_benchmark_reports_sane_numbers_and_compares_with_the_baseline(tmp_path):
    results = tmp_path / "bench.jsonl"
    env = {**os.environ, "LLMTRAIN_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "llmtrain", "benchmark", "--short", "true", "--micro_batch_size", "4",
                           "--seq_len", "128", "--results", str(results)], capture_output=True, text=True,
                          timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout[-1500:])  # CI's log shows the table and the ratio
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    for key in ("tokens_per_sec_per_device", "step_time_median_s", "mfu", "matmul_peak_flops", "peak_memory_gb"):
        assert math.isfinite(record[key]) and record[key] > 0, (key, record[key])
    assert 0 < record["mfu"] < 1.5
    assert 0 <= record["data_wait_fraction"] <= 1
    assert record["step_time_min_s"] <= record["step_time_median_s"] <= record["step_time_max_s"]
    assert record["steps"] == 3 and record["torch"] == torch.__version__ and record["commit"]
    assert record["command"].startswith("llmtrain benchmark")
    assert baseline_key(record) in json.loads(DEFAULT_BASELINE.read_text())
    assert "MFU vs baseline: " in done.stdout and record["baseline_ratio"] > 0


def test_matmul_peak_is_a_plausible_cpu_rate():
    peak = measure_matmul_peak(torch.float32, size=512, repeats=3)
    assert 1e9 < peak < 1e13  # between 1 GFLOP/s and 10 TFLOP/s on any CPU this runs on
