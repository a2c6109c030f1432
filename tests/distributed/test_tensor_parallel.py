"""Tensor parallelism (with and without sequence parallelism), alone and under FSDP, on real gloo ranks (CPU).

One launch of 4 ranks runs every scenario (tp_worker.py), those of 2 ranks on the first 2; each test checks one claim
against a single process that runs the same code here with the same global batch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_worker
import tp_worker

ROOT = Path(__file__).resolve().parents[2]
LOSS_RTOL = 1e-5
# Tensor-parallel ranks sum each gradient in another order than one process (half the matmul, then an all-reduce),
# so an element that is a small sum of large terms differs by float32 rounding of those terms: on an Intel Xeon
# (MKL's blocking) one element of gpt-neox-debug's embedding gradient, -1.1e-3 in a tensor up to 2.9, came out
# 1.2e-6 apart. GRAD_ATOL leaves 4x that; a wrong gradient (a missing reduction, a doubled shard) is off by its
# own size.
GRAD_RTOL, GRAD_ATOL = 1e-4, 5e-6
# AdamW divides by the root of the second moment, so such a rounding difference in a gradient near zero moves its
# weight by a small part of a step: 1.9e-5 after 8 steps on the Intel Xeon, 0.4% of the learning rate (5e-3).
# WEIGHT_ATOL leaves about 3x that; a real difference moves weights by whole steps.
WEIGHT_RTOL, WEIGHT_ATOL = 1e-4, 5e-5


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tensor_parallel")


@pytest.fixture(scope="module")
def single() -> dict:
    return tp_worker.train()


@pytest.fixture(scope="module")
def launched(workdir) -> dict:
    """One launch of 4 ranks: suite "four" on all of them, then "two" on the first 2 in a process group of their own."""
    return dist_worker.launch(4, "four+two", workdir, script=tp_worker.SCRIPT, timeout_s=600)


@pytest.fixture(scope="module")
def two(launched) -> dict:
    return launched["two"]


@pytest.fixture(scope="module")
def four(launched) -> dict:
    return launched["four"]


def assert_same_losses(result: dict, expected: dict, steps=range(1, tp_worker.MAX_STEPS + 1)) -> None:
    losses = torch.tensor([result["losses"][step] for step in steps])
    reference = torch.tensor([expected["losses"][step] for step in steps])
    torch.testing.assert_close(losses, reference, rtol=LOSS_RTOL, atol=0)


@pytest.mark.multiproc
@pytest.mark.parametrize("scenario", ["sp", "no_sp", "sp_checkpointed", "sp_op_checkpointed"])
def test_tp2_trains_like_one_process(two, single, scenario):
    assert two[scenario]["mesh"] == "tensor 2"
    assert_same_losses(two[scenario], single)
    torch.testing.assert_close(two[scenario]["weights"], single["weights"], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [*tp_worker.FAMILIES, "llama-debug no_sp"])
def test_every_family_has_the_same_loss_and_gradients_at_tp2(two, name):
    result = two[name]
    expected = tp_worker.gradients(name=name.split()[0])
    torch.testing.assert_close(result["loss"], expected["loss"], rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(result["eval_loss"], expected["eval_loss"], rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(result["logits"], expected["logits"], rtol=1e-5, atol=1e-5)  # gathered
    assert sorted(result["grads"]) == sorted(expected["grads"])
    for param_name, grad in expected["grads"].items():
        torch.testing.assert_close(result["grads"][param_name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=param_name)


@pytest.mark.multiproc
def test_fsdp_times_tp_trains_like_one_process(four, single):
    assert four["dp2_tp2"]["mesh"] == "shard 2 × tensor 2"
    assert_same_losses(four["dp2_tp2"], single)


@pytest.mark.multiproc
def test_hsdp_times_tp_on_a_3d_mesh_trains_like_one_process(four, single):
    result = four["hsdp_tp"]
    assert result["mesh"] == "replicate 2 × shard 1 × tensor 2"
    assert_same_losses(result, single)


# ------------------------------------------------------------------------------- checkpoints
@pytest.mark.multiproc
def test_sharded_checkpoint_from_dp2_tp2_resumes_at_dp4(four):
    assert four["dp4_resume"]["mesh"] == "shard 4"
    assert_same_losses(four["dp4_resume"], four["dp2_tp2"], steps=range(5, 9))


@pytest.mark.multiproc
def test_sharded_checkpoint_from_dp2_tp2_resumes_in_one_process(four, workdir):
    result = tp_worker.train(resume_from=workdir / "dp2_tp2" / "step-00000004")
    assert_same_losses(result, four["dp2_tp2"], steps=range(5, 9))
    torch.testing.assert_close(result["weights"], four["dp2_tp2"]["weights"], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)


@pytest.mark.multiproc
@pytest.mark.parametrize("run", ["dp2_tp2", "dp2_tp2_full"])
def test_full_weights_written_under_tp_are_the_gathered_model(four, workdir, run):
    from llmtrain.checkpoint.weights import load_weights
    from llmtrain.model import GPT

    model = GPT(dist_worker.tiny_config())
    load_weights(model, workdir / run / "final")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, four[run]["weights"][name]), name


@pytest.mark.multiproc
def test_full_checkpoint_written_under_tp_resumes_in_one_process(four, workdir):
    result = tp_worker.train(resume_from=workdir / "dp2_tp2_full" / "step-00000004")
    assert_same_losses(result, four["dp2_tp2_full"], steps=range(5, 9))


# ----------------------------------------------------------------------------------- the CLI
@pytest.mark.multiproc
def test_pretrain_cli_at_dp2_tp2_converts_to_transformers_with_the_same_logits(tmp_path, dist_env, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from llmtrain.cli import main
    from llmtrain.generate import load_model_dir

    out_dir = tmp_path / "tp"
    # The cache of test_convert_e2e.py: the same 2 MB sample of the corpus, tokenized once per session.
    env = dict(dist_env, LLMTRAIN_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "convert-cache"))
    command = [sys.executable, "-m", "llmtrain", "pretrain", "--config", str(ROOT / "config_hub/pretrain/debug.yaml"),
               "--devices", "4", "--tp_size", "2", "--train.max_steps", "4", "--train.max_seq_length", "64",
               "--eval.max_iters", "1", "--data.max_bytes", "2000000", "--out_dir", str(out_dir)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "mesh shard 2 × tensor 2, sequence parallel" in done.stdout
    hf_dir = tmp_path / "hf"
    main(["convert", "to_hf", str(out_dir / "final"), str(hf_dir)])
    ids = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    model, *_ = load_model_dir(out_dir / "final", device="cpu", dtype=torch.float32)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids)[..., :hf_model.config.vocab_size],
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.multiproc
def test_tp_size_that_does_not_divide_the_heads_exits_2_before_any_worker(tmp_path, dist_env):
    from refusals import DEBUG, HANG_GUARD_S, assert_one_message

    command = [sys.executable, "-m", "llmtrain", *DEBUG, "--devices", "3", "--tp_size", "3",
               "--out_dir", str(tmp_path / "o")]
    done = subprocess.run(command, capture_output=True, text=True, env=dist_env, timeout=HANG_GUARD_S, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert_one_message(done.stderr, "--tp_size 3 must divide the 4 attention heads (n_head) of model 'llama-debug'")
    assert not (tmp_path / "o").exists()


def test_no_validation_example_when_the_model_is_split():
    from types import SimpleNamespace

    from llmtrain.recipes.run import _example_generator

    data = SimpleNamespace(validation_prompts=lambda: [[{"role": "user", "content": "hi"}]])
    for splits_model, expected in ((True, False), (False, True)):
        spec = SimpleNamespace(data=data, plan=SimpleNamespace(splits_model=splits_model, wrapper="none"), seq_len=32)
        assert (_example_generator(spec, None, None, "alpaca", None) is not None) is expected
