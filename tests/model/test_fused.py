"""One GEMM for q, k and v with RoPE and block attention written out (llmtrain.fused), against the Block's modules
run one by one; and where the fused path must not run."""

import contextlib

import pytest
import torch
import torch.nn as nn

from conftest import tiny_config
from llmtrain import fused
from llmtrain import model as model_module
from llmtrain.lora import LoRAArgs, apply_lora
from llmtrain.model import GPT


@pytest.fixture
def fused_calls(monkeypatch):
    """Block attention wherever the model allows it (as on a measured CPU, for the tests' short sequences); returns
    the list of (sequence length, attention's dtype) the fused path ran on."""
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_BLOCK_ATTENTION", True)
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_BF16_BLOCK_ATTENTION", True)
    monkeypatch.setattr(model_module, "CPU_BLOCK_ATTENTION_MIN_ROWS", 1)
    calls = []
    original = model_module.qkv_attention

    def recording(x, *args):
        calls.append((x.size(1), args[-1]))
        return original(x, *args)

    monkeypatch.setattr(model_module, "qkv_attention", recording)
    return calls


def _model(name, dtype=torch.float32, seed=0, **overrides):
    torch.manual_seed(seed)
    model = GPT(tiny_config(name, **overrides))
    model.init_weights()
    with torch.no_grad():  # biases away from zero, so that a dropped or misplaced one shows
        for param in model.parameters():
            if param.ndim == 1 and "norm" not in next(n for n, p in model.named_parameters() if p is param):
                param.normal_(std=0.1)
    return model.to(dtype)


def _loss_and_grads(model, tokens, fused_on, monkeypatch):
    monkeypatch.setattr(model_module, "fusable", fused.fusable if fused_on else lambda *_: False)
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name, overrides", [
    ("llama-debug", {}),  # grouped-query attention
    ("llama-debug", {"bias": True}),  # biases on every projection
    ("qwen2-debug", {}),  # biases on q, k and v only
    ("gemma-debug", {}),  # multi-query, head size above n_embd / n_head
    ("llama-debug", {"n_query_groups": 4}),  # multi-head
])
def test_fused_path_computes_what_the_modules_compute(monkeypatch, fused_calls, name, overrides):
    """float64, with block attention forced: loss and every gradient equal the modules' to float64 rounding."""
    monkeypatch.setattr(model_module, "attention_kernel", lambda *args, **kwargs: "blocks")
    model = _model(name, torch.float64, **overrides)
    tokens = torch.randint(0, model.config.vocab_size, (2, 41))
    want_loss, want_grads = _loss_and_grads(model, tokens, False, monkeypatch)
    assert not fused_calls
    loss, grads = _loss_and_grads(model, tokens, True, monkeypatch)
    assert fused_calls == [(40, torch.float64)] * model.config.n_layer
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0)
    for key, want in want_grads.items():
        torch.testing.assert_close(grads[key], want, rtol=1e-10, atol=1e-12 * want.abs().max().item(), msg=key)


def test_float32_model_takes_the_fused_path_where_the_rule_picks_blocks(monkeypatch, fused_calls):
    model = _model("llama-debug")
    tokens = torch.randint(0, model.config.vocab_size, (2, 49))
    want_loss, want_grads = _loss_and_grads(model, tokens, False, monkeypatch)
    loss, grads = _loss_and_grads(model, tokens, True, monkeypatch)
    assert fused_calls == [(48, torch.float32)] * model.config.n_layer
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for key, want in want_grads.items():
        assert (grads[key] - want).norm() <= 1e-5 * want.norm(), key
    with torch.no_grad():  # validation keeps SDPA and the modules
        model(tokens[:, :-1])
    monkeypatch.setattr(model_module, "CPU_BLOCK_ATTENTION_MAX_SEQ", 16)  # longer sequences: flash attention
    _loss_and_grads(model, tokens, True, monkeypatch)
    assert len(fused_calls) == model.config.n_layer


@pytest.mark.parametrize("attention_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_model_is_as_precise_fused(monkeypatch, fused_calls, attention_dtype):
    """A bfloat16 model, with attention in float32 or in bfloat16 blocks: the fused path's loss and gradients lie
    at least as close to the float64 model's as the modules' do (RoPE computes in float32 there). One loss's error is
    a draw of bfloat16 rounding (0.004 to 0.09 either way, by seed and CPU), so the losses are compared on the mean
    error over several models; each gradient's error, a norm over many entries, is steady and compared per model."""
    monkeypatch.setattr(model_module, "attention_dtype", lambda device, dtype, *args, **kwargs: attention_dtype)
    loss_errors = {False: [], True: []}
    for seed in range(6):
        reference = _model("llama-debug", torch.float64, seed=seed)
        tokens = torch.randint(0, reference.config.vocab_size, (2, 65))
        want_loss, want_grads = _loss_and_grads(reference, tokens, False, monkeypatch)
        model = reference.to(torch.bfloat16)
        grad_errors = {}
        for fused_on in (False, True):
            loss, grads = _loss_and_grads(model, tokens, fused_on, monkeypatch)
            loss_errors[fused_on].append(abs(loss.double() - want_loss).item())
            grad_errors[fused_on] = [((grads[k].double() - w).norm() / w.norm()).item() for k, w in want_grads.items()]
        assert fused_calls[-reference.config.n_layer:] == [(64, attention_dtype)] * reference.config.n_layer
        for got, want in zip(grad_errors[True], grad_errors[False]):
            assert got <= 1.25 * want + 1e-3
    assert len(fused_calls) == 6 * reference.config.n_layer
    mean = {fused_on: sum(errors) / len(errors) for fused_on, errors in loss_errors.items()}
    assert mean[True] <= 2 * mean[False] + 1e-3


def test_gradients_without_an_input_gradient(monkeypatch, fused_calls):
    """Attention whose input needs no gradient still gets its weights' (the first Block behind a frozen embedding
    and norm)."""
    monkeypatch.setattr(model_module, "attention_kernel", lambda *args, **kwargs: "blocks")
    model = _model("llama-debug", torch.float64)
    model.wte.weight.requires_grad_(False)
    model.blocks[0].attn_norm.weight.requires_grad_(False)
    tokens = torch.randint(0, model.config.vocab_size, (2, 33))
    want_loss, want_grads = _loss_and_grads(model, tokens, False, monkeypatch)
    loss, grads = _loss_and_grads(model, tokens, True, monkeypatch)
    assert len(fused_calls) == model.config.n_layer and model.wte.weight.grad is None
    assert want_grads.keys() == grads.keys() and "blocks.0.attn.q_proj.weight" in grads
    for key, want in want_grads.items():
        torch.testing.assert_close(grads[key], want, rtol=1e-10, atol=1e-14, msg=key)


def test_where_the_fused_path_does_not_run(monkeypatch, fused_calls):
    model = _model("llama-debug")
    attention = model.blocks[0].attn
    x = torch.randn(2, 8, model.config.n_embd)
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    assert fused.fusable(x, *projections)
    assert not fused.fusable(x.double(), *projections)  # weights of another dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fused.fusable(x, *projections)
    handle = attention.k_proj.register_forward_hook(lambda *args: None)
    assert not fused.fusable(x, *projections)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)  # a hook on every module
    assert not fused.fusable(x, *projections)
    handle.remove()
    for register in (attention.v_proj.register_full_backward_hook, attention.v_proj.register_full_backward_pre_hook,
                     nn.modules.module.register_module_full_backward_hook):
        handle = register(lambda *args: None)
        assert not fused.fusable(x, *projections), register
        handle.remove()
    assert fused.fusable(x, *projections)
    apply_lora(model, LoRAArgs())  # LoRA wraps q and v: their modules, not plain linears
    assert not fused.fusable(x, model.blocks[0].attn.q_proj, attention.k_proj, attention.v_proj)
    tokens = torch.randint(0, model.config.vocab_size, (2, 49))
    model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    assert not fused_calls
    gpt_neox = _model("gpt-neox-debug")  # RoPE over a quarter of each head: the modules run
    gpt_neox(tokens[:, :-1].clamp(max=gpt_neox.config.vocab_size - 1), labels=tokens[:, 1:].clamp(
        max=gpt_neox.config.vocab_size - 1)).backward()
    assert not fused_calls


def test_a_backward_hook_on_a_projection_sees_it_run(monkeypatch, fused_calls):
    """A hook that changes the input's gradient: the modules run, the hook acts, and the gradients are its."""
    model = _model("llama-debug")
    tokens = torch.randint(0, model.config.vocab_size, (2, 33))
    seen = []

    def halve(module, grad_input, grad_output):
        seen.append(module)
        return tuple(None if g is None else g / 2 for g in grad_input)

    handles = [block.attn.q_proj.register_full_backward_hook(halve) for block in model.blocks]
    want_loss, want_grads = _loss_and_grads(model, tokens, False, monkeypatch)
    assert len(seen) == model.config.n_layer
    loss, grads = _loss_and_grads(model, tokens, True, monkeypatch)
    assert not fused_calls and len(seen) == 2 * model.config.n_layer
    for handle in handles:
        handle.remove()
    _, unhooked = _loss_and_grads(model, tokens, True, monkeypatch)
    assert len(fused_calls) == model.config.n_layer
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)  # the same modules ran
    for key, want in want_grads.items():
        torch.testing.assert_close(grads[key], want, rtol=0, atol=0, msg=key)
    assert not torch.allclose(unhooked["wte.weight"], want_grads["wte.weight"], rtol=1e-2)  # the hook changed the gradients


def test_fusable_refuses_a_linear_subclass():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    x = torch.randn(2, 4, 8)
    assert not fused.fusable(x, nn.Linear(8, 8), Scaled(8, 8))
    assert fused.fusable(x, nn.Linear(8, 8), nn.Linear(8, 4, bias=False))


@pytest.mark.parametrize("approximate", [None, "none", "tanh"])  # SwiGLU, GeGLU exact and tanh
@pytest.mark.parametrize("needs", ["both", "gate", "up"])
def test_gated_product_computes_what_the_composite_computes(approximate, needs):
    torch.manual_seed(0)
    gate, up, grad = (torch.randn(3, 5, 16, dtype=torch.float64) * 3 for _ in range(3))
    gate.requires_grad_(needs != "up")
    up.requires_grad_(needs != "gate")
    act = torch.nn.functional.silu if approximate is None else (
        lambda x: torch.nn.functional.gelu(x, approximate=approximate))
    inputs = [t for t in (gate, up) if t.requires_grad]
    want = act(gate) * up
    want_grads = torch.autograd.grad(want, inputs, grad)
    # the projections' outputs are fresh tensors the backward may overwrite: clones here
    got = fused.gated_product(gate * 1, up * 1, approximate)
    got_grads = torch.autograd.grad(got, inputs, grad)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("hooks", [None, "save_on_cpu", "identity"])
def test_gated_product_refuses_a_second_backward_loudly(hooks):
    """Also under saved-tensor hooks (activation checkpointing's, save_on_cpu), which hide the version counters from
    autograd: the second backward fails rather than read the buffers the first one overwrote."""
    gate, up = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    context = {None: contextlib.nullcontext, "save_on_cpu": torch.autograd.graph.save_on_cpu,
               "identity": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)}[hooks]
    with context():
        out = fused.gated_product(gate * 1, up * 1).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.backward()


def test_gated_mlp_in_the_model_computes_what_the_composite_computes(monkeypatch):
    calls = []
    real = model_module.gated_product
    monkeypatch.setattr(model_module, "gated_product", lambda *args: calls.append(args[2]) or real(*args))
    for name in ("llama-debug", "gemma-debug"):
        model = _model(name, torch.float64)
        tokens = torch.randint(0, model.config.vocab_size, (2, 33))
        monkeypatch.setattr(model_module, "may_overwrite_gating", lambda *args: False)
        want_loss, want_grads = _loss_and_grads(model, tokens, True, monkeypatch)
        assert not calls
        monkeypatch.setattr(model_module, "may_overwrite_gating", fused.may_overwrite_gating)
        loss, grads = _loss_and_grads(model, tokens, True, monkeypatch)
        assert calls == [model.blocks[0].mlp.approximate] * model.config.n_layer
        calls.clear()
        torch.testing.assert_close(loss, want_loss, rtol=1e-13, atol=0)
        assert want_grads.keys() == grads.keys()
        for key, want in want_grads.items():
            torch.testing.assert_close(grads[key], want, rtol=1e-12, atol=1e-14, msg=key)
    assert model.blocks[0].mlp.approximate == "tanh"  # gemma: GeGLU


def test_where_the_gated_product_does_not_run():
    mlp = _model("llama-debug").blocks[0].mlp
    x = torch.randn(2, 8, mlp.gate_proj.in_features, requires_grad=True)
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    projections = (mlp.gate_proj, mlp.up_proj)
    assert fused.may_overwrite_gating(x, gate, up, *projections)
    assert not fused.may_overwrite_gating(x, gate, gate, *projections)  # one buffer
    both = torch.cat([gate, up], dim=-1)
    assert not fused.may_overwrite_gating(x, *both.chunk(2, dim=-1), *projections)
    with torch.no_grad():
        assert not fused.may_overwrite_gating(x, mlp.gate_proj(x), mlp.up_proj(x), *projections)
    handle = mlp.up_proj.register_forward_hook(lambda *args: None)  # a hook may keep the output
    assert not fused.may_overwrite_gating(x, gate, up, *projections)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    assert not fused.may_overwrite_gating(x, gate, up, *projections)
    handle.remove()
    assert fused.may_overwrite_gating(x, gate, up, *projections)


def test_bfloat16_keeps_the_composite_gating():
    """In place, bfloat16's products were slower than out of place on the CPU (BENCHMARKS.md)."""
    mlp = _model("llama-debug", torch.bfloat16).blocks[0].mlp
    x = torch.randn(2, 8, mlp.gate_proj.in_features, dtype=torch.bfloat16, requires_grad=True)
    assert not fused.may_overwrite_gating(x, mlp.gate_proj(x), mlp.up_proj(x), mlp.gate_proj, mlp.up_proj)
    assert fused.may_overwrite_gating(x.float(), *(torch.randn(2, 8, 4, requires_grad=True) for _ in range(2)))
