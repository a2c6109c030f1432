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
