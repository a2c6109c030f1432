import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from llmtrain.config import Config
from llmtrain.flops import device_peak_flops, flops_per_token, lookup_peak_flops, num_parameters
from llmtrain.lora import LoRAArgs, apply_lora, mark_only_lora_trainable
from llmtrain.model import GPT

SMALL = dict(n_layer=2, n_embd=64, n_head=4, block_size=64, vocab_size=256, intermediate_size=160)


def counted_flops(model: GPT, idx: torch.Tensor, training: bool) -> int:
    """FLOPs that torch's FlopCounterMode sees for one forward (and backward) pass."""
    counter = FlopCounterMode(display=False)
    # NOTE: FlopCounterMode does not count CPU's fused SDPA kernel; the math kernel decomposes
    # attention into matmuls that it does count.
    with counter, sdpa_kernel(SDPBackend.MATH):
        logits = model(idx)
        if training:
            logits.float().sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("llama-debug", dict(n_query_groups=4)),  # multi-head
        ("llama-debug", dict(n_query_groups=2)),  # grouped-query
        ("gemma-debug", dict(n_query_groups=1, head_size=32)),  # multi-query, head_size != n_embd / n_head
        ("gpt-neox-debug", {}),  # biases, GELU MLP, parallel residual
        ("phi-debug", {}),  # lm_head bias, shared norm
        ("mistral-debug", dict(n_query_groups=2, sliding_window=8)),  # explicit mask path
    ],
)
@pytest.mark.parametrize("training", [True, False])
def test_flops_per_token_matches_flop_counter(name, overrides, training):
    config = Config.from_name(name, **{**SMALL, **overrides})
    model = GPT(config)
    model.init_weights()
    batch_size, seq_len = 2, 32
    idx = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    expected = counted_flops(model, idx, training)
    assert flops_per_token(config, seq_len, training) * batch_size * seq_len == pytest.approx(expected, rel=0.01)


def test_training_flops_follow_the_6n_rule_for_short_sequences():
    config = Config.from_name("Llama-3.1-8B")
    matmul_weights = num_parameters(config, include_embeddings=False)
    # At seq_len 1 attention is negligible: training costs ~6 FLOPs per parameter per token.
    assert flops_per_token(config, 1) == pytest.approx(6 * matmul_weights, rel=1e-3)
    assert flops_per_token(config, 8192) > flops_per_token(config, 1)


@pytest.mark.parametrize("lora", [
    LoRAArgs(lora_r=4),  # query and value
    LoRAArgs(lora_r=8, lora_key=True, lora_projection=True, lora_mlp=True, lora_head=True),
])
def test_lora_flops_count_frozen_weights_at_4_and_adapters_at_6_per_token(lora):
    config = Config.from_name("llama-debug", **SMALL, n_query_groups=2)
    model = GPT(config)
    model.init_weights()
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    apply_lora(model, lora)
    mark_only_lora_trainable(model)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # The input gradient of every layer counts, also of the first block's projections, whose input (the frozen
    # embedding's output) needs none in a real run: the hook makes it need one, so the counter sees that work too.
    model.wte.register_forward_hook(lambda module, args, out: out.detach().requires_grad_())
    batch_size, seq_len = 2, 32
    idx = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    expected = counted_flops(model, idx, training=True)
    lora_flops = flops_per_token(config, seq_len, adapter_parameters=adapters)
    assert lora_flops * batch_size * seq_len == pytest.approx(expected, rel=0.01)
    full_flops = flops_per_token(config, seq_len)
    assert full_flops - lora_flops == pytest.approx(2 * matmul_weights - 6 * adapters)


@pytest.mark.parametrize("name", ["llama-debug", "gpt-neox-debug", "phi-debug", "gemma-debug", "qwen2-debug"])
def test_num_parameters_matches_the_model(name):
    config = Config.from_name(name)
    model = GPT(config)
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())
    assert num_parameters(config, include_embeddings=False) == num_parameters(config) - model.wte.weight.numel()


def test_peak_flops_lookup():
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4e12
    assert lookup_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert lookup_peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert lookup_peak_flops("NVIDIA A10", torch.bfloat16) == 125e12
    assert lookup_peak_flops("NVIDIA L4", torch.bfloat16) == 121e12
    assert lookup_peak_flops("NVIDIA L40S", torch.bfloat16) == 362.05e12
    assert lookup_peak_flops("NVIDIA GH200 480GB", torch.bfloat16) == 989.4e12
    assert lookup_peak_flops("NVIDIA H800", torch.bfloat16) == 989.4e12
    assert lookup_peak_flops("NVIDIA H800 PCIe", torch.bfloat16) == 756e12
    assert lookup_peak_flops("NVIDIA A800-SXM4-80GB", torch.bfloat16) == 312e12
    assert lookup_peak_flops("NVIDIA H20", torch.bfloat16) == 148e12
    assert lookup_peak_flops("NVIDIA H200", torch.bfloat16) == 989.4e12  # neither H20 nor GH200
    assert lookup_peak_flops("Tesla V100-SXM2-16GB", torch.bfloat16) is None  # no bf16 tensor cores
    assert lookup_peak_flops("Some Future GPU", torch.bfloat16) is None


def test_fp32_peak_depends_on_tf32():
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert lookup_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32) == 19.5e12
        torch.set_float32_matmul_precision("high")
        assert lookup_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32) == 156e12
    finally:
        torch.set_float32_matmul_precision(previous)


def test_device_peak_flops_unknown_for_cpu():
    assert device_peak_flops("cpu", torch.bfloat16) is None
    assert device_peak_flops(torch.device("cpu"), torch.float32) is None
