"""Gradient clipping (llmtrain.distributed.grad_norm) in one process; the meshes' cases run in test_parallel."""

import pytest
import torch

from llmtrain.distributed.grad_norm import clip_grad_norm_


def _params_and_grads(seed=0):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((64, 32), (32,), (7, 5))]
    grads = [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(4)]
    return params, grads


@pytest.mark.parametrize("max_norm", [0.5, float("inf")])
def test_clipping_handed_to_a_fused_optimizer_steps_as_clipping_first(max_norm):
    """Fused AdamW scaling the gradients by ``grad_scale`` as it reads them takes the steps that clipping the
    gradients first takes, and the gradients stay as they were until that step."""
    results = []
    for hand_over in (False, True):
        params, grads = _params_and_grads()
        optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=True)
        norms = []
        for step_grads in grads:
            for param, grad in zip(params, step_grads):
                param.grad = grad.clone()
            norm = clip_grad_norm_(params, max_norm, optimizer=optimizer if hand_over else None)
            want_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in step_grads]))
            torch.testing.assert_close(norm, want_norm)
            if hand_over:
                assert all(torch.equal(p.grad, g) for p, g in zip(params, step_grads))
            norms.append(norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert max_norm == float("inf") or all(n > max_norm for n in norms)  # every step clipped
        results.append([p.detach().clone() for p in params])
    for clipped_first, handed_over in zip(*results):
        torch.testing.assert_close(handed_over, clipped_first, rtol=1e-6, atol=1e-7)


def test_clipping_cannot_be_handed_to_an_optimizer_that_does_not_unscale():
    params, grads = _params_and_grads()
    for param, grad in zip(params, grads[0]):
        param.grad = grad
    with pytest.raises(ValueError, match="does not unscale"):
        clip_grad_norm_(params, 1.0, optimizer=torch.optim.AdamW(params, foreach=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_norm_is_every_gradients_norm_and_non_finite_stays_non_finite(dtype):
    """The CPU's dot products (float32 and wider, contiguous) and torch's norms (the rest, here a transposed
    gradient and bfloat16) give the norm of all gradients together."""
    params, grads = _params_and_grads()
    for param, grad in zip(params, grads[0]):
        param.data, param.grad = param.data.to(dtype), grad.to(dtype)
    params[0].grad = params[0].grad.t().contiguous().t()  # the same values, not contiguous
    want = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads[0]]))
    norm = clip_grad_norm_(params, float("inf"))
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)
    params[0].grad = params[0].grad.contiguous()
    torch.testing.assert_close(clip_grad_norm_(params, float("inf")).double(), want,
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)
    params[1].grad[3] = float("inf")
    assert clip_grad_norm_(params, 1.0).isinf()
    params[1].grad[3] = float("nan")
    assert clip_grad_norm_(params, 1.0).isnan()
