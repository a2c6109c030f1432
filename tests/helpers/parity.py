"""Two trainings agree: the same losses and gradient norms at every step, within float32's reordering noise."""

from __future__ import annotations

import torch

import dist_worker as worker

LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4


def assert_same_training(result: dict, reference: dict, steps=range(1, worker.MAX_STEPS + 1)) -> None:
    steps = list(steps)
    assert sorted(result["losses"]) == steps
    losses = torch.tensor([result["losses"][s] for s in steps])
    expected = torch.tensor([reference["losses"][s] for s in steps])
    torch.testing.assert_close(losses, expected, rtol=LOSS_RTOL, atol=0)
    norms = torch.tensor([result["grad_norms"][s] for s in steps])
    expected_norms = torch.tensor([reference["grad_norms"][s] for s in steps])
    torch.testing.assert_close(norms, expected_norms, rtol=GRAD_NORM_RTOL, atol=0)
