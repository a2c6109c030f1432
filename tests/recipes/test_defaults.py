"""What the flags mean when left out or set to auto: --devices auto / -1, --precision auto, batch sizes and the
training length from a zoo model's config_hub recipe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from llmtrain.args import BatchDefaults, TrainArgs, batch_plan
from llmtrain.distributed.launch import resolve_devices
from llmtrain.distributed.runtime import Runtime, configure_process
from llmtrain.recipes.hub import pretrain_batch_defaults, pretrain_recipe, with_default_length
from llmtrain.precision import Precision, resolve_precision

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}
SRUN = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NNODES": "2"}


@pytest.mark.parametrize("devices", ["auto", -1])
def test_devices_auto_is_one_process_on_a_cpu_and_the_launchers_count_under_torchrun_and_srun(devices):
    assert resolve_devices(devices, 1, "cpu", environ={})[0] == 1
    assert resolve_devices(devices, 2, "cpu", environ=TORCHRUN)[0] == 2
    assert resolve_devices(devices, 2, "cuda", environ=SRUN)[0] == 4  # one task per device: the tasks per node
    assert resolve_devices(3, 1, "cpu", environ=TORCHRUN) == (3, "")  # a number is taken as given


def test_devices_auto_refuses_a_node_count_that_does_not_fit_the_launcher():
    with pytest.raises(ValueError, match=r"--num_nodes 3 × 2 is not the 4 it started in all; pass --num_nodes 2"):
        resolve_devices("auto", 3, "cpu", environ=TORCHRUN)
    without_local = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"}
    with pytest.raises(ValueError, match="started 4 processes, which --num_nodes 3 does not divide"):
        resolve_devices("auto", 3, "cpu", environ=without_local)
    with pytest.raises(ValueError, match=r"SLURM runs 8 tasks on 3 nodes"):
        resolve_devices("auto", 3, "cpu", environ={**SRUN, "SLURM_NNODES": "3"})
    for bad in (0, -2):
        with pytest.raises(ValueError, match=rf"--devices {bad} must be a number of processes per node"):
            resolve_devices(bad, 1, "cpu", environ={})


@pytest.mark.parametrize("device_type, gpu, expected", [
    ("cpu", None, "32-true"), ("cuda", "H100", "bf16-mixed"), ("cuda", "NVIDIA A100-SXM4-80GB", "bf16-mixed"),
    ("cuda", "Tesla V100-SXM2-32GB", "16-mixed"), ("cuda", "some future GPU", "bf16-mixed"),
])
def test_precision_auto(device_type, gpu, expected):
    chosen = resolve_precision("auto", device_type, gpu=gpu)
    assert chosen.name == expected and chosen.chosen_because
    assert chosen.describe().startswith(f"{expected} (auto: ")
    assert resolve_precision("bf16-true", device_type, gpu=gpu).describe() == "bf16-true"  # a named one is kept


def test_precision_auto_on_a_gpu_that_only_emulates_bf16_is_16_mixed(monkeypatch):
    """A V100 or T4 holds bf16 tensors but has no bf16 tensor cores: torch.cuda.is_bf16_supported() says yes unless
    asked without emulation. auto picks fp16 there, as the dry run for the same GPU does."""
    from llmtrain.generate import default_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Tesla V100-SXM2-32GB")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert resolve_precision("auto", "cuda").name == resolve_precision("auto", "cuda", gpu="V100").name == "16-mixed"
    assert default_precision(torch.device("cuda", 0)) == "32-true"


@pytest.mark.parametrize("name, device_type, expected", [
    ("32-true", "cuda", True), ("bf16-mixed", "cuda", True), ("16-mixed", "cuda", True),
    ("bf16-true", "cuda", False), ("16-true", "cuda", False), ("32-true", "cpu", False), ("bf16-mixed", "cpu", False),
])
def test_tf32_is_for_fp32_matmuls_on_cuda(name, device_type, expected):
    assert Precision(name).uses_tf32(device_type) is expected


def test_configure_process_turns_tf32_on_for_a_cuda_run_and_leaves_a_cpu_run_exact():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        configure_process(Runtime(), Precision("32-true"))
        assert torch.get_float32_matmul_precision() == "highest"
        configure_process(Runtime(device=torch.device("cuda", 0)), Precision("bf16-mixed"))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_an_unset_global_batch_is_rounded_up_so_that_it_divides_and_a_given_one_is_not():
    plan = batch_plan(TrainArgs(), data_parallel_size=3)
    assert (plan.global_batch_size, plan.micro_batch_size, plan.grad_accum_steps) == (72, 4, 6)
    assert "global 64 rounded up to a multiple of 3 ranks × micro 4" in plan.note
    exact = batch_plan(TrainArgs(), data_parallel_size=2)
    assert (exact.global_batch_size, exact.grad_accum_steps) == (64, 8) and "rounded" not in exact.note
    tinyllama = BatchDefaults(512, 4, "config_hub/pretrain/tinyllama.yaml")
    plan = batch_plan(TrainArgs(), data_parallel_size=32, defaults=tinyllama)
    assert (plan.global_batch_size, plan.micro_batch_size, plan.grad_accum_steps) == (512, 4, 4)
    plan = batch_plan(TrainArgs(micro_batch_size=2), data_parallel_size=40, defaults=tinyllama)
    assert plan.global_batch_size == 560 and plan.micro_batch_size == 2
    with pytest.raises(ValueError, match="--train.global_batch_size 64 is not divisible"):
        batch_plan(TrainArgs(global_batch_size=64), data_parallel_size=3)


def test_a_zoo_models_recipe_gives_its_batch_and_length_and_other_models_get_the_rule(tmp_path):
    recipe = yaml.safe_load((ROOT / "config_hub/pretrain/tinyllama.yaml").read_text())["train"]
    assert pretrain_recipe("tiny-llama-1.1b") == ROOT / "config_hub/pretrain/tinyllama.yaml"
    defaults = pretrain_batch_defaults("tiny-llama-1.1b")
    assert (defaults.global_batch_size, defaults.micro_batch_size) == (recipe["global_batch_size"],
                                                                       recipe["micro_batch_size"])
    assert with_default_length(TrainArgs(), "tiny-llama-1.1b").max_tokens == recipe["max_tokens"]
    assert pretrain_batch_defaults("SmolLM2-360M") == BatchDefaults()  # no recipe in config_hub
    assert with_default_length(TrainArgs(), "SmolLM2-360M").epochs == 1.0
    assert with_default_length(TrainArgs(max_steps=3), "tiny-llama-1.1b").max_tokens is None  # the flags win
    hub = tmp_path / "hub"
    (hub / "pretrain").mkdir(parents=True)
    (hub / "pretrain" / "mine.yaml").write_text("model_name: TinyLlama\ntrain: {micro_batch_size: 2, max_steps: 9}\n")
    assert pretrain_batch_defaults("tiny-llama-1.1b", hub) == BatchDefaults(64, 2, str(hub / "pretrain/mine.yaml"))
    assert with_default_length(TrainArgs(), "tiny-llama-1.1b", hub).max_steps == 9


def test_devices_minus_one_and_precision_auto_through_the_cli(tmp_path, dist_env):
    command = [sys.executable, "-m", "llmtrain", "pretrain", "pythia-14m", "--devices", "-1", "--accelerator", "cpu",
               "--dry_run", "--out_dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, env=dist_env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "1 devices × 1 nodes = 1 ranks on cpu" in done.stdout
    assert "precision    32-true (weights torch.float32, compute torch.float32); auto: CPU" in done.stdout
    done = subprocess.run([*command[:6], "auto", "--dry_run.gpu", "V100", *command[10:]], capture_output=True,
                          text=True, env=dist_env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "precision    16-mixed" in done.stdout and "the V100 has no bf16" in done.stdout
    assert "this machine has no V100 to count, so the plan is for one per node" in done.stdout
