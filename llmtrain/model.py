"""A GPT-style decoder in plain PyTorch.

One `GPT` class covers every family in the zoo (Llama, Mistral, Qwen2, Gemma, Phi, GPT-NeoX);
`Config` switches the parts. This module knows nothing about parallelism, precision or LoRA:
`parallelize()` wraps each `Block` from outside.

Weights follow Hugging Face layouts where it costs nothing: separate q/k/v/o projections and the
"rotate_half" RoPE convention, so Llama/Qwen/Mistral/Gemma checkpoints load without permutation.
"""

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrain.config import Config

# Output projections that write into the residual stream; their init is scaled by 1/sqrt(2 n_layer).
RESIDUAL_PROJECTIONS = ("o_proj", "down_proj", "proj")


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = build_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self._max_seq_length = config.block_size
        # Non-persistent: derived from the config, never stored in checkpoints, and rebuilt by
        # reset_rope_cache() after the model is materialised from the meta device.
        cos, sin = build_rope_cache(self._max_seq_length, config, device=self.wte.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def max_seq_length(self) -> int:
        """Longest sequence `forward` accepts; the RoPE cache has this many positions."""
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        if not 0 < value <= self.config.block_size:
            raise ValueError(
                f"max_seq_length {value} must be in [1, block_size {self.config.block_size}] of model "
                f"{self.config.name!r}; lower --train.max_seq_length"
            )
        self._max_seq_length = value
        self.reset_rope_cache()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, padded_vocab_size)."""
        B, T = idx.shape
        if T > self.max_seq_length:
            raise ValueError(
                f"Cannot forward a sequence of length {T}: model {self.config.name!r} has max_seq_length "
                f"{self.max_seq_length} (block_size {self.config.block_size}); lower --train.max_seq_length"
            )
        x = self.wte(idx)  # (B, T, C)
        if self.config.scale_embeddings:
            # NOTE: Gemma rounds the scale to the activation dtype before multiplying; so do we.
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, rope_n_elem)
        mask = build_sliding_window_mask(T, self.config.sliding_window, x.device)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.lm_head(self.norm_f(x))  # (B, T, padded_vocab_size)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer from torch's RNG (works after meta + to_empty).

        Normal(0, 0.02) for linears and embeddings, scaled by 1/sqrt(2 n_layer) for the projections
        that write into the residual stream (GPT-2); zero biases; norm weights one, or zero when the
        norm multiplies by (1 + weight).
        """
        std = 0.02
        residual_std = std / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if module is self.lm_head and self.config.tie_embeddings:
                    continue  # the tied weight is the embedding, initialised below
                is_residual = name.rsplit(".", 1)[-1] in RESIDUAL_PROJECTIONS
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                module.reset_parameters()
        self.reset_rope_cache()

    def reset_rope_cache(self) -> None:
        """Recompute the RoPE cos/sin buffers, e.g. after `to_empty()` and loading weights."""
        device = self.rope_cos.device
        self.rope_cos, self.rope_sin = build_rope_cache(self.max_seq_length, self.config, device=device)

    def _apply(self, fn, recurse=True):
        # NOTE: moving a tied model off the meta device (to_empty) creates a new Parameter per
        # module and silently unties lm_head from wte; tie them again.
        module = super()._apply(fn, recurse)
        if self.config.tie_embeddings and self.lm_head.weight is not self.wte.weight:
            self.lm_head.weight = self.wte.weight
        return module


class Block(nn.Module):
    """One transformer layer: the unit that FSDP and activation checkpointing wrap."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.attn_norm = build_norm(config)
        self.attn = CausalSelfAttention(config)
        # Phi-2 feeds the same normalised input to attention and MLP, so it has no second norm.
        self.mlp_norm = None if config.shared_attention_norm else build_norm(config)
        self.mlp = build_mlp(config)
        self.parallel_residual = config.parallel_residual

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        x_normed = self.attn_norm(x)
        attn_out = self.attn(x_normed, cos, sin, mask)
        if self.parallel_residual:
            mlp_in = x_normed if self.mlp_norm is None else self.mlp_norm(x)
            return x + attn_out + self.mlp(mlp_in)
        x = x + attn_out
        return x + self.mlp(self.mlp_norm(x))


class CausalSelfAttention(nn.Module):
    """Multi-head, grouped-query or multi-query attention with RoPE."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_query_groups = config.n_query_groups
        self.head_size = config.head_size
        qkv_bias = config.bias or config.attn_bias
        self.q_proj = nn.Linear(config.n_embd, config.n_head * config.head_size, bias=qkv_bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_query_groups * config.head_size, bias=qkv_bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_query_groups * config.head_size, bias=qkv_bias)
        self.o_proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=config.bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_query_groups, self.head_size).transpose(1, 2)  # (B, ng, T, hs)
        v = self.v_proj(x).view(B, T, self.n_query_groups, self.head_size).transpose(1, 2)  # (B, ng, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_query_groups != self.n_head)
        else:
            # NOTE: not every SDPA kernel supports enable_gqa together with an explicit mask, so
            # give each query head its own copy of its group's keys and values.
            repeats = self.n_head // self.n_query_groups
            k = k.repeat_interleave(repeats, dim=1)  # (B, nh, T, hs)
            v = v.repeat_interleave(repeats, dim=1)  # (B, nh, T, hs)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_size)  # (B, T, nh * hs)
        return self.o_proj(y)


class GptNeoxMLP(nn.Module):
    """fc -> GELU -> proj (GPT-NeoX, Phi)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.gelu_approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.gelu_approximate))


class LLaMAMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (Llama, Mistral, Qwen2)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class GemmaMLP(LLaMAMLP):
    """GeGLU: the SwiGLU layout with GELU in place of SiLU (Gemma)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gelu_approximate = config.gelu_approximate

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.gelu_approximate)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32. With unit_offset it scales by (1 + weight) (Gemma)."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.unit_offset = unit_offset
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.unit_offset:
            nn.init.zeros_(self.weight)
        else:
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        weight = self.weight.float() + 1.0 if self.unit_offset else self.weight.float()
        return (normed * weight).to(x.dtype)


def build_norm(config: Config) -> nn.Module:
    if config.norm_class_name == "RMSNorm":
        return RMSNorm(config.n_embd, eps=config.norm_eps, unit_offset=config.norm_unit_offset)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps)


def build_mlp(config: Config) -> nn.Module:
    mlp_classes = {"GptNeoxMLP": GptNeoxMLP, "LLaMAMLP": LLaMAMLP, "GemmaMLP": GemmaMLP}
    return mlp_classes[config.mlp_class_name](config)


# ---- rotary position embedding ------------------------------------------------------------------


def build_rope_cache(seq_len: int, config: Config, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, rope_n_elem), in float32.

    Uses the Hugging Face "rotate_half" layout: frequency i drives dims i and i + rope_n_elem/2.
    """
    n_elem = config.rope_n_elem
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, n_elem, 2, device=device, dtype=torch.float32) / n_elem))
    if config.rope_scaling is not None:
        inv_freq = apply_llama3_rope_scaling(inv_freq, **config.rope_scaling)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (T, n_elem / 2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, n_elem)
    return angles.cos(), angles.sin()


def apply_llama3_rope_scaling(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_seq_len: int,
) -> torch.Tensor:
    """Llama 3.1 long-context RoPE: slow down low frequencies by `factor`, keep high ones.

    Wavelengths longer than original_max_seq_len / low_freq_factor are divided by `factor`, those
    shorter than original_max_seq_len / high_freq_factor are kept, and the band between blends the two.
    """
    wavelen = 2 * math.pi / inv_freq
    # 0 for long wavelengths (fully scaled), 1 for short ones (unscaled), linear in between.
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smooth = smooth.clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rope_n_elem dims of every head of x (B, nh, T, hs); the rest pass through."""
    n_elem = cos.size(-1)
    x_rope, x_pass = x[..., :n_elem], x[..., n_elem:]
    x1, x2 = x_rope.chunk(2, dim=-1)  # (B, nh, T, n_elem / 2) each
    rotated = torch.cat((-x2, x1), dim=-1)  # (B, nh, T, n_elem)
    x_rope = x_rope * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    if n_elem == x.size(-1):
        return x_rope
    return torch.cat((x_rope, x_pass), dim=-1)  # (B, nh, T, hs)


def build_sliding_window_mask(seq_len: int, sliding_window: Optional[int], device) -> Optional[torch.Tensor]:
    """Boolean (T, T) mask, True where query i may attend key j: j <= i and i - j < sliding_window.

    None when the window covers the whole sequence, so attention can use the plain causal kernel.
    """
    if sliding_window is None or sliding_window >= seq_len:
        return None
    ones = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device)
    return ones.tril() & ~ones.tril(-sliding_window)
