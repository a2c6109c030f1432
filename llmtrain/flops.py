"""Analytic parameter and FLOP counts, and known accelerator peaks, for throughput and MFU.

Counts come from the `Config` alone, so they are exact for any size without building a model.
"""

import re
from typing import TYPE_CHECKING, Optional, Union

from llmtrain.config import Config

if TYPE_CHECKING:
    import torch


def num_parameters(config: Config, include_embeddings: bool = True) -> int:
    """Number of parameters of `GPT(config)`, counting a tied embedding once.

    include_embeddings=False leaves out the token-embedding table (`wte`); for a model with tied
    embeddings that table is also the output layer.
    """
    norms_per_layer = 1 if config.shared_attention_norm else 2
    per_layer = _attention_parameters(config) + _mlp_parameters(config) + norms_per_layer * _norm_parameters(config)
    total = config.n_layer * per_layer + _norm_parameters(config)  # + final norm
    embedding = config.padded_vocab_size * config.n_embd
    if include_embeddings:
        total += embedding
    if not config.tie_embeddings:
        total += embedding  # lm_head
    if config.lm_head_bias:
        total += config.padded_vocab_size
    return total


def flops_per_token(config: Config, seq_len: int, training: bool = True,
                    adapter_parameters: Optional[int] = None) -> float:
    """Model FLOPs per token for sequences of `seq_len` tokens.

    Forward: 2 FLOPs per weight of every matmul (attention and MLP projections and the output
    layer over the padded vocabulary; the embedding lookup is free), plus the two attention
    matmuls QK^T and AV at 2 * seq_len * head_size FLOPs per head each. Like
    `torch.utils.flop_counter.FlopCounterMode`, attention is counted over the full T x T square,
    ignoring that causal kernels skip half of it.

    Training multiplies everything by 3 (the backward pass costs two forwards). NOTE: for the
    flash and memory-efficient SDPA kernels FlopCounterMode counts one more QK^T in the backward
    (the kernels recompute the scores); we leave that out, as the PaLM definition of MFU counts
    the work the model needs, not the work an implementation chooses to redo.

    adapter_parameters: LoRA's adapter weights (the trainable ones), with every other weight frozen. A
    frozen weight costs the forward and its input's gradient, 4 FLOPs per token, not the 6 of a weight
    that trains; each adapter weight costs 2 in the forward and 6 in training. NOTE: like the backward of
    any layer, the input gradient is counted for the first block too, whose q/k/v inputs (the frozen
    embedding's output) need none: a slight overcount, worth one layer's attention projections.
    """
    matmul_weights = _matmul_weights(config)
    attention = config.n_layer * 2 * (2 * seq_len * config.head_size * config.n_head)  # QK^T and AV
    if adapter_parameters is None:
        return float(3 * (2 * matmul_weights + attention) if training else 2 * matmul_weights + attention)
    if not training:
        return float(2 * (matmul_weights + adapter_parameters) + attention)
    return float(4 * matmul_weights + 6 * adapter_parameters + 3 * attention)


def _matmul_weights(config: Config) -> int:
    """Weights that take part in a matmul for every token: all linear weights, biases excluded."""
    C, hs = config.n_embd, config.head_size
    attention = C * hs * (2 * config.n_head + 2 * config.n_query_groups)  # q, o + k, v
    mlp = _mlp_matrices(config) * C * config.intermediate_size
    return config.n_layer * (attention + mlp) + config.padded_vocab_size * C  # + lm_head


def _mlp_matrices(config: Config) -> int:
    return 2 if config.mlp_class_name == "GptNeoxMLP" else 3  # fc, proj | gate, up, down


def _attention_parameters(config: Config) -> int:
    C, hs = config.n_embd, config.head_size
    q_size, kv_size = config.n_head * hs, config.n_query_groups * hs
    weights = C * (q_size + 2 * kv_size) + q_size * C
    qkv_bias = q_size + 2 * kv_size if (config.bias or config.attn_bias) else 0
    o_bias = C if config.bias else 0
    return weights + qkv_bias + o_bias


def _mlp_parameters(config: Config) -> int:
    C, hidden = config.n_embd, config.intermediate_size
    weights = _mlp_matrices(config) * C * hidden
    if not config.bias:
        return weights
    return weights + (_mlp_matrices(config) - 1) * hidden + C


def _norm_parameters(config: Config) -> int:
    return 2 * config.n_embd if config.norm_class_name == "LayerNorm" else config.n_embd


# ---- accelerator peaks ---------------------------------------------------------------------------

# Dense (no structured sparsity) peak FLOP/s from vendor datasheets. "tf32" is what float32
# matmuls reach when torch allows TF32 (torch.set_float32_matmul_precision("high")).
# Order matters: the first pattern that matches the device name wins, so specific names come first.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "B200": {"bf16": 2.25e15, "fp16": 2.25e15, "tf32": 1.1e15},
    "GH200": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},  # the H100 of Grace Hopper
    "H200 NVL": {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12},
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "H100": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},  # SXM / HBM3
    # H800 and A800: the H100 and A100 with slower NVLink for export; the same compute.
    "H800 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "H800": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H20": {"bf16": 148e12, "fp16": 148e12, "tf32": 74e12, "fp32": 44e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "A800": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183.2e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "RTX 3090": {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "MI300X": {"bf16": 1307.4e12, "fp16": 1307.4e12, "tf32": 653.7e12, "fp32": 163.4e12},
    "MI250X": {"bf16": 383e12, "fp16": 383e12, "fp32": 95.7e12},
}


def lookup_peak_flops(device_name: str, dtype: "torch.dtype") -> Optional[float]:
    """Peak FLOP/s of the accelerator called `device_name` (e.g. "NVIDIA H100 80GB HBM3") in `dtype`."""
    import torch

    if dtype == torch.float32:
        key = "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    else:
        key = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    peaks = _peaks_of(device_name)
    return None if peaks is None else peaks.get(key)


def _peaks_of(device_name: str) -> Optional[dict[str, float]]:
    """The PEAK_FLOPS entry of a GPU name; a whole-word match, so that "A10" matches neither "A100" nor "A10G"."""
    for pattern, peaks in PEAK_FLOPS.items():
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(pattern)}(?![A-Za-z0-9])", device_name, flags=re.IGNORECASE):
            return peaks
    return None


def gpu_has_bf16(device_name: str) -> Optional[bool]:
    """Whether the GPU called ``device_name`` computes in bf16 (V100: no); None for a GPU not in the table."""
    peaks = _peaks_of(device_name)
    return None if peaks is None else "bf16" in peaks


def device_peak_flops(device: Union[str, "torch.device"], dtype: "torch.dtype") -> Optional[float]:
    """Peak FLOP/s of `device` for matmuls in `dtype`, or None when unknown (CPU, MPS, new GPUs)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return lookup_peak_flops(torch.cuda.get_device_name(device), dtype)
