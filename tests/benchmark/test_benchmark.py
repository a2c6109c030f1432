"""The benchmark's short mode, as CI runs it: sane numbers, a JSON record, the ratio to the baseline."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmtrain.benchmark.baseline import DEFAULT_BASELINE, baseline_key, machine_baseline_file
from llmtrain.benchmark.command import RECORD_FIELDS, benchmark
from llmtrain.benchmark.machine import device_name
from llmtrain.flops import measure_matmul_peak

# NOTE: one thread per process, as the stored CI baseline was measured: on a shared runner two OpenMP
# threads that wait for each other behind other work make a step several times slower, one thread does not.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# `python -m llmtrain`, with the matmul peak measured on 512 × 512 products only: the default sizes (up to 4096)
# take one thread 10-40 s, twice a run, for a number that the tests which use this check nothing of (conftest's
# small_matmul_peak does the same in this process).
SMALL_PEAK = ("import runpy; from llmtrain.flops import measure_matmul_peak; "
              "measure_matmul_peak.__defaults__ = ((512,), *measure_matmul_peak.__defaults__[1:]); "
              "runpy.run_module('llmtrain', run_name='__main__', alter_sys=True)")


def run_benchmark(*flags, cwd, env=ENV, small_peak=False):
    """`python -m llmtrain benchmark FLAGS`; with small_peak, for a test that checks nothing of the matmul peak (the
    run's tokens/s, its ratio to the baseline and its exit code do not depend on it), the peak of SMALL_PEAK."""
    start = ["-c", SMALL_PEAK] if small_peak else ["-m", "llmtrain"]
    return subprocess.run([sys.executable, *start, "benchmark", *flags], capture_output=True, text=True,
                          timeout=600, env=env, cwd=cwd)


def run_benchmarks(*flag_lists, cwd) -> list[subprocess.CompletedProcess]:
    """Several benchmark commands side by side (one thread each, so two share this machine's two cores); for tests
    that check what a run reports, never how fast it was, nor the matmul peak (SMALL_PEAK)."""
    started = [(flags, subprocess.Popen([sys.executable, "-c", SMALL_PEAK, "benchmark", *flags], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=ENV, cwd=cwd))
               for flags in flag_lists]
    done = []
    try:
        for flags, process in started:
            stdout, stderr = process.communicate(timeout=600)
            done.append(subprocess.CompletedProcess(flags, process.returncode, stdout, stderr))
    finally:
        for _, process in started:
            process.kill()
    return done


@pytest.mark.slow
def test_short_benchmark_reports_sane_numbers_and_compares_with_the_baseline(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))  # a machine's own baseline goes there
    done = run_benchmark("--short", "true", "--out_dir", str(tmp_path / "bench"), cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    with capsys.disabled():  # past pytest's capture: CI's log shows the ratio even when the test passes
        ratio_line = next(line for line in done.stdout.splitlines()
                          if line.startswith("tokens/s vs baseline") or "is now the baseline" in line)
        print(f"\n[benchmark --short] {ratio_line}")
    results = tmp_path / "bench" / "benchmarks.jsonl"  # the default place
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert set(record) - {"baseline_ratio"} == set(RECORD_FIELDS)
    for key in ("tokens_per_sec_per_device", "tokens_per_sec", "step_time_median_s", "mfu", "matmul_peak_flops",
                "peak_memory_gb", "flops_per_token"):
        assert math.isfinite(record[key]) and record[key] > 0, (key, record[key])
    assert 0 < record["mfu"] < 1.5  # against the measured peak; CPU peaks are noisy
    assert 0 <= record["data_wait_fraction"] <= 1
    assert record["step_time_min_s"] <= record["step_time_p25_s"] <= record["step_time_median_s"]
    assert record["step_time_median_s"] <= record["step_time_p75_s"] <= record["step_time_max_s"]
    assert record["tokens_per_sec_per_device"] == pytest.approx(4 * 128 / record["step_time_median_s"])
    assert (record["model"], record["micro_batch_size"], record["seq_len"], record["steps"], record["warmup"]) == (
        "llama-debug", 4, 128, 3, 2)
    assert record["threads_per_process"] == 1 and record["torch"] == torch.__version__ and record["commit"]
    assert record["command"] == "llmtrain benchmark --short true --out_dir " + str(tmp_path / "bench")
    assert record["device"] and record["matmul_peak_size"] in (2048, 3072, 4096)
    # This machine's CPU has a baseline in the repository, or the run recorded one in the machine's file.
    key = baseline_key(record)
    if key in json.loads(DEFAULT_BASELINE.read_text()):
        assert f"tokens/s vs baseline: {record['baseline_ratio']:.2f}x" in done.stdout and record["baseline_ratio"] > 0
    else:
        assert "is now the baseline" in done.stdout and "baseline_ratio" not in record
        assert json.loads(machine_baseline_file().read_text())[key]["commit"] == record["commit"]
    assert [p.name for p in (tmp_path / "bench").iterdir()] == ["benchmarks.jsonl"]  # the training run is gone


@pytest.mark.slow
def test_the_readmes_regression_check_compares_with_the_stored_baseline(tmp_path):
    """The README's regression check, run as written in a shell without OMP_NUM_THREADS of its own. On a machine that
    llmtrain/benchmark/baseline.json has a number for, it compares with that number (a command that instead records
    a baseline of its own passes whatever the speed, and checks nothing); on any other, it records one and passes."""
    import re
    import shlex

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (command,) = re.findall(r"the regression check is its own command: `([^`]+)`", readme.replace("\n", " "))
    words = shlex.split(command)
    env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[:2] == ["llmtrain", "benchmark"]
    stored = any(key.startswith(device_name("cpu") + "|") for key in json.loads(DEFAULT_BASELINE.read_text()))
    env["LLMTRAIN_CACHE_DIR"] = str(tmp_path / "cache")  # no baseline of this machine's own to fall back on
    # The comparison is of tokens/s, which the matmul peak plays no part in (the short benchmark above checks the
    # real peak and MFU): measured on small products, it costs a second instead of 10-40 s twice.
    done = run_benchmark(*words[2:], "--out_dir", str(tmp_path / "bench"), cwd=tmp_path, env=env, small_peak=True)
    if not stored:  # a CPU the repository has no number for: the run is its first baseline
        assert done.returncode == 0 and "is now the baseline" in done.stdout, done.stdout[-2000:]
        return
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: a regression, which is a comparison too
    assert "tokens/s vs baseline: " in done.stdout and "is now the baseline" not in done.stdout, done.stdout[-2000:]


FAR_BELOW_KEY = f"{device_name('cpu')}|llama-debug|32-true|1|32|1|False|1"
OTHER_CPU_KEY = "Some Other CPU (64 cores)|llama-debug|32-true|1|32|1|False|1"


@pytest.fixture(scope="module")
def far_below(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Tiny --short runs against a baseline of 1e9 tokens/s for this CPU (their ratio is 0.00x), with and without
    --fail_below 0.3, and one with --fail_below 0.3 against a file that only another CPU has a baseline in, side
    by side."""
    root = tmp_path_factory.mktemp("far-below")
    far = {FAR_BELOW_KEY: {"tokens_per_sec_per_device": 1e9, "commit": "x"}}
    (root / "baseline.json").write_text(json.dumps(far))
    (root / "other-cpu.json").write_text(json.dumps({OTHER_CPU_KEY: {"tokens_per_sec_per_device": 1e9}}))
    modes = {"report": ("baseline.json", []), "fail": ("baseline.json", ["--fail_below", "0.3"]),
             "new machine": ("other-cpu.json", ["--fail_below", "0.3"])}
    flag_lists = [["--short", "true", "--micro_batch_size", "1", "--seq_len", "32", "--steps", "1", "--warmup", "1",
                   "--baseline", str(root / file), "--results", str(root / f"{mode}.jsonl"),
                   "--out_dir", str(root / f"bench-{mode}"), *extra] for mode, (file, extra) in modes.items()]
    done = run_benchmarks(*flag_lists, cwd=root)
    return {mode: (result, root / f"{mode}.jsonl") for mode, result in zip(modes, done)} | {"root": root}


@pytest.mark.slow
def test_short_benchmark_reports_a_low_ratio_without_failing(far_below):
    """Inside the test suite speed is reported, never a reason to fail: a busy machine is not a regression."""
    done, _ = far_below["report"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens/s vs baseline: 0.00x" in done.stdout


@pytest.mark.slow
def test_short_benchmark_fails_far_below_the_baseline_and_still_records(far_below):
    """The separate regression check: `llmtrain benchmark --short true --fail_below 0.3`."""
    done, results = far_below["fail"]
    assert done.returncode == 1, done.stderr[-3000:]
    assert "tokens/s vs baseline: 0.00x" in done.stdout
    assert "below 0.3x" in done.stderr and "performance regression" in done.stderr
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert baseline_key(record) == FAR_BELOW_KEY and record["baseline_ratio"] < 0.3


@pytest.mark.slow
def test_a_machine_without_a_baseline_records_one_and_passes(far_below):
    """The baseline is keyed by the CPU model: a file with only another CPU's is no baseline for this one, even
    far above it. The run passes --fail_below, and the file now holds its numbers under this CPU's key."""
    done, results = far_below["new machine"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens/s vs baseline" not in done.stdout and "is now the baseline" in done.stdout
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    stored = json.loads((far_below["root"] / "other-cpu.json").read_text())
    assert set(stored) == {OTHER_CPU_KEY, baseline_key(record)}
    assert baseline_key(record).startswith(device_name("cpu") + "|")
    assert stored[baseline_key(record)]["tokens_per_sec_per_device"] == record["tokens_per_sec_per_device"]


@pytest.mark.parametrize("flags, message", [
    ({"steps": 0}, "--steps must be at least 1, got 0"),
    ({"warmup": -1}, "--warmup must be at least 0"),
    ({"devices": 0}, "--devices must be at least 1"),
    ({"model": "gpt-5"}, "--model: Unknown model name 'gpt-5'"),
    ({"seq_len": 100000}, "--seq_len 100000 exceeds llama-debug's block size 512"),
    ({"sharding_strategy": "HALF_SHARD"}, "--sharding_strategy 'HALF_SHARD' must be one of FULL_SHARD"),
    ({"sharding_strategy": "NO_SHARD"}, "--sharding_strategy NO_SHARD needs --devices 2 or more"),
    ({"save_interval": 0}, "--save_interval must be at least 1, got 0"),
    ({"async_save": True}, "--async_save true needs --save_interval N"),
    ({"fail_below": 1000.0, "baseline": None}, "--fail_below compares with a baseline"),
    ({"devices": 2, "tp_size": 4}, "--tp_size 4 × --pp_size 1 = 4 must divide the 2 processes"),
    ({"global_batch_size": 6, "micro_batch_size": 4},
     "^--global_batch_size 6 is not divisible by data-parallel size 1 × --micro_batch_size 4 = 4; use "
     "--global_batch_size 4 or 8, or --micro_batch_size 3$"),
    ({"global_batch_size": 2, "micro_batch_size": 4}, "^--global_batch_size 2 is smaller than --micro_batch_size 4"),
    ({"devices": 2, "pp_size": 2, "pp_schedule": "1f1b", "global_batch_size": 8},
     "--pp_schedule 1f1b needs at least --pp_size 2 micro-batches per step"),
])
def test_bad_flags_are_named_before_anything_runs(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        benchmark(out_dir=tmp_path, **flags)
    assert not list(tmp_path.iterdir())


def test_matmul_peak_is_a_plausible_rate_and_names_its_size():
    peak, size = measure_matmul_peak(torch.float32, sizes=(256, 512), repeats=2)
    assert 1e9 < peak < 1e13 and size in (256, 512)  # between 1 GFLOP/s and 10 TFLOP/s on any CPU


def test_step_timing_counts_only_timed_steps_and_shares_out_a_skipped_step():
    from llmtrain.benchmark.timing import _step_timing

    def row(step, elapsed):
        return {"step": step, "elapsed_s": elapsed, "peak_memory_gb": 0.1 * step, "data_wait_fraction": None}

    # Step 1 (warm-up) took 5 s; steps 2 and 3 took 1 s each; step 4 logged no row, so 5 shares row 5's 4 s.
    rows = [row(1, 5.0), row(2, 6.0), row(3, 7.0), row(5, 11.0)]
    waits = [4.0, 0.1, 0.1, 0.2, 0.2]  # seconds per next(), one per step
    timing = _step_timing(rows, waits, warmup=1)
    assert timing["step_time_median_s"] == pytest.approx(1.5)
    assert (timing["step_time_min_s"], timing["step_time_max_s"]) == (1.0, 2.0)
    assert timing["data_wait_fraction"] == pytest.approx(0.6 / 6.0)  # the warm-up's 4 s wait is left out
    assert timing["peak_memory_gb"] == pytest.approx(0.5) and timing["data_wait_fraction_logged"] is None


def test_steps_after_a_save_give_the_stall_and_stay_out_of_the_step_times():
    from llmtrain.benchmark.timing import _step_timing

    # Saves after steps 2, 4 and 6 (interval 2): steps 3, 5 and 7 carry them (3, 4 and 3 s against 1 s).
    elapsed = [5.0, 6.0, 9.0, 10.0, 14.0, 15.0, 18.0]
    rows = [{"step": step, "elapsed_s": seconds, "peak_memory_gb": 0.1, "data_wait_fraction": None}
            for step, seconds in enumerate(elapsed, start=1)]
    timing = _step_timing(rows, [0.0] * 7, warmup=1, save_interval=2)
    assert (timing["step_time_median_s"], timing["step_time_max_s"]) == (1.0, 1.0)
    assert timing["checkpoint_saves"] == 3
    assert timing["checkpoint_stall_s"] == pytest.approx(2.0)
    assert timing["checkpoint_stall_max_s"] == pytest.approx(3.0)
    assert _step_timing(rows, [0.0] * 7, warmup=1)["checkpoint_stall_s"] is None


@pytest.mark.slow
def test_async_and_sync_saves_report_their_stall(tmp_path):
    records = []
    modes = ("false", "true")
    flag_lists = [["--micro_batch_size", "1", "--seq_len", "32", "--steps", "4", "--warmup", "1", "--save_interval",
                   "2", "--async_save", mode, "--results", str(tmp_path / f"r-{mode}.jsonl"), "--out_dir",
                   str(tmp_path / f"bench-{mode}"), "--baseline", "null"] for mode in modes]
    for mode, done in zip(modes, run_benchmarks(*flag_lists, cwd=tmp_path)):
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        records.append(json.loads((tmp_path / f"r-{mode}.jsonl").read_text().splitlines()[-1]))
        assert "sharded saves" in done.stdout
    for record, async_save in zip(records, (False, True)):
        assert record["async_save"] is async_save and record["save_interval"] == 2
        assert record["checkpoint_saves"] == 2  # after steps 2 and 4, carried by steps 3 and 5
        assert math.isfinite(record["checkpoint_stall_s"])
        assert record["checkpoint_stall_max_s"] >= record["checkpoint_stall_s"]


def test_step_timing_counts_every_micro_batch_of_an_accumulating_step():
    from llmtrain.benchmark.timing import _step_timing

    rows = [{"step": step, "elapsed_s": 2.0 * step + 4.0, "peak_memory_gb": 0.1, "data_wait_fraction": None}
            for step in (1, 2, 3)]
    waits = [3.0, 3.0, 0.1, 0.2, 0.3, 0.4]  # two next() per step; the warm-up step's waited 6 s
    timing = _step_timing(rows, waits, warmup=1, micro_batches_per_step=2)
    assert timing["data_wait_fraction"] == pytest.approx(1.0 / 4.0)
    with pytest.raises(RuntimeError, match="2 fetch"):
        _step_timing(rows, waits[:5], warmup=1, micro_batches_per_step=2)


@pytest.mark.slow
def test_data_wait_with_accumulation_leaves_out_the_warm_up_fetches(tmp_path, monkeypatch, small_matmul_peak):
    """Two micro-batches per step: the warm-up step's two slow fetches are no part of the timed steps' wait."""
    import time

    from llmtrain.benchmark.data_timing import TimedLoader

    slow_fetches = 2

    def slow_start(self):
        inner = iter(self._loader)

        def batches():
            for index, batch in enumerate(inner):
                if index < slow_fetches:
                    time.sleep(0.5)
                yield batch

        object.__setattr__(self, "_iterator", batches())
        return self

    monkeypatch.setattr(TimedLoader, "__iter__", slow_start)
    record = benchmark(micro_batch_size=1, global_batch_size=2, seq_len=32, steps=2, warmup=1, out_dir=tmp_path,
                       baseline=None)
    assert record["data_wait_fraction"] < 0.2, record


TINY = dict(micro_batch_size=1, seq_len=32, steps=1, warmup=1)


@pytest.mark.parametrize("content, message", [
    ("{not json", "baseline file .*baseline.json is not valid JSON"),
    ("[1, 2]", "baseline file .*baseline.json holds a list"),
    (None, "baseline file .*baseline.json is a folder"),
])
def test_a_bad_baseline_file_is_named_before_the_run(tmp_path, content, message):
    baseline = tmp_path / "baseline.json"
    if content is None:
        baseline.mkdir()
    else:
        baseline.write_text(content)
    with pytest.raises(ValueError, match=message):
        benchmark(out_dir=tmp_path / "bench", baseline=baseline, **TINY)
    assert not (tmp_path / "bench").exists()  # refused before the matmul peak and the training run


def test_a_results_folder_is_named_before_the_run(tmp_path):
    (tmp_path / "results").mkdir()
    with pytest.raises(ValueError, match="--results .*results is a folder"):
        benchmark(out_dir=tmp_path / "bench", results=tmp_path / "results", baseline=None, **TINY)
    assert not (tmp_path / "bench").exists()


def test_the_baseline_key_tells_apart_a_global_batch_and_a_sharding_strategy():
    """A run with accumulation, or another sharding strategy, is another setting: its baseline is its own."""
    record = dict(device="CPU", model="llama-debug", precision="32-true", micro_batch_size=4, seq_len=128, devices=2,
                  compile=False, threads_per_process=1, tp_size=1, pp_size=1, strategy="auto", global_batch_size=8,
                  sharding_strategy=None, activation_checkpointing=False, recipe="pretrain", lora=None)
    plain = baseline_key(record)
    assert plain == "CPU|llama-debug|32-true|4|128|2|False|1"  # the defaults: the key recorded baselines have
    assert baseline_key({**record, "sharding_strategy": "FULL_SHARD"}) == plain  # the default, named
    keys = {baseline_key({**record, **change}) for change in (
        {"global_batch_size": 32}, {"sharding_strategy": "NO_SHARD"}, {"sharding_strategy": "SHARD_GRAD_OP"})}
    assert len(keys) == 3 and plain not in keys
    assert baseline_key({**record, "pp_size": 2, "global_batch_size": 8}) == plain + "|pp_size 2"  # 4 × 1 rank × 2


def test_mfu_is_taken_against_the_faster_of_the_peaks_before_and_after_the_run(tmp_path, monkeypatch):
    """A neighbour that slows the first measurement only must not inflate MFU: the peak is measured again after
    the run, and the faster of the two counts (whichever came first)."""
    import llmtrain.benchmark.machine as bench

    for measured in ([(1e9, 2048), (3e9, 3072)], [(3e9, 3072), (1e9, 2048)]):
        calls = iter(measured)
        monkeypatch.setattr(bench, "measure_matmul_peak", lambda dtype, device: next(calls))
        record = benchmark(out_dir=tmp_path / "bench", baseline=None, **TINY)
        assert next(calls, None) is None  # measured twice, no more
        assert (record["matmul_peak_flops"], record["matmul_peak_size"]) == (3e9, 3072)
        assert record["mfu"] == pytest.approx(record["flops_per_token"] * record["tokens_per_sec_per_device"] / 3e9)
