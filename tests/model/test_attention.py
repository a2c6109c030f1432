"""Block-causal attention (llmtrain.attention) and the rule that picks it (llmtrain.model.attention_kernel)."""

import copy

import pytest
import torch

from conftest import tiny_config
from llmtrain import model as model_module
from llmtrain.attention import block_causal_attention, saved_scores_per_query
from llmtrain.distributed.parallelize import apply_activation_checkpointing, apply_compile
from llmtrain.model import GPT, attention_block, attention_kernel


def _inputs(B, n_head, groups, T, hs, dtype=torch.float64, seed=0):
    """q (B, nh, T, hs), k and v (B, ng, T, hs) as the model hands them over: transposed views of (B, T, heads, hs)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, n_head, hs, generator=generator, dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(B, T, groups, hs, generator=generator, dtype=dtype).transpose(1, 2) for _ in range(2))
    return q, k, v


def _reference(q, k, v):
    """Causal attention written out: each query head over its group's keys, (B, T, nh * hs)."""
    B, n_head, T, hs = q.shape
    group = torch.arange(n_head) // (n_head // k.size(1))
    scores = q @ k[:, group].transpose(-1, -2) / hs**0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, group]  # (B, nh, T, hs)
    return out.transpose(1, 2).reshape(B, T, n_head * hs)


@pytest.mark.parametrize("n_head, groups, T, block", [
    (4, 4, 37, 8),  # multi-head, a last block shorter than the others
    (4, 2, 64, 16),  # grouped-query
    (6, 2, 50, 16),  # three query heads per group
    (4, 1, 20, 32),  # multi-query, one block longer than the sequence
    (2, 2, 1, 4),  # a single position
])
def test_block_attention_output_and_gradients_equal_the_formula(n_head, groups, T, block):
    q, k, v = (t.requires_grad_() for t in _inputs(2, n_head, groups, T, 16))
    out = block_causal_attention(q, k, v, block)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    want = _reference(q, k, v)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    assert out.shape == (2, T, n_head * 16)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for got, expected in zip(grads, want_grads):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_block_attention_refuses_a_double_backward_loudly():
    """Its backward is written out and not differentiable: a gradient of its gradient fails rather than miss terms."""
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    y = block_causal_attention(q, k, v, 4)
    with pytest.raises(RuntimeError, match="_BlockCausalAttention computes first-order gradients only"):
        torch.autograd.grad(y.square().sum(), q, create_graph=True)
    (dq,) = torch.autograd.grad(y.square().sum(), q)  # a first-order gradient as ever
    assert dq.abs().sum() > 0


@pytest.mark.parametrize("n_head, groups", [(4, 2), (4, 4)])
def test_bfloat16_block_attention_is_as_precise_as_bfloat16_flash_attention(n_head, groups):
    """bfloat16 inputs: the output and each gradient lie as close to float64 attention as bfloat16 SDPA's do (within
    a quarter). Scores rounded to bfloat16 before the softmax would be about 1.7 times as far."""
    q, k, v = _inputs(2, n_head, groups, 128, 32, seed=1)
    q, k = 2 * q, 2 * k  # scores of a few units, where rounding them would matter
    grad_out = torch.randn(2, 128, n_head * 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def run(kernel, dtype):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = kernel(*inputs)
        return [out, *torch.autograd.grad(out, inputs, grad_out.to(dtype))]

    def sdpa(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.size(0), q.size(2), -1)

    want = run(_reference, torch.float64)
    blocks = run(lambda q, k, v: block_causal_attention(q, k, v, 32), torch.bfloat16)
    flash = run(sdpa, torch.bfloat16)
    for name, got, peer, exact in zip(("output", "dq", "dk", "dv"), blocks, flash, want):
        assert got.dtype == torch.bfloat16
        error, peer_error = ((t.double() - exact).norm() / exact.norm() for t in (got, peer))
        assert error <= 1.25 * peer_error, (name, error.item(), peer_error.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, block", [(256, 64), (200, 64), (128, 32), (10, 32)])
def test_saved_scores_per_query_counts_what_backward_keeps(T, block, dtype):
    """The memory estimate's count of kept probabilities is what autograd keeps: q, k, v and per query and head
    ``saved_scores_per_query`` probabilities, all in the inputs' dtype (the float32 scores are not kept)."""
    B, n_head, groups, hs = 2, 4, 2, 8
    q, k, v = (t.requires_grad_() for t in _inputs(B, n_head, groups, T, hs, dtype=dtype))
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block_causal_attention(q, k, v, block)
    inputs = B * T * n_head * hs + 2 * B * T * groups * hs
    assert sum(saved) == (inputs + B * n_head * T * saved_scores_per_query(T, block)) * q.element_size()
    # By hand: a query in block i keeps the scores of the (i + 1) * block keys up to its block's end.
    by_hand = sum(min(T, (position // block + 1) * block) for position in range(T)) / T
    assert saved_scores_per_query(T, block) == pytest.approx(by_hand)


@pytest.mark.parametrize("measured", [True, False])
@pytest.mark.parametrize("bf16_measured", [True, False])
def test_attention_kernel_rule(monkeypatch, measured, bf16_measured):
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_BLOCK_ATTENTION", measured)
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_BF16_BLOCK_ATTENTION", bf16_measured)
    longest, fewest = model_module.CPU_BLOCK_ATTENTION_MAX_SEQ, model_module.CPU_BLOCK_ATTENTION_MIN_ROWS
    blocks = "blocks" if measured else "sdpa"
    assert attention_kernel("cpu", torch.float32, 256, 4, 2) == blocks
    assert attention_kernel("cpu", torch.float32, longest, 12, 12) == blocks
    assert attention_kernel("cpu", torch.float32, fewest // 2, 4, 2) == blocks  # 2 query heads per group: enough rows
    assert attention_kernel("cpu", torch.float32, fewest // 2, 4, 4) == "sdpa"  # too few rows
    assert attention_kernel("cpu", torch.float32, longest + 1, 4, 2) == "sdpa"
    assert attention_kernel("cpu", torch.float32, 256, 4, 2, masked=True) == "sdpa"
    assert attention_kernel("cpu", torch.float32, 256, 4, 2, training=False) == "sdpa"
    assert attention_kernel("cuda", torch.float32, 256, 4, 2) == "sdpa"
    # bfloat16 (on a CPU with bfloat16 dot products; elsewhere bfloat16 models upcast first where it pays): up to its own
    # longest sequence, however few the rows.
    bf16_longest, bf16_blocks = model_module.CPU_BF16_BLOCK_ATTENTION_MAX_SEQ, "blocks" if bf16_measured else "sdpa"
    assert attention_kernel("cpu", torch.bfloat16, bf16_longest, 4, 2) == bf16_blocks
    assert attention_kernel("cpu", torch.bfloat16, 16, 4, 4) == bf16_blocks
    assert attention_kernel("cpu", torch.bfloat16, bf16_longest + 1, 4, 2) == "sdpa"
    assert attention_kernel("cpu", torch.bfloat16, 128, 4, 2, masked=True) == "sdpa"
    assert attention_kernel("cpu", torch.bfloat16, 128, 4, 2, training=False) == "sdpa"
    assert attention_kernel("cuda", torch.bfloat16, 128, 4, 2) == "sdpa"
    assert attention_kernel("cpu", torch.float16, 128, 4, 2) == "sdpa"
    assert attention_block(128) == 32 and attention_block(256) == 64


def _model_and_tokens(name="llama-debug", n_layer=2):
    torch.manual_seed(0)
    model = GPT(tiny_config(name, n_layer=n_layer))
    model.init_weights()
    return model, torch.randint(0, model.config.vocab_size, (2, 49))


def _losses_and_gradients(model, tokens):
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_gradients_close(grads, want_grads):
    """Equal up to float32 rounding: two kernels sum in different orders."""
    for got, want in zip(grads, want_grads):
        assert (got - want).norm() <= 1e-5 * want.norm()


@pytest.fixture
def block_attention_on_short_sequences(monkeypatch):
    """The rule as on a measured CPU, lowered so that the tests' short sequences take block attention; returns
    the list of sequence lengths block attention ran on."""
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_BLOCK_ATTENTION", True)
    monkeypatch.setattr(model_module, "CPU_BLOCK_ATTENTION_MIN_ROWS", 1)
    ran = []
    original = model_module.block_causal_attention

    def recording(q, k, v, block):
        ran.append((q.size(2), block, q.dtype))
        return original(q, k, v, block)

    monkeypatch.setattr(model_module, "block_causal_attention", recording)
    fused = model_module.qkv_attention

    def recording_fused(x, q_proj, k_proj, v_proj, cos, sin, head_size, block, dtype):
        # The q/k/v GEMM, RoPE and block attention in one (llmtrain.fused), where a model's projections allow.
        ran.append((x.size(1), block, dtype))
        return fused(x, q_proj, k_proj, v_proj, cos, sin, head_size, block, dtype)

    monkeypatch.setattr(model_module, "qkv_attention", recording_fused)
    return ran


@pytest.mark.parametrize("name", ["llama-debug", "gpt-neox-debug"])
def test_a_model_trains_with_block_attention_as_with_sdpa(monkeypatch, block_attention_on_short_sequences, name):
    """Loss and every gradient of a training step equal SDPA's; validation (no gradients) keeps SDPA."""
    model, tokens = _model_and_tokens(name)
    loss, grads = _losses_and_gradients(model, tokens)
    assert block_attention_on_short_sequences == [(48, 32, torch.float32)] * 2
    with torch.no_grad():
        model(tokens[:, :-1])
    assert len(block_attention_on_short_sequences) == 2
    monkeypatch.setattr(model_module, "CPU_BLOCK_ATTENTION_MAX_SEQ", 0)
    want_loss, want_grads = _losses_and_gradients(model, tokens)
    assert len(block_attention_on_short_sequences) == 2
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    _assert_gradients_close(grads, want_grads)


@pytest.mark.parametrize("mode", ["op", "full"])
def test_block_attention_under_activation_checkpointing(block_attention_on_short_sequences, mode):
    """Checkpointed Blocks give the gradients of the plain model: ``op`` keeps the scores' GEMM output, which the
    attention must not change after writing it (torch's checkpoint raises if it does)."""
    model, tokens = _model_and_tokens()
    want_loss, want_grads = _losses_and_gradients(model, tokens)
    checkpointed = copy.deepcopy(model)
    apply_activation_checkpointing(checkpointed, mode)
    loss, grads = _losses_and_gradients(checkpointed, tokens)
    assert len(block_attention_on_short_sequences) == 2 + 2 * 2  # the forward, and the recomputation
    assert torch.equal(loss, want_loss)
    for got, want in zip(grads, want_grads):
        assert torch.equal(got, want)


def test_bf16_model_attends_in_float32_blocks(monkeypatch, block_attention_on_short_sequences):
    """A bfloat16 model's training attention upcasts to float32 and runs as blocks where the rules say so, and
    trains as with float32 flash attention, up to bfloat16 rounding."""
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_FLOAT32_ATTENTION", True)
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_BF16_BLOCK_ATTENTION", False)  # else bfloat16 blocks
    model, tokens = _model_and_tokens(n_layer=1)
    model = model.to(torch.bfloat16)
    loss, grads = _losses_and_gradients(model, tokens)
    assert block_attention_on_short_sequences == [(48, 32, torch.float32)]
    monkeypatch.setattr(model_module, "CPU_BLOCK_ATTENTION_MAX_SEQ", 0)  # float32 SDPA (48 tokens upcast anyway)
    want_loss, want_grads = _losses_and_gradients(model, tokens)
    assert len(block_attention_on_short_sequences) == 1
    torch.testing.assert_close(loss, want_loss, rtol=1e-2, atol=0)
    for got, want in zip(grads, want_grads):
        assert (got.float() - want.float()).norm() <= 2e-2 * want.float().norm()


@pytest.mark.parametrize("upcast_measured", [False, True], ids=["amx", "avx512-bf16"])
def test_bf16_model_attends_in_bf16_blocks(monkeypatch, block_attention_on_short_sequences, upcast_measured):
    """On a CPU with bfloat16 dot products (AMX tiles, or AVX512-BF16 where the upcast rule holds otherwise) a
    bfloat16 model's training attention runs as bfloat16 blocks, and trains as with bfloat16 flash attention, up to
    bfloat16 rounding."""
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_FLOAT32_ATTENTION", upcast_measured)
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_BF16_BLOCK_ATTENTION", True)
    model, tokens = _model_and_tokens(n_layer=1)
    model = model.to(torch.bfloat16)
    loss, grads = _losses_and_gradients(model, tokens)
    assert block_attention_on_short_sequences == [(48, 32, torch.bfloat16)]
    monkeypatch.setattr(model_module, "CPU_BF16_BLOCK_ATTENTION_MAX_SEQ", 0)  # bfloat16 SDPA
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_FLOAT32_ATTENTION", False)  # not on an upcast copy
    want_loss, want_grads = _losses_and_gradients(model, tokens)
    assert len(block_attention_on_short_sequences) == 1
    torch.testing.assert_close(loss, want_loss, rtol=1e-2, atol=0)
    for got, want in zip(grads, want_grads):
        assert got.dtype == torch.bfloat16
        assert (got.float() - want.float()).norm() <= 2e-2 * want.float().norm()


@pytest.mark.slow
def test_block_attention_compiled(block_attention_on_short_sequences):
    """Each Block compiled (``--compile``) traces block attention and gives eager's gradients."""
    model, tokens = _model_and_tokens()
    want_loss, want_grads = _losses_and_gradients(model, tokens)
    compiled = copy.deepcopy(model)
    apply_compile(compiled)
    loss, grads = _losses_and_gradients(compiled, tokens)
    assert len(block_attention_on_short_sequences) == 2 + 2  # eager, then once per Block while tracing
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    _assert_gradients_close(grads, want_grads)
