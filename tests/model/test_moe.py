"""The mixture-of-experts MLP against a per-token reference, its two expert paths, its balancing losses and bias."""

import pytest
import torch
import torch.nn.functional as F

from llmtrain.config import Config
from llmtrain.model import GPT
from llmtrain.moe import (MoE, expert_products, load_balancing_loss, moe_stats, reset_moe_stats, router_z_loss,
                          set_aux_loss_scale, update_expert_bias)


def small_config(**overrides) -> Config:
    fields = dict(name="moe-test", block_size=64, vocab_size=128, padding_multiple=64, n_layer=2, n_embd=32,
                  n_head=4, n_query_groups=2, n_expert=4, n_expert_per_token=2, moe_intermediate_size=24)
    return Config(**{**fields, **overrides})


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """One token at a time: score, pick, run each chosen expert as a dense MLP, weight and sum."""
    out = torch.zeros_like(x)
    experts = moe.experts
    for n, token in enumerate(x):
        logits = moe.router(token).float()
        scores = logits.softmax(-1) if moe.score == "softmax" else logits.sigmoid()
        chosen = (scores + moe.expert_bias).topk(moe.k).indices
        weights = scores[chosen]
        if moe.norm_topk_prob:
            weights = weights / weights.sum()
        for weight, e in zip(weights, chosen.tolist()):
            hidden = F.silu(experts.gate_proj[e] @ token) * (experts.up_proj[e] @ token)
            out[n] += weight * (experts.down_proj[e] @ hidden)
        if moe.shared_experts is not None:
            out[n] += moe.shared_experts(token)
    return out


@pytest.mark.parametrize("overrides", [
    dict(),  # Mixtral: softmax, renormalised
    dict(norm_topk_prob=False),  # OLMoE
    dict(router_score="sigmoid", n_shared_expert=1, router_bias_update_rate=0.01),  # DeepSeek-like
])
def test_moe_matches_a_per_token_reference(overrides):
    torch.manual_seed(0)
    config = small_config(**overrides)
    moe = MoE(config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]) if config.router_bias_update_rate else 0)
    x = torch.randn(3, 5, config.n_embd)
    expected = reference_moe(moe, x.view(-1, config.n_embd)).view_as(x)
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)


def test_grouped_gemm_equals_one_product_per_expert():
    torch.manual_seed(0)
    E, D, I = 4, 32, 24
    gate, up, down = torch.randn(E, I, D), torch.randn(E, I, D), torch.randn(E, D, I)
    counts = torch.tensor([5, 0, 7, 4])  # an expert with no rows
    x = torch.randn(int(counts.sum()), D)
    outs, grads = [], []
    for grouped in (False, True):
        params = [t.clone().requires_grad_() for t in (x, gate, up, down)]
        y = expert_products(params[0], counts, *params[1:], grouped=grouped)
        y.backward(torch.ones_like(y).contiguous())
        outs.append(y)
        grads.append([p.grad for p in params])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_load_balancing_loss_is_one_when_uniform_and_e_when_collapsed():
    E, k, N = 4, 2, 8
    uniform = torch.full((N, E), 1 / E)
    assert load_balancing_loss(uniform, torch.full((E,), N * k // E), k, "softmax").item() == pytest.approx(1.0)
    collapsed = torch.zeros(N, E)
    collapsed[:, 0] = 1.0
    counts = torch.tensor([N * k, 0, 0, 0])
    assert load_balancing_loss(collapsed, counts, k, "softmax").item() == pytest.approx(E)
    logits = torch.tensor([[0.0, 2.0], [1.0, 1.0]])
    expected = (torch.logsumexp(logits, -1) ** 2).mean()
    assert router_z_loss(logits).item() == pytest.approx(expected.item())


def test_balancing_losses_enter_the_gradient_with_their_coefficients():
    torch.manual_seed(0)
    config = small_config(router_aux_loss_coef=0.3, router_z_loss_coef=0.05)
    moe = MoE(config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 6, config.n_embd)
    set_aux_loss_scale(0.5)
    try:
        moe(x).sum().backward()
    finally:
        set_aux_loss_scale(1.0)
    injected = moe.router.weight.grad.clone()
    moe.zero_grad()
    # The same losses written out: the output's sum plus half of the coefficients times the losses.
    flat = x.view(-1, config.n_embd)
    logits = moe.router(flat)
    scores = logits.float().softmax(-1)
    counts = torch.bincount(scores.topk(2).indices.flatten(), minlength=4)
    moe.eval()
    explicit = moe(x).sum() + 0.5 * (0.3 * load_balancing_loss(scores, counts, 2, "softmax")
                                     + 0.05 * router_z_loss(logits))
    explicit.backward()
    torch.testing.assert_close(injected, moe.router.weight.grad)


def test_stats_count_every_routed_row_and_the_bias_moves_towards_balance():
    torch.manual_seed(0)
    config = small_config(n_layer=2, router_bias_update_rate=0.1)
    model = GPT(config)
    model.init_weights()
    model.train()
    idx = torch.randint(0, config.vocab_size, (2, 16))
    model(idx)
    model(idx)
    stats = moe_stats(model)
    assert len(stats.names) == config.n_layer
    for load in stats.load:  # dropless: every token's k rows, two passes
        assert load.sum().item() == 2 * idx.numel() * config.n_expert_per_token
    assert all(ratio >= 1.0 for ratio in stats.max_over_mean())
    before = [model.blocks[i].mlp.expert_bias.clone() for i in range(config.n_layer)]
    update_expert_bias(model, 0.1, stats)
    for i, load in enumerate(stats.load):
        moved = model.blocks[i].mlp.expert_bias - before[i]
        busiest, idlest = int(load.argmax()), int(load.argmin())
        assert moved[busiest].item() == pytest.approx(-0.1) and moved[idlest].item() == pytest.approx(0.1)
    reset_moe_stats(model)
    assert moe_stats(model) is None


def test_moe_model_runs_whole_and_with_the_kv_cache():
    torch.manual_seed(0)
    config = Config.from_name("moe-debug", n_layer=2)
    model = GPT(config)
    model.init_weights()
    idx = torch.randint(0, config.vocab_size, (1, 12))
    model.eval()
    with torch.no_grad():
        full = model(idx)
        model.set_kv_cache(batch_size=1, max_seq_length=16)
        prefix = model(idx[:, :8], torch.arange(8))
        last = model(idx[:, 8:], torch.arange(8, 12))
    torch.testing.assert_close(torch.cat([prefix, last], 1), full, rtol=1e-4, atol=1e-4)


def test_config_refuses_inconsistent_experts():
    with pytest.raises(ValueError, match="n_expert_per_token must be between 1 and n_expert"):
        small_config(n_expert_per_token=5)
    with pytest.raises(ValueError, match="only apply to a mixture of experts"):
        small_config(n_expert=0, n_expert_per_token=0, moe_intermediate_size=None, n_shared_expert=1)
    with pytest.raises(ValueError, match="gated MLPs"):
        small_config(mlp_class_name="GptNeoxMLP")


def test_compiled_moe_runs_its_experts_eagerly_for_every_routing():
    """What apply_compile arranges (the experts' loop kept out of the graph: rows per expert are data) makes a
    compiled MoE equal the eager one, output and gradients, for routings of other sizes, without a recompile. Importing
    llmtrain.moe alone must not import torch._dynamo (seconds of every process's start)."""
    import subprocess
    import sys

    probe = "import sys, llmtrain.moe; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"

    import torch._dynamo

    from llmtrain import moe as moe_module

    torch.manual_seed(0)
    block = MoE(small_config())
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe_module.keep_expert_products_eager()
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="eager")
    torch._dynamo.utils.counters.clear()
    for tokens in (5, 9, 17):
        x = torch.randn(1, tokens, 32, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_(True)
        out = compiled(x)
        expected = block(x_eager)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(expected.sum(), x_eager)[0])
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert any("_one_product_per_expert" in reason for reason in breaks), dict(breaks)  # not traced, run eagerly
    assert not torch._dynamo.utils.counters["recompiles"], dict(torch._dynamo.utils.counters["recompiles"])
