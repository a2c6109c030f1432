"""A GPT-style decoder in plain PyTorch.

One `GPT` class covers every family in the zoo (Llama, Mistral, Qwen2, Gemma, Phi, GPT-NeoX, and mixtures of
experts, whose MLP is `moe.MoE`);
`Config` switches the parts. This module knows nothing about parallelism, precision or LoRA:
`parallelize()` wraps each `Block` from outside.

Training calls `model(idx)`: causal attention over the whole sequence, no state. Generation calls
`model.set_kv_cache(...)` once, then `model(idx, input_pos)` with the positions of the tokens in
`idx`: each attention layer writes their keys and values into its cache and attends over it.

Weights follow Hugging Face layouts where it costs nothing: separate q/k/v/o projections and the
"rotate_half" RoPE convention, so Llama/Qwen/Mistral/Gemma checkpoints load without permutation.
"""

import contextlib
import math
import zlib
from typing import Literal, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrain.attention import block_causal_attention
from llmtrain.autograd import first_order_only
from llmtrain.config import Config
from llmtrain.kernel_device import kernel_device_type
from llmtrain.fused import fusable, gated_product, gating_activation, may_overwrite_gating, qkv_attention
from llmtrain.loss import head_loss_sum
from llmtrain.moe import MoE, GroupedExperts

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

    def forward(self, idx: torch.Tensor, input_pos: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, padding: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, padded_vocab_size).

        input_pos: None for training (positions 0..T-1, no cache). Otherwise the positions (T,) of the
        tokens in `idx`, for decoding with the cache allocated by `set_kv_cache`.
        padding: With input_pos, a boolean (B, S) over the cache's S positions, True where a row holds padding
            (a batch of prompts of different lengths, padded on the left): no other position attends to it.
        labels: Targets (B, T). Given, the forward returns the summed cross-entropy (fp32, IGNORE_INDEX
        targets skipped) instead of the logits, computed in chunks (see `head_loss_sum`).
        """
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
        if input_pos is None:
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, rope_n_elem)
            mask = build_sliding_window_mask(T, self.config.sliding_window, x.device)
        else:
            cache_length = self._check_kv_cache(B, T, input_pos)
            cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # (T, rope_n_elem)
            mask = build_kv_cache_mask(input_pos, cache_length, self.config.sliding_window)  # (T, S)
            if padding is not None:
                mask = mask_padding(mask, padding, input_pos)  # (B, 1, T, S)
        for block in self.blocks:
            x = block(x, cos, sin, mask, input_pos)
        if labels is not None:
            return head_loss_sum(self.lm_head, self.norm_f(x), labels)  # () fp32
        return self.lm_head(self.norm_f(x))  # (B, T, padded_vocab_size)

    # ---- KV cache for generation ------------------------------------------------------------------

    def set_kv_cache(
        self,
        batch_size: int,
        max_seq_length: Optional[int] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        """Give every attention layer a zeroed key/value cache for `batch_size` sequences of up to
        `max_seq_length` tokens (default: the model's max_seq_length), replacing any earlier cache.

        The caches are non-persistent buffers: they follow `.to()` but never enter the state dict.
        device, dtype: default to those of the token embedding.
        """
        max_seq_length = self.max_seq_length if max_seq_length is None else max_seq_length
        if not 0 < max_seq_length <= self.max_seq_length:
            raise ValueError(
                f"KV cache length {max_seq_length} must be in [1, max_seq_length {self.max_seq_length}] of model "
                f"{self.config.name!r} (block_size {self.config.block_size})"
            )
        if batch_size <= 0:
            raise ValueError(f"KV cache batch size must be positive, got {batch_size}")
        device = self.wte.weight.device if device is None else device
        dtype = self.wte.weight.dtype if dtype is None else dtype
        for block in self.blocks:
            block.attn.kv_cache = KVCache(
                batch_size, self.config.n_query_groups, max_seq_length, self.config.head_size, device, dtype
            )

    def clear_kv_cache(self) -> None:
        """Free the caches; the model is back to its training-time self."""
        for block in self.blocks:
            block.attn.kv_cache = None

    def _check_kv_cache(self, batch_size: int, seq_len: int, input_pos: torch.Tensor) -> int:
        """The cache length, after checking that a cache exists and fits the call (no device sync)."""
        cache = self.blocks[0].attn.kv_cache
        if cache is None:
            raise ValueError("forward(idx, input_pos) decodes with the KV cache: call model.set_kv_cache(...) first")
        if input_pos.shape != (seq_len,):
            raise ValueError(
                f"input_pos must have shape ({seq_len},) for {seq_len} tokens, got {tuple(input_pos.shape)}"
            )
        if batch_size > cache.batch_size:
            raise ValueError(f"Batch of {batch_size} sequences, but the KV cache holds {cache.batch_size}; "
                             "call model.set_kv_cache with a larger batch_size")
        return cache.max_seq_length

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer from torch's RNG (works after meta + to_empty); see
        :func:`init_gpt_weights`."""
        init_gpt_weights(self, self.config)
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


INIT_SCHEMES = ("gpt2", "neox")
DEFAULT_INIT = "neox"
"""The scheme :func:`init_gpt_weights` uses when not told. neox ended the debug recipe's 300-step A/B 3.9% lower in
validation loss than gpt2, on both seeds (bench/ab/init_ab.py; BENCHMARKS.md, "Initialisation")."""


def init_stds(config: Config, scheme: str) -> tuple[float, float]:
    """(std of linears and embeddings, std of the projections that write into the residual stream).

    ``gpt2``: 0.02, and 0.02 / sqrt(2 n_layer) for the residual projections (GPT-2). ``neox``: GPT-NeoX's small
    init sqrt(2 / (5 d)), and Wang's 1 / (sqrt(d) n_layer) for the residual projections (as GPT-NeoX, Pythia and
    TinyLlama's recipe; d the width).
    """
    if scheme == "gpt2":
        return 0.02, 0.02 / math.sqrt(2 * config.n_layer)
    if scheme == "neox":
        return math.sqrt(2 / (5 * config.n_embd)), 1 / (math.sqrt(config.n_embd) * config.n_layer)
    raise ValueError(f"unknown init scheme {scheme!r}: one of {', '.join(INIT_SCHEMES)}")


@torch.no_grad()
def init_gpt_weights(model: nn.Module, config: Config, scheme: Optional[str] = None) -> None:
    """Initialise the parameters of a GPT, or of a pipeline stage that holds some of its modules under the same names.

    Normal(0, std) for linears and embeddings, with a smaller std for the projections that write into the
    residual stream (:func:`init_stds` for ``scheme``, :data:`DEFAULT_INIT` when None); zero biases; norm weights
    one, or zero when the norm multiplies by (1 + weight).

    NOTE: each module draws from a generator seeded by its name and one number drawn from torch's RNG,
    not from one stream in module order: a pipeline stage that holds blocks 4-7 gets exactly the weights
    those blocks have in the whole model, with no need to draw (and throw away) blocks 0-3 first.
    """
    std, residual_std = init_stds(config, scheme or DEFAULT_INIT)
    base_seed = int(torch.randint(0, 2**31 - 1, ()))
    with torch.random.fork_rng(devices=_cuda_devices(model)):
        for name, module in model.named_modules():
            _seed_module(base_seed, name, module)
            if isinstance(module, nn.Linear):
                if name == "lm_head" and config.tie_embeddings:
                    continue  # the tied weight is the embedding, initialised below
                is_residual = name.rsplit(".", 1)[-1] in RESIDUAL_PROJECTIONS
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                module.reset_parameters()
            elif isinstance(module, GroupedExperts):
                module.init_weights(std, residual_std)
            elif isinstance(module, MoE):
                module.expert_bias.zero_()


def _cuda_devices(model: nn.Module) -> list[torch.device]:
    return sorted({torch.device(p.device) for p in model.parameters() if p.device.type == "cuda"}, key=str)


def _seed_module(base_seed: int, name: str, module: nn.Module) -> None:
    """Seed the CPU generator, and that of the GPU the module's parameters live on, from (base_seed, name)."""
    # NOTE: the CPU generator keeps only 32 bits of a seed, so base seed and name are hashed together.
    seed = zlib.crc32(f"{base_seed}:{name}".encode())
    torch.default_generator.manual_seed(seed)
    for device in {torch.device(p.device) for p in module.parameters(recurse=False) if p.device.type == "cuda"}:
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The Blocks of a GPT in order, or of a pipeline stage, which keeps some in an ``nn.ModuleDict`` keyed by
    their layer index (so that parameter names match the whole model's)."""
    blocks = model.blocks
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


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
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        input_pos: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        x_normed = self.attn_norm(x)
        attn_out = self.attn(x_normed, cos, sin, mask, input_pos)
        if self.parallel_residual:
            mlp_in = x_normed if self.mlp_norm is None else self.mlp_norm(x)
            return x + attn_out + self.mlp(mlp_in)
        x = x + attn_out
        return x + self.mlp(self.mlp_norm(x))


class CausalSelfAttention(nn.Module):
    """Multi-head, grouped-query or multi-query attention with RoPE."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.head_size = config.head_size
        qkv_bias = config.bias or config.attn_bias
        self.q_proj = nn.Linear(config.n_embd, config.n_head * config.head_size, bias=qkv_bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_query_groups * config.head_size, bias=qkv_bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_query_groups * config.head_size, bias=qkv_bias)
        self.o_proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=config.bias)
        # QK-norm before RoPE: per head (Qwen3) or over the whole projection (OLMoE); None without.
        self.qk_norm = config.qk_norm
        q_width, k_width = {"head": (config.head_size, config.head_size),
                            "full": (config.n_head * config.head_size, config.n_query_groups * config.head_size),
                            "none": (0, 0)}[config.qk_norm]
        self.q_norm = RMSNorm(q_width, config.norm_eps, config.norm_unit_offset) if q_width else None
        self.k_norm = RMSNorm(k_width, config.norm_eps, config.norm_unit_offset) if k_width else None
        # Set by GPT.set_kv_cache for generation; None while training.
        self.kv_cache: Optional[KVCache] = None

    # Whether training may take the fused q/k/v path (llmtrain.fused) where it applies. It computes the same function,
    # but q, k and v's weight gradients become ready together rather than one by one. An engine that reduces
    # gradients in the order they become ready on each rank (DeepSpeed's ZeRO-2 buckets) needs the same order on
    # every rank, and batches of different widths take the path on some ranks only: such an engine sets False.
    fuse_projections: bool = True

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        input_pos: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        # Training on the CPU with block attention: one GEMM for q, k and v, RoPE written out (llmtrain.fused).
        if (self.fuse_projections and self.q_norm is None and input_pos is None and mask is None
                and torch.is_grad_enabled()
                and cos.size(-1) == self.head_size and fusable(x, self.q_proj, self.k_proj, self.v_proj)):
            n_head, groups = self.q_proj.out_features // self.head_size, self.k_proj.out_features // self.head_size
            dtype = attention_dtype(x.device.type, x.dtype, T)
            if attention_kernel(x.device.type, dtype, T, n_head, groups) == "blocks":
                y = qkv_attention(x, self.q_proj, self.k_proj, self.v_proj, cos, sin, self.head_size,
                                  attention_block(T), dtype)  # (B, T, nh * hs)
                return self.o_proj(y)
        # NOTE: head counts come from the projections' outputs, not the config: a projection split over
        # tensor-parallel ranks returns only this rank's heads.
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, -1, self.head_size)  # (B, T, nh, hs)
        k = k.view(B, T, -1, self.head_size)  # (B, T, ng, hs)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hs), (B, ng, T, hs)
        v = self.v_proj(x).view(B, T, -1, self.head_size).transpose(1, 2)  # (B, ng, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if input_pos is not None:
            k, v = self.kv_cache(input_pos, k, v)  # (B, ng, S, hs) each
            y = grouped_attention(q, k.to(q.dtype), v.to(q.dtype), mask)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        training, out_dtype = torch.is_grad_enabled(), q.dtype
        dtype = attention_dtype(q.device.type, q.dtype, T, masked=mask is not None) if training else q.dtype
        kernel = attention_kernel(q.device.type, dtype, T, q.size(1), k.size(1), masked=mask is not None,
                                  training=training)
        # NOTE: autocast would cast float32 inputs back to its dtype.
        with torch.autocast(q.device.type, enabled=False) if dtype != q.dtype else contextlib.nullcontext():
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            if kernel == "blocks":
                y = block_causal_attention(q, k, v, attention_block(T)).to(out_dtype)  # (B, T, nh * hs)
            else:
                layout = kv_layout(q.device.type, dtype, q.size(1), k.size(1), masked=mask is not None)
                y = causal_attention(q, k, v, layout, mask).to(out_dtype)
                y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hs)
        return self.o_proj(y)


class KVCache(nn.Module):
    """Keys and values of one attention layer for the positions decoded so far, grouped as in the model."""

    def __init__(self, batch_size: int, n_query_groups: int, max_seq_length: int, head_size: int,
                 device=None, dtype=None) -> None:
        super().__init__()
        shape = (batch_size, n_query_groups, max_seq_length, head_size)  # (B, ng, S, hs)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    @property
    def batch_size(self) -> int:
        return self.k.size(0)

    @property
    def max_seq_length(self) -> int:
        return self.k.size(2)

    def forward(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, ng, T, hs) at positions input_pos (T,); return the cache of the first B rows."""
        B = k.size(0)
        cache_k, cache_v = self.k[:B], self.v[:B]  # views: the writes below land in the buffers
        cache_k.index_copy_(2, input_pos, k.to(cache_k.dtype))
        cache_v.index_copy_(2, input_pos, v.to(cache_v.dtype))
        return cache_k, cache_v  # (B, ng, S, hs)


KVLayout = Literal["plain", "grouped", "repeat"]

# Training attention of a bfloat16 model computes in float32 on a CPU without AMX tiles:
# - up to CPU_FLOAT32_ATTENTION_MAX_SEQ tokens, because there CPU flash attention's bfloat16 path, which converts
#   every block to float32, is slower than its float32 path (forward and backward 1.7x at 128 tokens, 1.00-1.08x
#   at 256, 0.98x at 384, 0.88x at 512; the "attention in float32" A/B in BENCHMARKS.md);
# - and wherever float32 attention runs as block attention (below), which beats bfloat16 flash attention up to
#   CPU_BLOCK_ATTENTION_MAX_SEQ tokens (the whole step 1.17x at 512 tokens, 1.04x at 1,024).
# Measured on an AVX512-BF16 CPU without AMX; other CPUs keep bfloat16. Where bfloat16 block attention runs (below),
# it is faster still, and a bfloat16 model keeps bfloat16 there.
CPU_FLOAT32_ATTENTION_MAX_SEQ = 256
CPU_MEASURED_FOR_FLOAT32_ATTENTION = (torch.cpu._is_avx512_bf16_supported()
                                      and not torch.cpu._is_amx_tile_supported())

# Training attention in float32 on a CPU runs as batched matmuls over blocks of query positions
# (``llmtrain.attention``) for sequences up to CPU_BLOCK_ATTENTION_MAX_SEQ tokens, where a group's stacked query
# rows (the sequence length times the query heads per key/value head) number at least CPU_BLOCK_ATTENTION_MIN_ROWS:
# there it is faster than CPU flash attention (the "block attention" A/B in BENCHMARKS.md). Measured on an AVX-512
# CPU; other CPUs keep flash attention.
CPU_BLOCK_ATTENTION_MAX_SEQ = 1024
CPU_BLOCK_ATTENTION_MIN_ROWS = 256
CPU_MEASURED_FOR_BLOCK_ATTENTION = torch.cpu._is_avx512_supported()

# A bfloat16 model's training attention runs as bfloat16 block attention (float32 scores and softmax) up to
# CPU_BF16_BLOCK_ATTENTION_MAX_SEQ tokens, whatever the number of rows, on CPUs with bfloat16 dot products:
# - with AMX tiles its GEMMs run on the tiles, while CPU flash attention's bfloat16 backward is slow there (the whole
#   step 1.30x at 128 tokens, 1.05-1.08x at 256, 1.02-1.06x at 512, 0.90x at 1,024; BENCHMARKS.md, "bfloat16 block
#   attention on AMX");
# - with AVX512-BF16 and no AMX it beats the float32 block attention of an upcast copy, the rule above, at every
#   length measured (the whole step 1.02-1.07x at 128 tokens, 1.07-1.12x at 256, 1.06x at 512, 1.11x at 1,024;
#   BENCHMARKS.md, "bfloat16 block attention without AMX").
CPU_BF16_BLOCK_ATTENTION_MAX_SEQ = 512 if torch.cpu._is_amx_tile_supported() else 1024
CPU_MEASURED_FOR_BF16_BLOCK_ATTENTION = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()

AttentionKernel = Literal["sdpa", "blocks"]


def attention_dtype(device_type: str, dtype: torch.dtype, seq_len: int, masked: bool = False) -> torch.dtype:
    """The dtype training attention (forward and backward) computes in: ``dtype``, or float32 where that is faster
    (above); ``masked``: an explicit (sliding-window) mask, which block attention does not take.
    ``CausalSelfAttention`` asks only when gradients are on: validation and generation, which were not measured,
    keep ``dtype``; the memory estimate asks for the training step it plans."""
    device_type = kernel_device_type(device_type)
    if device_type != "cpu" or dtype != torch.bfloat16 or not CPU_MEASURED_FOR_FLOAT32_ATTENTION:
        return dtype
    if not masked and CPU_MEASURED_FOR_BF16_BLOCK_ATTENTION and seq_len <= CPU_BF16_BLOCK_ATTENTION_MAX_SEQ:
        return dtype  # bfloat16 block attention
    blocks = not masked and seq_len <= CPU_BLOCK_ATTENTION_MAX_SEQ and CPU_MEASURED_FOR_BLOCK_ATTENTION
    return torch.float32 if seq_len <= CPU_FLOAT32_ATTENTION_MAX_SEQ or blocks else dtype


def attention_kernel(device_type: str, dtype: torch.dtype, seq_len: int, n_head: int, n_query_groups: int,
                     masked: bool = False, training: bool = True) -> AttentionKernel:
    """Which kernel causal attention runs on: torch's SDPA, or block-causal batched matmuls where they are faster
    (above). ``dtype`` is the dtype attention computes in (``attention_dtype``). Only training attention was
    measured: validation and generation keep SDPA, and so does an explicit (sliding-window) mask."""
    device_type = kernel_device_type(device_type)
    if not training or masked or device_type != "cpu":
        return "sdpa"
    rows = seq_len * (n_head // n_query_groups)
    if (dtype == torch.float32 and CPU_MEASURED_FOR_BLOCK_ATTENTION and seq_len <= CPU_BLOCK_ATTENTION_MAX_SEQ
            and rows >= CPU_BLOCK_ATTENTION_MIN_ROWS):
        return "blocks"
    if dtype == torch.bfloat16 and CPU_MEASURED_FOR_BF16_BLOCK_ATTENTION and seq_len <= CPU_BF16_BLOCK_ATTENTION_MAX_SEQ:
        return "blocks"
    return "sdpa"


def attention_block(seq_len: int) -> int:
    """Query positions per block of block-causal attention: 64, or 32 on sequences of 128 tokens and fewer."""
    return 32 if seq_len <= 128 else 64


def kv_layout(device_type: str, dtype: torch.dtype, n_head: int, n_query_groups: int,
              masked: bool = False) -> KVLayout:
    """How training attention hands its keys and values to SDPA, chosen so that a fused kernel can take them.

    plain: one key/value head per query head (multi-head attention): nothing to do.
    grouped: grouped heads as they are (``enable_gqa``): the flash kernels (CUDA in fp16/bf16, CPU) read them.
    repeat: each query head gets a copy of its group's keys and values (``repeat_interleave``).
    masked: an explicit mask (sliding window) instead of the causal flag.

    NOTE: on CUDA the flash kernel takes no fp32 and the memory-efficient one no grouped heads, so fp32
    grouped-query attention with ``enable_gqa`` falls back to the math kernel, which materializes the
    (B, nh, T, T) scores; copies of k and v (nh / ng times their size) cost far less. Not every kernel
    takes grouped heads together with an explicit mask either, so a masked layout repeats them too.
    """
    if n_query_groups == n_head:
        return "plain"
    if masked or (kernel_device_type(device_type) == "cuda" and dtype == torch.float32):
        return "repeat"
    return "grouped"


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: KVLayout,
                     mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hs) over k, v (B, ng, T, hs) in the given layout; mask: boolean (T, T) or None."""
    if layout == "repeat":
        repeats = q.size(1) // k.size(1)
        k = k.repeat_interleave(repeats, dim=1)  # (B, nh, T, hs)
        v = v.repeat_interleave(repeats, dim=1)  # (B, nh, T, hs)
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=layout == "grouped")
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=layout == "grouped")


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of q (B, nh, T, hs) over grouped k, v (B, ng, S, hs) with a boolean mask (T, S) or (B, 1, T, S).

    NOTE: the query heads that share a key/value group are stacked along the query axis rather
    than copying the cache once per head, which would cost nh/ng times the cache in memory traffic.
    """
    B, n_head, T, head_size = q.shape
    n_query_groups = k.size(1)
    repeats = n_head // n_query_groups
    # Head h belongs to group h // repeats, as in repeat_interleave.
    q = q.reshape(B, n_query_groups, repeats * T, head_size)  # (B, ng, rep * T, hs)
    # (T, S) or per row (B, 1, T, S): repeated along the query axis as the heads are stacked
    mask = mask.repeat(*(1,) * (mask.dim() - 2), repeats, 1)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, ng, rep * T, hs)
    return y.view(B, n_head, T, head_size)  # (B, nh, T, hs)


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

    approximate: Optional[str] = None  # the activation: None for SiLU, else GELU with this approximation

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        return gating_activation(x, self.approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if may_overwrite_gating(x, gate, up, self.gate_proj, self.up_proj):
            return self.down_proj(gated_product(gate, up, self.approximate))
        return self.down_proj(self.activation(gate) * up)


class GemmaMLP(LLaMAMLP):
    """GeGLU: the SwiGLU layout with GELU in place of SiLU (Gemma)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.approximate = config.gelu_approximate


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
        # NOTE: by name: importing DTensor costs every user of this module a second.
        if "DTensor" in (type(x).__name__, type(self.weight).__name__):
            return _rms_norm_on_local_tensors(x, self.weight, self.eps, self.unit_offset)
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.unit_offset)


def _rms_norm_on_local_tensors(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """RMSNorm of a tensor-parallel model: x a DTensor whose tokens are split over the mesh (sequence parallelism,
    ``Shard(1)``) or replicated, the weight a replicated DTensor. Each token is normalised on its own, so each rank
    runs :class:`_RMSNormFunction` on its local tokens; its weight gradient sums only those tokens, a partial sum
    where the tokens are split and the whole one where they are replicated."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if not isinstance(x, DTensor):  # a plain tensor, the same on every rank
        return _RMSNormFunction.apply(x, weight.to_local(grad_placements=[Replicate()] * weight.device_mesh.ndim),
                                      eps, unit_offset)
    if not isinstance(weight, DTensor) or weight.device_mesh != x.device_mesh:
        raise ValueError("RMSNorm of a DTensor needs its weight replicated on the same mesh (as tensor parallelism's "
                         "plan distributes it)")
    for placement in x.placements:
        if isinstance(placement, Partial) or (isinstance(placement, Shard) and placement.dim % x.ndim == x.ndim - 1):
            raise ValueError(f"RMSNorm needs whole feature vectors on each rank; got a DTensor placed {x.placements}")
    grad_placements = [Partial() if isinstance(p, Shard) else Replicate() for p in x.placements]
    out = _RMSNormFunction.apply(x.to_local(), weight.to_local(grad_placements=grad_placements), eps, unit_offset)
    # NOTE: DTensor infers the global shape from the local one, which needs the tokens split evenly (plan.check_model
    # asks that the sequence length divide by tp).
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)


def rms_norm_composite(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """RMSNorm in float32 from torch operators, differentiated by autograd: the formula ``RMSNorm`` computes, and the
    reference its written-out backward is held to (tests, ``bench/ab/step_ab.py rms_norm``)."""
    x_float = x.float()
    normed = x_float * torch.rsqrt(x_float.pow(2).mean(dim=-1, keepdim=True) + eps)
    scale = weight.float() + 1.0 if unit_offset else weight.float()
    return (normed * scale).to(x.dtype)


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm with its backward written out: :func:`rms_norm_composite`'s function, in float32, keeping only the
    input, in its own dtype, and one float32 (or wider) scale per row, where autograd keeps the input and the normalised
    tensor in float32. Each row's sum of squares and the backward's sum over a row are reductions that write
    nothing (a norm, a dot product), and the weight's gradient sums over rows as one matrix-vector product: 3 passes
    over the tensor forward and 6 backward, where autograd's chain of operators makes about 4 and 13. Against
    autograd's chain the whole llama-debug step was 1.0-1.3% faster in float32, 4-5% in bfloat16, with peak memory
    6% and 15% lower (BENCHMARKS.md, "RMSNorm's backward written out"); the reductions that write nothing came later
    ("One GEMM for q, k and v")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        x_float = x.to(wide)
        width = x.size(-1)
        rstd = torch.rsqrt(torch.linalg.vector_norm(x_float, dim=-1, keepdim=True).square_().div_(width).add_(eps))
        scale = weight.to(wide) + 1.0 if unit_offset else weight.to(wide)
        ctx.save_for_backward(x, weight, rstd)
        ctx.unit_offset = unit_offset
        return (x_float * rstd).mul_(scale).to(x.dtype)

    @staticmethod
    @first_order_only  # the backward treats rstd as a constant of x
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x_float = x.to(rstd.dtype)
        width = x.size(-1)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * rstd(x) * scale: rstd * g - x * rstd^3 * mean(g * x), g = grad * scale.
            scale = weight.to(rstd.dtype) + 1.0 if ctx.unit_offset else weight.to(rstd.dtype)
            grad_scaled = grad * scale  # float32 (or wider)
            dot = torch.linalg.vecdot(grad_scaled, x_float).unsqueeze(-1)  # (..., 1)
            grad_x = torch.mul(grad_scaled, rstd).addcmul_(x_float, rstd.pow(3).mul_(dot).div_(width), value=-1)
            grad_x = grad_x.to(x.dtype)
        if ctx.needs_input_grad[1]:
            # The sum over rows of grad * x * rstd: rstd^T (grad * x), one matrix-vector product.
            grad_x_product = (grad * x_float).reshape(-1, width)
            grad_weight = torch.mm(rstd.reshape(1, -1), grad_x_product).view(width).to(weight.dtype)
        return grad_x, grad_weight, None, None


def build_norm(config: Config) -> nn.Module:
    if config.norm_class_name == "RMSNorm":
        return RMSNorm(config.n_embd, eps=config.norm_eps, unit_offset=config.norm_unit_offset)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps)


def build_mlp(config: Config) -> nn.Module:
    if config.is_moe:
        return MoE(config)
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


def build_kv_cache_mask(input_pos: torch.Tensor, cache_length: int, sliding_window: Optional[int]) -> torch.Tensor:
    """Boolean (T, S) mask for queries at positions input_pos (T,) over a cache of S positions.

    True where key position j <= the query's position (later slots are stale or empty) and, with
    a sliding window, within sliding_window tokens of it.
    """
    query_pos = input_pos.unsqueeze(1)  # (T, 1)
    key_pos = torch.arange(cache_length, device=input_pos.device).unsqueeze(0)  # (1, S)
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= query_pos - key_pos < sliding_window
    return mask


def mask_padding(mask: torch.Tensor, padding: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """The cache mask (T, S) for each row of a batch whose positions ``padding`` (B, S) marks as padding: (B, 1, T, S).

    NOTE: a padding position still attends to itself: a query with every key masked would come out of SDPA as NaN,
    which its keys and values would carry into the cache, and 0 × NaN is NaN even where the mask hides them.
    """
    if padding.dim() != 2 or padding.size(1) != mask.size(1):
        raise ValueError(f"padding must have shape (batch, {mask.size(1)}) over the KV cache, "
                         f"got {tuple(padding.shape)}")
    own = torch.arange(mask.size(1), device=mask.device) == input_pos.unsqueeze(1)  # (T, S)
    return (mask & ~padding[:, None, None, :]) | own
