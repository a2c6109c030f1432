"""Causal attention as batched matmuls over blocks of query positions: the CPU's training attention at short
sequence lengths, where it is faster than CPU flash attention (``llmtrain.model.attention_kernel`` says where).

The queries are cut into blocks of ``block`` positions. Block i attends to the keys up to its own last position,
so no score right of the diagonal block is computed: (n + 1) / 2n of the T x T square for n blocks (5/8 at 4).
Within a block the scores, the softmax and the weighted sum are two batched GEMMs and one softmax. Query heads
that share a key/value group are stacked along the rows of one GEMM, so grouped keys and values are not copied
per head.

Inputs are float32 or bfloat16. The scores and their softmax compute in float32 either way; the weighted sum and
the backward's GEMMs run in the inputs' dtype (AMX tiles for bfloat16), and the gradients are summed in float32.
So a bfloat16 model's attention is as precise as bfloat16 flash attention (tests/model/test_attention.py holds it to
that, against float64).

Unlike flash attention, it keeps the probabilities for backward (as torch's math attention does), in the inputs'
dtype: for a query in block i, (i + 1) * block of them per head. ``saved_scores_per_query`` gives the mean, which
the memory estimate counts.
"""

from __future__ import annotations

import functools
import math

import torch

from llmtrain.autograd import first_order_only


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hs) over k, v (B, ng, T, hs); returns (B, T, nh * hs), the heads
    concatenated as the output projection takes them. Head h belongs to group h // (nh / ng)."""
    return _BlockCausalAttention.apply(q, k, v, block)


def saved_scores_per_query(seq_len: int, block: int) -> float:
    """Probabilities kept per query and head, on average over the sequence's positions."""
    starts = range(0, seq_len, block)
    return sum((min(seq_len, start + block) - start) * min(seq_len, start + block) for start in starts) / seq_len


class _BlockCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
        B, n_head, T, hs = q.shape
        groups = k.size(1)
        rep = n_head // groups
        # Rows of a group: position-major, so a block of positions is one contiguous run of rows. Row t * rep + r
        # is head g * rep + r at position t.
        q_rows = q.view(B, groups, rep, T, hs).transpose(2, 3).reshape(B * groups, T * rep, hs)
        keys = k.reshape(B * groups, T, hs)
        values = v.reshape(B * groups, T, hs)
        y, probs = attend_blocks(q_rows, keys, values, B, block)
        ctx.save_for_backward(q_rows, keys, values, *probs)
        ctx.block, ctx.q_shape = block, q.shape
        return y.view(B, T, n_head * hs)

    @staticmethod
    @first_order_only
    def backward(ctx, dy: torch.Tensor):
        q_rows, keys, values, *probs = ctx.saved_tensors
        B, n_head, T, hs = ctx.q_shape
        groups = keys.size(0) // B
        rep = n_head // groups
        scale = 1.0 / math.sqrt(hs)
        # Gradients are summed and scaled in float32, then cast once (no-ops for float32 inputs).
        dq = dy.new_empty(B, n_head, T, hs, dtype=torch.promote_types(dy.dtype, torch.float32))
        dk, dv = attend_blocks_backward(dy, q_rows, keys, values, probs, ctx.block, dq.view(B, groups, rep, T, hs))
        dq = dq.mul_(scale).to(dy.dtype)  # the scores were scaled q k^T
        dk = dk.mul_(scale).to(dy.dtype)
        return dq.view(B, n_head, T, hs), dk.view(B, groups, T, hs), dv.to(dy.dtype).view(B, groups, T, hs), None


def attend_blocks(q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: int,
                  block: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Block attention's forward on its own layouts: q_rows (B * ng, T * rep, hs), the ``rep`` query heads of a
    group stacked position-major (row t * rep + r is head g * rep + r at position t), keys and values
    (B * ng, T, hs); ``batch`` is B. Returns the output (B, T, ng, rep, hs) in the inputs' dtype, the layout the
    output projection takes, and the probabilities of each block of positions for :func:`attend_blocks_backward`."""
    T, hs = keys.shape[1:]
    groups = keys.size(0) // batch
    rep = q_rows.size(1) // T
    scale = 1.0 / math.sqrt(hs)
    with torch.autocast(q_rows.device.type, enabled=False):
        # The scores are float32 whatever the inputs' dtype: a bfloat16 GEMM would round them to bfloat16, and
        # the softmax turns a score's rounding error into a relative error of its probability (twice flash
        # attention's error in the output and gradients). The copies are no-ops for float32 (and float64) inputs.
        wide = torch.promote_types(q_rows.dtype, torch.float32)
        q_scores, k_scores = q_rows.to(wide), keys.to(wide)
        # the same table for every layer and step (read-only: the GEMMs' input); traced afresh under torch.compile
        mask = (_causal_bias if torch.compiler.is_compiling() else _cached_causal_bias)(block, rep, T, wide,
                                                                                         q_rows.device)
        y = q_rows.new_empty(batch, T, groups, rep, hs)
        probs = []
        for start in range(0, T, block):
            end = min(T, start + block)
            rows = slice(start * rep, end * rep)
            # NOTE: the mask is added by the GEMM rather than filled in afterwards: selective activation
            # checkpointing may keep the GEMM's output, which must not change after it was written.
            bias = mask[:(end - start) * rep, T - start:T - start + end]  # (rows, end)
            scores = torch.baddbmm(bias, q_scores[:, rows], k_scores[:, :end].transpose(1, 2), alpha=scale)
            p = torch.softmax(scores, dim=-1).to(q_rows.dtype)  # (B * ng, rows, end)
            out = torch.bmm(p, values[:, :end])  # (B * ng, rows, hs)
            y[:, start:end] = out.view(batch, groups, end - start, rep, hs).transpose(1, 2)
            probs.append(p)
    return y, probs


def attend_blocks_backward(dy: torch.Tensor, q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           probs: list[torch.Tensor], block: int,
                           dq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of :func:`attend_blocks`: dy is the output's gradient (B, T, ng * rep * hs). Writes the
    queries' gradient into ``dq``, any (B, ng, rep, T, hs) view, and returns those of the keys and the values
    (B * ng, T, hs), all in float32 (or wider) and without the scores' scale 1/sqrt(hs), which the caller applies."""
    BG, T, hs = keys.shape
    B, groups, rep = dq.shape[:3]
    with torch.autocast(dy.device.type, enabled=False):
        dy_rows = dy.reshape(B, T, groups, rep, hs).transpose(1, 2).reshape(BG, T * rep, hs)
        wide = torch.promote_types(dy.dtype, torch.float32)
        dk = torch.zeros_like(keys, dtype=wide)
        dv = torch.zeros_like(values, dtype=wide)
        for p, start in zip(probs, range(0, T, block)):
            end = min(T, start + block)
            rows = slice(start * rep, end * rep)
            grad_out = dy_rows[:, rows]
            dv[:, :end] += torch.bmm(p.transpose(1, 2), grad_out)
            grad_probs = torch.bmm(grad_out, values[:, :end].transpose(1, 2))
            # The softmax's backward, p * (g - sum_j p_j g_j) per row, in one kernel that computes in float32.
            # NOTE: a private operator, but the one torch's own softmax differentiates with.
            grad_scores = torch._softmax_backward_data(grad_probs, p, -1, p.dtype)
            dq_block = torch.bmm(grad_scores, keys[:, :end]).view(B, groups, end - start, rep, hs)
            dq[:, :, :, start:end] = dq_block.transpose(2, 3)
            dk[:, :end] += torch.bmm(grad_scores.transpose(1, 2), q_rows[:, rows])
    return dk, dv


def _causal_bias(block: int, rep: int, seq_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(block * rep, 2 * seq_len): 0, or -inf from column seq_len + t + 1 on in the rows of position t (row
    t * rep + r). Columns seq_len - start to seq_len - start + end are the additive causal mask of the block of
    positions [start, end) over keys [0, end)."""
    column = torch.arange(2 * seq_len, device=device)
    position = torch.arange(block, device=device).repeat_interleave(rep).unsqueeze(1)  # (block * rep, 1)
    bias = torch.zeros(block * rep, 2 * seq_len, dtype=dtype, device=device)
    return bias.masked_fill_(column > seq_len + position, float("-inf"))


_cached_causal_bias = functools.lru_cache(maxsize=8)(_causal_bias)
