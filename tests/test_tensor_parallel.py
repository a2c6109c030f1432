"""Tensor parallelism (with and without sequence parallelism), alone and under FSDP, on real gloo ranks (CPU).

One launch per world size runs every scenario of that size (tp_worker.py); each test checks one claim against a
single process that runs the same code here with the same global batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_worker
import tp_worker

LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tensor_parallel")


@pytest.fixture(scope="module")
def single() -> dict:
    return tp_worker.train()


@pytest.fixture(scope="module")
def two(workdir) -> dict:
    return dist_worker.launch(2, "two", workdir, script=tp_worker.SCRIPT, timeout_s=300)


@pytest.fixture(scope="module")
def four(workdir) -> dict:
    return dist_worker.launch(4, "four", workdir, script=tp_worker.SCRIPT, timeout_s=300)


def assert_same_losses(result: dict, expected: dict, steps=range(1, tp_worker.MAX_STEPS + 1)) -> None:
    losses = torch.tensor([result["losses"][step] for step in steps])
    reference = torch.tensor([expected["losses"][step] for step in steps])
    torch.testing.assert_close(losses, reference, rtol=LOSS_RTOL, atol=0)


@pytest.mark.multiproc
@pytest.mark.parametrize("scenario", ["sp", "no_sp"])
def test_tp2_trains_like_one_process(two, single, scenario):
    assert two[scenario]["mesh"] == "tensor 2"
    assert_same_losses(two[scenario], single)
    torch.testing.assert_close(two[scenario]["weights"], single["weights"], rtol=1e-4, atol=1e-5)


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


# ------------------------------------------------------------------------------- checkpoints
@pytest.mark.multiproc
def test_sharded_checkpoint_from_dp2_tp2_resumes_at_dp4(four):
    assert four["dp4_resume"]["mesh"] == "shard 4"
    assert_same_losses(four["dp4_resume"], four["dp2_tp2"], steps=range(5, 9))


@pytest.mark.multiproc
def test_sharded_checkpoint_from_dp2_tp2_resumes_in_one_process(four, workdir):
    result = tp_worker.train(resume_from=workdir / "dp2_tp2" / "step-00000004")
    assert_same_losses(result, four["dp2_tp2"], steps=range(5, 9))
    torch.testing.assert_close(result["weights"], four["dp2_tp2"]["weights"], rtol=1e-4, atol=1e-5)


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
