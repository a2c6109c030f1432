"""Analytic parameter and FLOP counts, the tokens a batch counts, and known accelerator peaks, for throughput and MFU.

Counts come from the `Config` alone, so they are exact for any size without building a model.
"""

import re
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from llmtrain.config import Config

if TYPE_CHECKING:
    import torch


def num_parameters(config: Config, include_embeddings: bool = True) -> int:
    """Number of parameters of `GPT(config)`, counting a tied embedding once: for a mixture of experts, every
    expert's (:func:`active_parameters` counts those one token uses).

    include_embeddings=False leaves out the token-embedding table (`wte`); for a model with tied
    embeddings that table is also the output layer.
    """
    return _count(config, include_embeddings, routed_experts=config.n_expert)


def active_parameters(config: Config, include_embeddings: bool = True) -> int:
    """The parameters one token passes through: :func:`num_parameters` with a mixture of experts' routed experts
    counted k times (``n_expert_per_token``) rather than ``n_expert`` times; the router, the shared experts, the
    attention, the norms and the embeddings as the dense count has them. For a dense model, all of them."""
    return _count(config, include_embeddings, routed_experts=config.n_expert_per_token)


def describe_parameters(config: Config) -> str:
    """"4.81M parameters", or for a mixture of experts "10.1M parameters (4.81M active)"."""
    total = f"{num_parameters(config) / 1e6:,.2f}M parameters"
    return f"{total} ({active_parameters(config) / 1e6:,.2f}M active)" if config.is_moe else total


def _count(config: Config, include_embeddings: bool, routed_experts: int) -> int:
    norms_per_layer = 1 if config.shared_attention_norm else 2
    per_layer = (_attention_parameters(config) + _mlp_parameters(config, routed_experts)
                 + norms_per_layer * _norm_parameters(config))
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

    Forward: 2 FLOPs per weight of every matmul that the token passes through (attention and MLP projections and
    the output layer over the padded vocabulary; the embedding lookup is free; of a mixture of experts, the router,
    the token's k routed experts and the shared experts: its active weights, so that MFU counts what a token
    computes, not the experts it skips), plus the two attention
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
    """Weights that take part in a matmul for every token: all linear weights, biases excluded; of a mixture of
    experts, the router's, k routed experts' and the shared experts'."""
    C, hs = config.n_embd, config.head_size
    attention = C * hs * (2 * config.n_head + 2 * config.n_query_groups)  # q, o + k, v
    if config.is_moe:
        mlp = moe_mlp_parameters(config, config.n_expert_per_token)
    else:
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


def _mlp_parameters(config: Config, routed_experts: int) -> int:
    if config.is_moe:
        return moe_mlp_parameters(config, routed_experts)
    C, hidden = config.n_embd, config.intermediate_size
    weights = _mlp_matrices(config) * C * hidden
    if not config.bias:
        return weights
    return weights + (_mlp_matrices(config) - 1) * hidden + C


def expert_parameters(config: Config) -> int:
    """One routed expert's weights: a gated MLP of width ``moe_intermediate_size`` without biases (0 for a dense
    model)."""
    return 3 * config.n_embd * config.moe_intermediate_size if config.is_moe else 0


def moe_mlp_parameters(config: Config, routed_experts: int) -> int:
    """A mixture-of-experts MLP's weights with ``routed_experts`` of its routed experts: the router (D x E, no
    bias), those experts, and the shared experts (one gated MLP ``n_shared_expert`` experts wide)."""
    router = config.n_embd * config.n_expert
    return router + (routed_experts + config.n_shared_expert) * expert_parameters(config)


def _norm_parameters(config: Config) -> int:
    return 2 * config.n_embd if config.norm_class_name == "LayerNorm" else config.n_embd


def real_tokens(batch: dict[str, "torch.Tensor"]) -> int:
    """The input tokens of ``batch`` that are not padding (all of them in a batch without ``real_tokens``): the
    tokens that throughput and MFU count."""
    count = batch.get("real_tokens")
    return int(count) if count is not None else batch["input_ids"].numel()


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


def _match(device_name: str, table: dict) -> tuple[Optional[str], Any]:
    """(pattern, value) of the first entry of ``table`` whose pattern is a whole word of ``device_name``."""
    for pattern, value in table.items():
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(pattern)}(?![A-Za-z0-9])", device_name, flags=re.IGNORECASE):
            return pattern, value
    return None, None


def _peaks_of(device_name: str) -> Optional[dict[str, float]]:
    """The PEAK_FLOPS entry of a GPU name; a whole-word match, so that "A10" matches neither "A100" nor "A10G"."""
    return _match(device_name, PEAK_FLOPS)[1]


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


# ---- accelerator memory and links ------------------------------------------------------------------

# Device memory in GiB from vendor datasheets (the "80GB" of an H100 is 80 GiB of HBM). A device name that
# states its size ("NVIDIA A100-SXM4-40GB") overrides the table. Order matters as in PEAK_FLOPS.
MEMORY_GIB: dict[str, float] = {
    "B200": 180, "GH200": 96, "H200 NVL": 141, "H200": 141, "H100 NVL": 94, "H100 PCIe": 80, "H100": 80,
    "H800 PCIe": 80, "H800": 80, "H20": 96, "A100": 80, "A800": 80, "L40S": 48, "L4": 24, "A10": 24,
    "RTX 4090": 24, "RTX 3090": 24, "V100": 32, "MI300X": 192, "MI250X": 128,
}

# GPU-to-GPU bandwidth within a node, bytes/s in one direction per GPU (half the datasheet's bidirectional
# NVLink figure: 900 GB/s for the H100 SXM). None: no NVLink in the standard part (PCIe cards).
LINK_BYTES_PER_S: dict[str, Optional[float]] = {
    "B200": 900e9, "GH200": 450e9, "H200 NVL": 450e9, "H200": 450e9, "H100 NVL": 300e9, "H100 PCIe": None,
    "H100": 450e9, "H800 PCIe": None, "H800": 200e9, "H20": 450e9,
    # NOTE: the names torch gives the PCIe A100s: "NVIDIA A100-PCIE-40GB" and "NVIDIA A100 80GB PCIe".
    "A100-PCIE": None, "A100 80GB PCIe": None, "A100": 300e9,
    "A800": 200e9, "V100": 150e9, "MI300X": 448e9,
}
ASSUMED_LINK_BYTES_PER_S = 32e9
"""PCIe 4.0 x16 in one direction: the link assumed for a GPU without a LINK_BYTES_PER_S entry."""


# Names that state a superchip's memory, the CPU's included: "NVIDIA GH200 480GB" is 480 GB of LPDDR5X next to the
# GPU's 96 GiB of HBM. For these the table's size counts, not the name's.
SUPERCHIPS = ("GH200",)


def gpu_memory_bytes(device_name: str) -> Optional[int]:
    """Memory of the GPU called ``device_name``: the size its name states, else MEMORY_GIB's; None if unknown."""
    pattern, gib = _match(device_name, MEMORY_GIB)
    stated = re.search(r"(\d+)\s*GB\b", device_name, flags=re.IGNORECASE)
    if stated and pattern not in SUPERCHIPS:
        return int(stated.group(1)) * 2**30
    return None if gib is None else int(gib * 2**30)


def link_bytes_per_s(device_name: Optional[str]) -> tuple[float, bool]:
    """(bytes/s one GPU sends to another of its node, whether that is the datasheet's NVLink figure rather
    than ASSUMED_LINK_BYTES_PER_S)."""
    _, value = _match(device_name or "", LINK_BYTES_PER_S)
    return (value, True) if value else (ASSUMED_LINK_BYTES_PER_S, False)


# ---- the machine's own rate -----------------------------------------------------------------------------------------

MATMUL_SIZES = (2048, 3072, 4096)


def measure_matmul_peak(dtype: "torch.dtype", sizes: Sequence[int] = MATMUL_SIZES, repeats: int = 3,
                        device: str = "cpu") -> tuple[float, int]:
    """Best FLOP/s over square ``n × n`` matmuls in ``dtype`` (2·n³ FLOPs each), and the size that gave it.

    Each size gets one untimed product first (allocation, kernel selection), then ``repeats`` timed ones.
    """
    import time

    import torch

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    best, best_size = 0.0, sizes[0]
    for size in sizes:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        out = torch.empty(size, size, device=device, dtype=dtype)
        for index in range(repeats + 1):
            synchronize()
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            synchronize()
            rate = 2 * size**3 / (time.perf_counter() - start)
            if index and rate > best:
                best, best_size = rate, size
    return best, best_size
