import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from llmtrain.config import Config
from llmtrain.flops import (active_parameters, describe_parameters, device_peak_flops, flops_per_token,
                            lookup_peak_flops, num_parameters)
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


def mixtral_tiny(**overrides) -> Config:
    """Mixtral's shape in small: SwiGLU experts, 4 of them, 2 per token, grouped-query attention, untied head."""
    return Config(name="mixtral-tiny", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, block_size=64, vocab_size=256,
                  padding_multiple=64, intermediate_size=160, n_expert=4, n_expert_per_token=2,
                  moe_intermediate_size=96, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", bias=False,
                  **overrides)


MOE_CONFIGS = {
    "moe-debug": lambda: Config.from_name("moe-debug"),
    "mixtral-tiny": mixtral_tiny,
    "shared-sigmoid": lambda: mixtral_tiny(n_shared_expert=1, router_score="sigmoid", norm_topk_prob=False,
                                           tie_embeddings=True),
}


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_moe_parameters_total_matches_the_model_and_active_counts_k_experts(name):
    config = MOE_CONFIGS[name]()
    with torch.device("meta"):
        model = GPT(config)
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())  # every expert, the buffer not
    # by hand: per block attention (q, k, v, o), two norms, the router, k routed and the shared experts' gated MLPs
    C, hs, k, width = config.n_embd, config.head_size, config.n_expert_per_token, config.moe_intermediate_size
    attention = C * hs * (2 * config.n_head + 2 * config.n_query_groups)
    block = attention + 2 * C + C * config.n_expert + (k + config.n_shared_expert) * 3 * C * width
    embeddings = config.padded_vocab_size * C * (1 if config.tie_embeddings else 2)
    assert active_parameters(config) == config.n_layer * block + C + embeddings
    assert active_parameters(config) < num_parameters(config)
    assert describe_parameters(config).endswith(f"({active_parameters(config) / 1e6:,.2f}M active)")


def test_moe_debug_has_llama_debugs_active_parameters_and_flops_but_the_router():
    moe, dense = Config.from_name("moe-debug"), Config.from_name("llama-debug")
    router = moe.n_layer * moe.n_embd * moe.n_expert
    assert active_parameters(moe) == num_parameters(dense) + router
    assert active_parameters(dense) == num_parameters(dense) and describe_parameters(dense) == "4.85M parameters"
    # MFU counts the active weights: 6 FLOPs per active matmul weight and token in training, the attention the same
    assert flops_per_token(moe, 256) - flops_per_token(dense, 256) == 6 * router


@pytest.mark.parametrize("name", ["mixtral-tiny", "shared-sigmoid"])
def test_moe_flops_per_token_matches_flop_counter(name):
    """FlopCounterMode counts each routed row through its own expert: the active FLOPs. Besides them it counts the
    weighted sum of each token's k outputs (a batched product, 2·k·C per token and pass), which MFU leaves out."""
    config = MOE_CONFIGS[name]()
    model = GPT(config)
    model.init_weights()
    batch_size, seq_len = 2, 32
    idx = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    expected = counted_flops(model, idx, training=True)
    weighted_sum = 3 * config.n_layer * 2 * config.n_expert_per_token * config.n_embd * batch_size * seq_len
    assert flops_per_token(config, seq_len) * batch_size * seq_len + weighted_sum == pytest.approx(expected, rel=0.01)


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
