"""--compile auto: the rule (the run's FLOPs at the device's peak against AUTO_MIN_SECONDS), the layouts it leaves
eager, and a run it compiles end to end."""

from __future__ import annotations

import os
import re

import pytest
import torch

from llmtrain.args import TrainArgs
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.flops import flops_per_token
from llmtrain import compiling
from llmtrain.compiling import AUTO_MIN_SECONDS, choose

CPU = torch.device("cpu")
PEAK = 1e12  # FLOP/s the tests' device "measures"


def plan(devices: int = 1, tp: int = 1, precision: str = "32-true", quantize=None) -> ParallelPlan:
    train = TrainArgs(global_batch_size=8, micro_batch_size=4 // tp if tp > 1 else 4, max_seq_length=256)
    return ParallelPlan.resolve(devices=devices, num_nodes=1, train=train, precision=precision, tp=tp)


def steps_for(seconds: float, config: Config, the_plan: ParallelPlan, seq_len: int = 256) -> int:
    """Steps whose FLOPs take ``seconds`` at PEAK on each data-parallel rank."""
    tokens_per_step = the_plan.batch.global_batch_size * seq_len / the_plan.data_parallel_size
    return round(seconds * PEAK / (tokens_per_step * flops_per_token(config, seq_len)))


def auto(the_plan: ParallelPlan, steps: int, *, recipe: str = "pretrain", max_time=None, quantize=None,
         config: Config = None):
    return choose("auto", recipe=recipe, config=config or Config.from_name("llama-debug"), plan=the_plan,
                  seq_len=256, total_steps=steps, max_time=max_time, device=CPU, quantize=quantize,
                  peak=lambda device, dtype: PEAK)


def test_auto_compiles_a_run_whose_flops_need_the_threshold_at_peak():
    config, one = Config.from_name("llama-debug"), plan()
    long = steps_for(AUTO_MIN_SECONDS * 1.01, config, one)
    short = steps_for(AUTO_MIN_SECONDS * 0.99, config, one)
    on, off = auto(one, long), auto(one, short)
    assert on.enabled and "compiled blocks" in on.reason and f"{long:,} steps" in on.reason
    assert not off.enabled and "--compile true to compile anyway" in off.reason
    # The floor is per data-parallel rank: two ranks split the batch, so the same steps take half as long.
    assert not auto(plan(devices=2), long).enabled
    assert auto(plan(devices=2), 2 * long).enabled


def test_auto_counts_max_time_as_the_runs_length():
    config, one = Config.from_name("llama-debug"), plan()
    steps = steps_for(10 * AUTO_MIN_SECONDS, config, one)
    assert auto(one, steps).enabled
    capped = auto(one, steps, max_time=AUTO_MIN_SECONDS / 2)
    assert not capped.enabled and "under the" in capped.reason


@pytest.mark.parametrize("case, expected", [
    ("finetune", "fine-tuning batches vary in width"),
    ("tensor", "not tensor parallelism"),
    ("quantize", "not --quantize bnb.nf4"),
])
def test_auto_leaves_unmeasured_layouts_eager_and_says_why(case, expected):
    many = 10**9
    choice = {"finetune": lambda: auto(plan(), many, recipe="finetune_lora"),
              "tensor": lambda: auto(plan(devices=2, tp=2), many),
              "quantize": lambda: auto(plan(), many, quantize="bnb.nf4")}[case]()
    assert not choice.enabled and expected in choice.reason


def test_auto_stays_eager_without_a_compiler(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    choice = auto(plan(), 10**9)
    assert not choice.enabled and "no C++ compiler on PATH" in choice.reason


def test_true_and_false_decide_outright():
    for setting in (True, False):
        choice = choose(setting, recipe="finetune_lora", config=Config.from_name("llama-debug"), plan=plan(),
                        seq_len=256, total_steps=1, max_time=None, device=CPU,
                        peak=lambda device, dtype: pytest.fail("an explicit setting measures nothing"))
        assert choice.enabled is setting


def test_measured_peak_is_a_plausible_cpu_rate():
    rate = compiling.measured_peak_flops(CPU, torch.float32)
    assert 1e8 < rate < 1e14


def test_the_readme_run_stays_eager_on_a_fast_cpu():
    """The README's first command (llama-debug, 400 steps of 16 x 256) needs 2.4 min at 300 GFLOP/s, the fp32
    peak of the 2-core CPUs measured here: auto leaves it eager, since compiling did not make it faster there."""
    config = Config.from_name("llama-debug")
    train = TrainArgs(global_batch_size=16, micro_batch_size=8, max_seq_length=256)
    readme = ParallelPlan.resolve(devices=1, num_nodes=1, train=train, precision="32-true")
    choice = choose("auto", recipe="pretrain", config=config, plan=readme, seq_len=256, total_steps=400,
                    max_time=None, device=CPU, peak=lambda device, dtype: 300e9)
    assert not choice.enabled
    assert re.search(r"at least 2\.\d min", choice.reason), choice.reason


@pytest.mark.parametrize("flags, expected", [
    (("--dry_run.gpu", "H100"),
     "--compile auto: compiled blocks (2,861,023 steps need at least 8.0 days at 989 TFLOP/s"),
    (("--dry_run.gpu", "H100", "--train.max_steps", "10"), "--compile auto: not compiled (10 steps need at least"),
    (("--train.epochs", "1"), "--compile auto: decided at start, once it knows the step count"),
    (("--compile", "false"), "compile      no (--compile false)"),
])
def test_the_dry_run_says_what_compile_does(flags, expected, capsys):
    """tiny-llama on 8 x 4 devices, as the design's usage line: --compile auto's decision is in the plan."""
    from llmtrain.cli import main

    main(["pretrain", "tiny-llama", "--devices", "8", "--num_nodes", "4", "--dry_run", *flags])
    assert expected in capsys.readouterr().out


@pytest.mark.slow
def test_a_long_enough_run_is_compiled_by_default(tmp_path, tiny_model_file, compiled_blocks, monkeypatch, capsys):
    """With the threshold at 0 any pretraining run is long enough: the default --compile auto compiles each
    Block and says so; the same short run with the real threshold stays eager."""
    from llmtrain.cli import main
    from runs import pretrain_args

    compiled = compiled_blocks
    args = ("--train.max_steps", "2", "--eval.final_validation", "false")
    main(pretrain_args(tiny_model_file, tmp_path / "short", *args))
    assert compiled == [] and "--compile auto: not compiled" in capsys.readouterr().out
    monkeypatch.setattr(compiling, "AUTO_MIN_SECONDS", 0.0)
    main(pretrain_args(tiny_model_file, tmp_path / "long", *args))
    assert compiled and all(compiled)
    assert "--compile auto: compiled blocks" in capsys.readouterr().out


def test_a_resumed_run_counts_only_the_steps_left():
    from pathlib import Path

    from llmtrain.recipes.run import _resumed_step

    assert _resumed_step(Path("out/step-00000400")) == 400
    assert _resumed_step(Path("out/final")) == 0 and _resumed_step(None) == 0


def test_a_run_short_at_any_cpus_rate_measures_nothing(monkeypatch):
    """The test suite's many tiny runs decide without a matmul at start; a long one on the CPU measures."""
    measured = []
    monkeypatch.setattr(compiling, "measured_peak_flops", lambda device, dtype: measured.append(dtype) or PEAK)
    config, one = Config.from_name("llama-debug"), plan()
    any_cpu = compiling.CPU_CORE_FLOPS_BOUND * (os.cpu_count() or 1)
    short = choose("auto", recipe="pretrain", config=config, plan=one, seq_len=256, total_steps=10, max_time=None,
                   device=CPU)
    assert not short.enabled and measured == [] and "more than any" in short.reason
    long = choose("auto", recipe="pretrain", config=config, plan=one, seq_len=256,
                  total_steps=steps_for(2 * AUTO_MIN_SECONDS * any_cpu / PEAK, config, one), max_time=None, device=CPU)
    assert long.enabled and measured == [torch.float32]


def test_only_a_ranks_own_finding_is_put_to_the_vote():
    """A flag or the layout decides alike on every rank: no collective for it (the 2-rank vote itself runs in
    tests/distributed/test_parallelize.py over gloo)."""
    from types import SimpleNamespace

    def no_collective(*args, **kwargs):
        raise AssertionError("a choice every rank shares needs no all-reduce")

    runtime = SimpleNamespace(is_distributed=True, all_reduce=no_collective)
    for choice in (auto(plan(devices=2, tp=2), 10**9), choose(True, recipe="pretrain", config=None, plan=None,
                                                              seq_len=1, total_steps=1, max_time=None, device=CPU)):
        assert compiling.agree(choice, runtime) is choice
