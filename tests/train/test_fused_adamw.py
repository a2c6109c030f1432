"""AdamW runs fused (one kernel over every tensor) unless told otherwise, and matches the loop implementation."""

import torch

from llmtrain.optim import build_optimizer


def test_adam_runs_fused_unless_told_otherwise():
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    assert build_optimizer("AdamW", params).defaults["fused"] is True
    assert build_optimizer("torch.optim.Adam", params).defaults["fused"] is True
    explicit = build_optimizer(lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True), params)
    assert explicit.defaults["foreach"] is True and not explicit.defaults["fused"]
    assert build_optimizer(lambda p: torch.optim.AdamW(p, fused=False), params).defaults["fused"] is False
    kept = build_optimizer(lambda p: torch.optim.AdamW(p, lr=0.123, betas=(0.8, 0.9), weight_decay=0.3), params)
    assert kept.defaults["fused"] and kept.defaults["lr"] == 0.123 and kept.defaults["betas"] == (0.8, 0.9)
    assert kept.defaults["weight_decay"] == 0.3


def test_fused_adamw_matches_the_loop_implementation():
    torch.manual_seed(0)
    weights = [torch.randn(64, 64) for _ in range(3)]
    results = []
    for kwargs in ({"foreach": False}, {"fused": True}):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kwargs)
        for step in range(5):
            for index, p in enumerate(params):
                p.grad = torch.sin(p.detach() * (step + index + 1))
            optimizer.step()
        results.append(params)
    for loop, fused in zip(*results):
        assert torch.allclose(loop, fused, rtol=1e-5, atol=1e-7)
