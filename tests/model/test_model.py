import pytest
import torch

from llmtrain.config import Config
from llmtrain.convert import state_dict_from_hf
from llmtrain.flops import num_parameters
from llmtrain import model as model_module
from llmtrain.model import (GPT, INIT_SCHEMES, CPU_FLOAT32_ATTENTION_MAX_SEQ, RMSNorm, attention_dtype,
                            build_rope_cache, build_sliding_window_mask, causal_attention, init_gpt_weights, init_stds,
                            kv_layout, rms_norm_composite)
from llmtrain.plan.memory import activation_bytes_per_token

from conftest import build_model, tiny_config
from hf_reference import hf_model

DEBUG_NAMES = ["llama-debug", "gpt-neox-debug", "phi-debug", "gemma-debug", "qwen2-debug", "mistral-debug"]


# ---- behaviour ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DEBUG_NAMES)
def test_forward_shape_and_causality(name):
    config = tiny_config(name, sliding_window=8) if name == "mistral-debug" else tiny_config(name)
    model = build_model(config)
    idx = torch.randint(0, config.vocab_size, (2, 24))
    logits = model(idx)
    assert logits.shape == (2, 24, config.padded_vocab_size)
    assert torch.isfinite(logits).all()

    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % config.vocab_size
    new_logits = model(changed)
    torch.testing.assert_close(new_logits[:, :10], logits[:, :10], rtol=0, atol=0)
    assert not torch.allclose(new_logits[:, 10:], logits[:, 10:])


def test_sliding_window_limits_the_context():
    model = build_model(tiny_config("mistral-debug", n_layer=1, sliding_window=4))
    idx = torch.randint(0, 128, (1, 16))
    changed = idx.clone()
    changed[0, 0] += 1
    # With one layer, position t sees tokens t-3..t only: position 4 no longer sees token 0.
    diff = (model(idx) - model(changed)).abs().amax(dim=-1)[0]
    assert (diff[:4] > 0).all()
    assert (diff[4:] == 0).all()


@pytest.mark.parametrize("n_query_groups", [4, 2, 1])  # MHA, GQA, MQA
def test_attention_head_shapes(n_query_groups):
    config = tiny_config("llama-debug", n_embd=64, n_head=4, n_query_groups=n_query_groups)
    model = build_model(config)
    attn = model.blocks[0].attn
    assert attn.q_proj.weight.shape == (4 * 16, 64)
    assert attn.k_proj.weight.shape == (n_query_groups * 16, 64)
    assert attn.v_proj.weight.shape == (n_query_groups * 16, 64)
    assert attn.o_proj.weight.shape == (64, 4 * 16)
    assert model(torch.randint(0, 128, (2, 8))).shape == (2, 8, 128)


@pytest.mark.parametrize("device_type, dtype, n_query_groups, masked, expected", [
    ("cuda", torch.float32, 2, False, "repeat"),  # 32-true: the memory-efficient kernel, not math's T x T scores
    ("cuda", torch.bfloat16, 2, False, "grouped"),  # bf16: the flash kernel reads grouped heads
    ("cuda", torch.float16, 1, False, "grouped"),  # multi-query is grouped too
    ("cuda", torch.float32, 4, False, "plain"),  # multi-head: nothing to expand in any precision
    ("cuda", torch.bfloat16, 4, True, "plain"),
    ("cpu", torch.float32, 2, False, "grouped"),  # CPU's flash kernel takes fp32 grouped heads
    ("cpu", torch.bfloat16, 2, False, "grouped"),
    ("cuda", torch.bfloat16, 2, True, "repeat"),  # a sliding-window mask: no kernel takes it with grouped heads
    ("cpu", torch.float32, 2, True, "repeat"),
])
def test_kv_layout_per_precision_and_head_layout(device_type, dtype, n_query_groups, masked, expected):
    assert kv_layout(device_type, dtype, n_head=4, n_query_groups=n_query_groups, masked=masked) == expected


@pytest.mark.parametrize("n_query_groups", [2, 1])
@pytest.mark.parametrize("window", [None, 3])
def test_every_kv_layout_computes_the_same_attention(n_query_groups, window):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=generator)  # (B, nh, T, hs)
    k, v = (torch.randn(2, n_query_groups, 8, 16, generator=generator) for _ in range(2))  # (B, ng, T, hs)
    mask = build_sliding_window_mask(8, window, q.device)
    # Reference: every query head over its group's keys (head h reads group h // (nh / ng)), causal, in float64.
    group = torch.arange(4) // (4 // n_query_groups)
    scores = q.double() @ k.double()[:, group].transpose(-1, -2) / 16**0.5  # (B, nh, T, T)
    allowed = mask if mask is not None else torch.ones(8, 8, dtype=torch.bool).tril()
    expected = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.double()[:, group]
    layouts = ["repeat"] if window else ["repeat", "grouped"]
    for layout in layouts:
        torch.testing.assert_close(causal_attention(q, k, v, layout, mask).double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("measured", [True, False])
@pytest.mark.parametrize("blocks_measured", [True, False])
def test_attention_dtype_per_device_dtype_and_length(monkeypatch, measured, blocks_measured):
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_FLOAT32_ATTENTION", measured)
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_BLOCK_ATTENTION", blocks_measured)
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_BF16_BLOCK_ATTENTION", False)  # the upcast rule alone
    short, long = CPU_FLOAT32_ATTENTION_MAX_SEQ, CPU_FLOAT32_ATTENTION_MAX_SEQ + 1
    longest = model_module.CPU_BLOCK_ATTENTION_MAX_SEQ
    upcast = torch.float32 if measured else torch.bfloat16
    assert attention_dtype("cpu", torch.bfloat16, short) == upcast
    assert attention_dtype("cpu", torch.bfloat16, short, masked=True) == upcast
    # Longer sequences compute in float32 only where block attention runs: no mask, up to its longest sequence.
    assert attention_dtype("cpu", torch.bfloat16, long) == (upcast if blocks_measured else torch.bfloat16)
    assert attention_dtype("cpu", torch.bfloat16, longest) == (upcast if blocks_measured else torch.bfloat16)
    assert attention_dtype("cpu", torch.bfloat16, long, masked=True) == torch.bfloat16
    assert attention_dtype("cpu", torch.bfloat16, longest + 1) == torch.bfloat16
    for dtype in (torch.float32, torch.float16):
        assert attention_dtype("cpu", dtype, short) == dtype
    assert attention_dtype("cuda", torch.bfloat16, short) == torch.bfloat16
    # Where bfloat16 block attention runs (no mask, up to its own longest sequence), bfloat16 stays.
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_BF16_BLOCK_ATTENTION", True)
    bf16_longest = model_module.CPU_BF16_BLOCK_ATTENTION_MAX_SEQ
    assert attention_dtype("cpu", torch.bfloat16, short) == torch.bfloat16
    assert attention_dtype("cpu", torch.bfloat16, bf16_longest) == torch.bfloat16
    assert attention_dtype("cpu", torch.bfloat16, short, masked=True) == upcast
    if bf16_longest < longest:
        assert attention_dtype("cpu", torch.bfloat16, bf16_longest + 1) == (upcast if blocks_measured else torch.bfloat16)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("measured", [True, False])
def test_bf16_attention_computes_in_the_dtype_the_rule_names(monkeypatch, measured, autocast):
    """The layer's output and input gradient are exactly those of SDPA in ``attention_dtype``'s dtype (float32 on
    the inputs' upcast copies, cast back), in a bfloat16 model and under bfloat16 autocast alike; without
    gradients (validation, generation) attention keeps bfloat16."""
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_FLOAT32_ATTENTION", measured)
    monkeypatch.setattr(model_module, "CPU_MEASURED_FOR_BF16_BLOCK_ATTENTION", False)  # SDPA: the rule under test
    config = tiny_config("llama-debug")
    torch.manual_seed(0)
    attn = model_module.CausalSelfAttention(config)
    if not autocast:
        attn = attn.to(torch.bfloat16)
    T = 16
    cos, sin = build_rope_cache(T, config)
    x = torch.randn(2, T, config.n_embd, dtype=torch.float32 if autocast else torch.bfloat16)

    def run(attention):
        model_module.causal_attention, original = attention, model_module.causal_attention
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                inputs = x.detach().requires_grad_()
                out = attn(inputs, cos.to(x.dtype), sin.to(x.dtype))
            out.float().sum().backward()
            return out, inputs.grad
        finally:
            model_module.causal_attention = original

    seen = []

    def recording(q, k, v, layout, mask=None):
        seen.append(q.dtype)
        return causal_attention(q, k, v, layout, mask)

    out, grad = run(recording)
    assert out.dtype == torch.bfloat16
    assert seen == [torch.float32 if measured else torch.bfloat16]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model_module.causal_attention, original = recording, model_module.causal_attention
        try:
            attn(x, cos.to(x.dtype), sin.to(x.dtype))
        finally:
            model_module.causal_attention = original
    assert seen[-1] == torch.bfloat16

    def forced(dtype):
        def attention(q, k, v, layout, mask=None):
            with torch.autocast("cpu", enabled=False):
                return causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), layout, mask).to(q.dtype)
        return attention

    want_out, want_grad = run(forced(seen[0]))
    assert torch.equal(out, want_out) and torch.equal(grad, want_grad)
    other_out, _ = run(forced(torch.bfloat16 if seen[0] == torch.float32 else torch.float32))
    assert not torch.equal(out, other_out)  # the two dtypes do give different results here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_backward_matches_autograd_of_the_formula(dtype, unit_offset):
    """RMSNorm's written-out forward and backward against autograd through the composite (both to float32 rounding)
    and against the formula in float64; the weight is random so that every term counts."""
    norm = RMSNorm(64, unit_offset=unit_offset).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 10, 64, dtype=dtype, generator=torch.Generator().manual_seed(0)).mul_(3).requires_grad_()
    grad = torch.randn(3, 10, 64, dtype=dtype, generator=torch.Generator().manual_seed(1))

    def run(fn):
        out = fn(x, norm.weight)
        return (out, *torch.autograd.grad(out, (x, norm.weight), grad))

    ours = run(lambda x, weight: norm(x))
    composite = run(lambda x, weight: rms_norm_composite(x, weight, norm.eps, unit_offset))
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    # The forward rounds once to the output's dtype: as composite's up to a float32 rounding of the row's scale.
    torch.testing.assert_close(ours[0], composite[0], rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=0)
    for got, want in zip(ours, composite):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tolerance)

    def formula(x, weight):
        scale = weight + 1 if unit_offset else weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * scale

    x64, weight64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    exact = torch.autograd.grad(formula(x64, weight64), (x64, weight64), grad.double())
    torch.testing.assert_close(ours[0].double(), formula(x64, weight64), **tolerance)
    for got, want in zip(ours[1:], exact):
        torch.testing.assert_close(got.double(), want, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_keeps_what_the_memory_estimate_counts(dtype):
    """For backward RMSNorm keeps its input, in its dtype, and one float32 scale per token (besides its weight),
    which is the norm term of ``plan.memory.activation_bytes_per_token``; the composite kept two float32 tensors."""
    config = tiny_config("llama-debug")
    norm = RMSNorm(config.n_embd).to(dtype)
    x = torch.randn(2, 8, config.n_embd, dtype=dtype, requires_grad=True)
    saved = []

    def pack(tensor):
        if tensor is not norm.weight:
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        norm(x)
    assert sum(saved) == 2 * 8 * (config.n_embd * x.element_size() + 4)
    # The estimate: two norms a layer, each 4 bytes a token more than LayerNorm's input.
    layer_norms = tiny_config("llama-debug", norm_class_name="LayerNorm")
    difference = (activation_bytes_per_token(config, dtype, checkpointing=False)["layer"]
                  - activation_bytes_per_token(layer_norms, dtype, checkpointing=False)["layer"])
    assert difference == 2 * 4


def test_head_size_independent_of_n_embd():
    model = build_model(tiny_config("gemma-debug"))  # n_embd 128, 4 heads of 64
    assert model.blocks[0].attn.q_proj.weight.shape == (256, 128)
    assert model.blocks[0].attn.o_proj.weight.shape == (128, 256)


def test_tied_embeddings_are_one_parameter():
    model = build_model(tiny_config("qwen2-debug"))
    assert model.lm_head.weight is model.wte.weight
    assert num_parameters(model.config) == sum(p.numel() for p in model.parameters())
    model(torch.randint(0, 128, (1, 4))).sum().backward()
    assert model.wte.weight.grad is not None
    assert not build_model(tiny_config("llama-debug")).config.tie_embeddings
    assert build_model(tiny_config("llama-debug")).lm_head.weight is not build_model(tiny_config("llama-debug")).wte.weight


@pytest.mark.parametrize("name", DEBUG_NAMES)
def test_meta_build_then_init_is_finite_and_deterministic(name):
    config = tiny_config(name)
    idx = torch.randint(0, config.vocab_size, (2, 16))

    def materialize(seed):
        with torch.device("meta"):
            model = GPT(config)
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        model.init_weights()
        return model.eval()

    first, second, other_seed = materialize(1), materialize(1), materialize(2)
    assert first.config.tie_embeddings == (first.lm_head.weight is first.wte.weight)
    logits = first(idx)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(second(idx), logits, rtol=0, atol=0)
    assert not torch.allclose(other_seed(idx), logits)
    # Same as building on CPU directly: no state is left over from the meta device.
    torch.testing.assert_close(build_model(config, seed=1)(idx), logits, rtol=0, atol=0)


def test_init_weights_statistics():
    """The default is GPT-NeoX's small init and Wang's init for the residual projections (BENCHMARKS.md,
    "Initialisation": 3.9% lower validation loss than GPT-2's 0.02 after 300 debug steps)."""
    config = Config.from_name("llama-debug")
    model = build_model(config)
    std, residual_std = (2 / (5 * config.n_embd)) ** 0.5, 1 / (config.n_embd ** 0.5 * config.n_layer)
    assert model.wte.weight.std().item() == pytest.approx(std, rel=0.05)
    assert model.blocks[0].attn.q_proj.weight.std().item() == pytest.approx(std, rel=0.05)
    assert model.blocks[0].attn.o_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert model.blocks[0].mlp.down_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert (model.norm_f.weight == 1).all()
    assert (build_model(tiny_config("gemma-debug")).norm_f.weight == 0).all()  # multiplies by (1 + weight)
    assert (build_model(tiny_config("gpt-neox-debug")).blocks[0].attn.q_proj.bias == 0).all()


@pytest.mark.parametrize("scheme", INIT_SCHEMES)
def test_each_init_scheme_gives_each_layer_type_its_std(scheme):
    """Embeddings and linears draw from one std, the projections into the residual stream from a smaller one; the
    numbers are the scheme's (gpt2: 0.02 and 0.02 / sqrt(2L); neox: sqrt(2 / 5d) and 1 / (sqrt(d) L))."""
    config = Config.from_name("llama-debug")
    std, residual_std = init_stds(config, scheme)
    expected = {"gpt2": (0.02, 0.02 / (2 * config.n_layer) ** 0.5),
                "neox": ((2 / (5 * config.n_embd)) ** 0.5, 1 / (config.n_embd ** 0.5 * config.n_layer))}[scheme]
    assert (std, residual_std) == pytest.approx(expected)
    model = GPT(config)
    torch.manual_seed(0)
    init_gpt_weights(model, config, scheme)
    for name, parameter in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert parameter.std().item() == pytest.approx(residual_std, rel=0.05), name
        elif name.endswith(("_proj.weight", "wte.weight", "lm_head.weight")):
            assert parameter.std().item() == pytest.approx(std, rel=0.05), name
            assert abs(parameter.mean().item()) < std / 10, name
        else:  # norms
            assert (parameter == 1).all(), name
    with pytest.raises(ValueError, match="unknown init scheme 'xavier'"):
        init_stds(config, "xavier")


def test_rope_cache_is_not_in_the_state_dict_and_can_be_reset():
    model = build_model(tiny_config("llama-debug"))
    assert not any("rope" in key for key in model.state_dict())
    expected = model.rope_cos.clone()
    model.rope_cos.zero_()
    model.reset_rope_cache()
    torch.testing.assert_close(model.rope_cos, expected)


def test_max_seq_length():
    model = build_model(tiny_config("llama-debug"))
    assert model.max_seq_length == 64
    model.max_seq_length = 16
    assert model.rope_cos.shape == (16, 64)
    with pytest.raises(ValueError, match="--train.max_seq_length"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="block_size 64"):
        model.max_seq_length = 65


def test_llama3_rope_scaling_changes_only_low_frequencies():
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
    plain = Config.from_name("Meta-Llama-3-8B")
    scaled = Config.from_name("Meta-Llama-3-8B", rope_scaling=scaling)
    position = 4096
    _, sin_plain = build_rope_cache(position + 1, plain)
    _, sin_scaled = build_rope_cache(position + 1, scaled)
    # Frequencies whose wavelength is under 8192 / 4 tokens are untouched; the longest slowed down 8x.
    torch.testing.assert_close(sin_scaled[position, :20], sin_plain[position, :20])
    lowest_plain = torch.asin(sin_plain[position, 63]).item()
    lowest_scaled = torch.asin(sin_scaled[position, 63]).item()
    assert lowest_scaled == pytest.approx(lowest_plain / 8, rel=1e-3)


# ---- parameter counts against transformers, on the meta device -----------------------------------

# Published totals (model cards / safetensors metadata).
PUBLISHED_PARAMETERS = {
    "tiny-llama-1.1b": 1.100e9,
    "Llama-2-7b-hf": 6.738e9,
    "Llama-2-70b-hf": 68.98e9,
    "Llama-3.1-8B": 8.030e9,
    "Llama-3.1-405B": 405.85e9,
    "Llama-3.2-1B": 1.236e9,
    "Llama-3.2-3B": 3.213e9,
    "Mistral-7B-v0.1": 7.242e9,
    "Mistral-7B-v0.3": 7.248e9,
    "Qwen2.5-0.5B": 0.494e9,
    "Qwen2.5-7B": 7.616e9,
    "Qwen2.5-72B": 72.71e9,
    "gemma-2b": 2.506e9,
    "gemma-7b": 8.538e9,
    "phi-2": 2.780e9,
    "pythia-70m": 70.43e6,
    "pythia-1b": 1.012e9,
    "pythia-12b": 11.85e9,
    "SmolLM2-135M": 134.5e6,
    "SmolLM2-1.7B": 1.711e9,
}
# Built as transformers models too: at least one per family, kept small enough to stay fast.
COMPARED_WITH_TRANSFORMERS = [
    "tiny-llama-1.1b", "Llama-2-7b-hf", "Llama-3.1-8B", "Llama-3.2-1B", "Mistral-7B-v0.1", "Qwen2.5-0.5B",
    "Qwen2.5-7B", "gemma-2b", "phi-2", "pythia-70m", "pythia-1b", "SmolLM2-135M",
]


@pytest.mark.parametrize("name", COMPARED_WITH_TRANSFORMERS)
def test_parameter_count_matches_transformers(name):
    config = Config.from_name(name)
    with torch.device("meta"):
        ours = sum(p.numel() for p in GPT(config).parameters())
        theirs = sum(p.numel() for p in hf_model(config).parameters())
    assert ours == theirs
    assert num_parameters(config) == ours


@pytest.mark.parametrize("name, published", PUBLISHED_PARAMETERS.items())
def test_parameter_count_matches_published_size(name, published):
    assert num_parameters(Config.from_name(name)) == pytest.approx(published, rel=0.01)


# ---- logits against transformers -----------------------------------------------------------------

LOGIT_CASES = {
    "llama": tiny_config("llama-debug"),
    "llama-3.2-rope-scaling": tiny_config("llama-debug", tie_embeddings=True, rope_base=500000.0,
                                   rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                     original_max_seq_len=32)),
    "mistral-sliding-window": tiny_config("mistral-debug", sliding_window=8),
    "qwen2": tiny_config("qwen2-debug"),
    "gemma": tiny_config("gemma-debug"),
    "phi": tiny_config("phi-debug"),
    "gpt-neox": tiny_config("gpt-neox-debug"),
}


@pytest.mark.parametrize("case", LOGIT_CASES)
def test_logits_match_transformers(case):
    config = LOGIT_CASES[case]
    torch.manual_seed(0)
    hf = hf_model(config).eval()
    with torch.no_grad():
        # Randomise everything, norms and biases included, so that no wiring mistake hides.
        for param in hf.parameters():
            param.normal_(0.0, 0.1)
    ours = GPT(config).eval()
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), config), strict=True)

    idx = torch.randint(0, config.vocab_size, (2, 24))
    with torch.no_grad():
        expected = hf(idx).logits
        actual = ours(idx)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
