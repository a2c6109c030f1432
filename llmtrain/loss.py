"""The training loss: summed cross-entropy of the output head, a chunk of tokens at a time.

``GPT.forward(idx, labels=...)`` ends in :func:`head_loss_sum`, which never holds the logits of the
whole batch: the tokens go through the head in chunks of :func:`head_chunk_tokens` tokens. The memory
estimate (:mod:`llmtrain.plan.memory`) asks the same function, so the plan and the loss agree on the chunk.
"""

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from llmtrain.autograd import first_order_only
from llmtrain.fused import runs_hooks
from llmtrain.kernel_device import kernel_device_type

IGNORE_INDEX = -100
HEAD_CHUNK_BYTES = 2**30  # fp32 logits of one loss chunk: the logits of more tokens never exist at once


def head_chunk_tokens(vocab_size: int) -> int:
    """Tokens per loss chunk for a head with ``vocab_size`` outputs (the padded vocabulary of a model).

    About HEAD_CHUNK_BYTES of fp32 logits, and at least 256 tokens.
    """
    return max(256, HEAD_CHUNK_BYTES // (4 * vocab_size))


def head_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                  chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """Summed cross-entropy of ``head(hidden)`` against ``labels`` without the whole batch's logits.

    Full logits cost (compute + 12) bytes per token and vocabulary entry once upcast, log-softmaxed and
    differentiated: 8 GB for 16k tokens of a 128k vocabulary. Here the tokens go through the head in
    chunks of :func:`head_chunk_tokens`, so only one chunk's logits exist at a time.

    A plain ``nn.Linear`` head (also under FSDP) takes the fused path (``LinearCrossEntropy``): the forward
    also computes the gradients of hidden, weight and bias, chunk by chunk, and the backward only scales
    them. That is the same three matmuls as autograd's, no recomputation, and about half the elementwise
    passes over the logits of log_softmax + nll_loss and their backward. Any other head (LoRA, quantized), and
    a plain one with a hook that must see it run (``llmtrain.fused.runs_hooks``), takes the generic path: each
    chunk through the head under activation checkpointing, recomputed in backward. A head
    split over the vocabulary by tensor parallelism takes :func:`vocab_parallel_loss_sum`.
    """
    if _is_vocab_sharded(head):
        return vocab_parallel_loss_sum(head, hidden, labels, chunk_tokens)
    hidden, labels = hidden.flatten(0, 1), labels.flatten()  # (B * T, C), (B * T,)
    vocab = head.out_features if hasattr(head, "out_features") else head.weight.size(0)
    chunk_tokens = chunk_tokens or head_chunk_tokens(vocab)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    if is_plain_linear(head) and needs_grad and not runs_hooks(head):
        return LinearCrossEntropy.apply(hidden, head.weight, head.bias, labels, chunk_tokens)
    from torch.utils.checkpoint import checkpoint

    recompute = needs_grad and hidden.size(0) > chunk_tokens  # one chunk, or no backward: nothing to save
    total = hidden.new_zeros((), dtype=torch.float32)
    for hidden_chunk, label_chunk in zip(hidden.split(chunk_tokens), labels.split(chunk_tokens)):
        if recompute:
            total = total + checkpoint(_chunk_loss_sum, head, hidden_chunk, label_chunk, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(head, hidden_chunk, label_chunk)
    return total


def is_plain_linear(head: nn.Module) -> bool:
    """``nn.Linear`` itself, also as FSDP2 renames it (``FSDPLinear``, its class mixed into nn.Linear), but not a
    subclass that computes otherwise (a quantized linear)."""
    cls = type(head)
    return cls is nn.Linear or (cls.__name__ == "FSDPLinear" and cls.__bases__[-1] is nn.Linear)


def _is_vocab_sharded(head: nn.Module) -> bool:
    weight = getattr(head, "weight", None)
    # NOTE: by name: importing DTensor costs this module's every user (generate, chat) a second.
    return type(weight).__name__ == "DTensor" and is_plain_linear(head)


def vocab_parallel_loss_sum(head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor,
                            chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """:func:`head_loss_sum` for a head whose weight (and bias) is a DTensor sharded over the vocabulary
    (``Shard(0)`` on a 1-D tensor-parallel mesh); the loss, the same on every rank of the mesh.

    Every rank takes every token's hidden state (gathered when sequence parallelism split them) and computes the
    logits of its own vocabulary rows only; the row max, the target's logit and the sum of exponentials are
    all-reduced over the mesh per chunk (:class:`LinearCrossEntropy` with a group). The full-vocabulary weight and
    logits never exist. Each rank's gradient of the hidden states covers its rows only: a partial sum, which
    DTensor reduces in backward (a reduce-scatter back to the sequence shards, or an all-reduce).

    NOTE: why not the simpler alternative, gathering the head's weight whole and running the fused loss on each
    rank's own sequence shard: that moves the weight (V × C) forward and its gradient backward every step where
    this moves the hidden states (B × T × C), and it holds the full weight and its fp32 gradient on every rank
    (3 GB for Llama 3 8B's 128k × 4096 head in bf16), where this holds 1 / tp of them. Measured with
    bench/ab/tp_loss_ab.py (2 gloo ranks on 2 busy CPU cores, fp32, the loss's forward and backward alone, steps of
    both interleaved): vocabulary 32k, width 256, 2 × 512 tokens: vocab-parallel 1.21 s per step and 114.5 MiB
    allocated at the peak per rank, gathered weight 1.67 s and 161.0 MiB (an earlier, quieter run: 0.68 s against
    1.06 s); the same losses and gradients (5e-7 apart). Only where tokens outnumber the vocabulary does the
    gathered weight win: vocabulary 4096, 4 × 2048 tokens: 1.45 s and 96.3 MiB against 1.23 s and 84.2 MiB.
    LLM vocabularies (32k-256k) against micro-batches of a few thousand tokens per rank favour this one.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    weight, bias = head.weight, head.bias
    mesh = weight.device_mesh
    if isinstance(hidden, DTensor):  # sequence parallel: (B, T / tp, C) shards → (B, T, C) on every rank
        hidden = hidden.redistribute(placements=[Replicate()])
    else:
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    hidden = hidden.to_local(grad_placements=[Partial()])  # (B, T, C): this rank's rows give a partial gradient
    weight_local = weight.to_local()  # (V / tp, C)
    bias_local = bias.to_local() if bias is not None else None
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        hidden, weight_local = hidden.detach(), weight_local.detach()
        bias_local = bias_local.detach() if bias_local is not None else None
    rows = weight_local.size(0)
    chunk_tokens = chunk_tokens or head_chunk_tokens(rows)
    vocab_slice = (mesh.get_local_rank() * rows, mesh.get_group())
    return LinearCrossEntropy.apply(hidden.flatten(0, 1), weight_local, bias_local, labels.flatten(), chunk_tokens,
                                    vocab_slice)


def _chunk_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _accumulate_product(total: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``total + a @ b`` summed in float32 or wider: the first product as it is (no zero-filled buffer, no add),
    later ones added by the GEMM itself; a bfloat16 product is widened to float32 first."""
    if torch.promote_types(a.dtype, torch.float32) != a.dtype:
        product = a.mm(b).float()
        return product if total is None else total.add_(product)
    return a.mm(b) if total is None else total.addmm_(a, b)


def _loss_and_grad_by_log_softmax(logits: torch.Tensor, labels: torch.Tensor,
                                  valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of one chunk's float32 logits (n, V) over the whole vocabulary, and its gradient,
    softmax minus the one-hot targets, written over the logits: one log-softmax pass (the CPU kernel finds each
    row's max and sum while the row is in cache) and one exp, where max, subtract, exp, sum and divide made five
    passes. Ignored rows (``valid`` False) add no loss; their gradient rows are left as their softmax, so the
    products that read the gradient must mask them out: masking their (n, C) operands costs a pass over C, not
    over the vocabulary.

    The CPU's path, where it was measured (BENCHMARKS.md, "The loss in two passes"); other devices take
    :func:`_loss_and_grad_by_max_and_sum`. Out-of-range labels fail in ``gather`` (an index error)."""
    targets = torch.where(valid, labels, 0).unsqueeze(1)  # (n, 1)
    # NOTE: in place: the kernel reads a row for its max and sum before writing that row (its result is the same).
    log_probs = torch.log_softmax(logits, dim=1, out=logits)
    loss = -torch.where(valid, log_probs.gather(1, targets).squeeze(1), 0.0).sum()
    grad_logits = log_probs.exp_()
    grad_logits.scatter_add_(1, targets, -valid.unsqueeze(1).to(grad_logits.dtype))
    return loss, grad_logits


def _loss_and_grad_by_max_and_sum(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, first_row: int = 0,
                                  group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_loss_and_grad_by_log_softmax`'s result in five passes, all in place: each row's max is subtracted,
    exponentiated, summed and divided by. With ``group``, the logits are vocabulary rows first_row..first_row +
    V_local of a vocabulary split over it, and the max, the target logit and the sum of exponentials are
    all-reduced over it. The gradient's ignored rows are zero."""
    local_labels = labels - first_row
    # NOTE: without a split every valid label must be a row here, so one outside the vocabulary fails in gather.
    in_slice = valid & (local_labels >= 0) & (local_labels < logits.size(1)) if group is not None else valid
    targets = torch.where(in_slice, local_labels, 0).unsqueeze(1)  # (n, 1)
    target_logit = torch.where(in_slice, logits.gather(1, targets).squeeze(1), 0.0)
    row_max = logits.amax(dim=1, keepdim=True)
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    exp_sum = logits.sub_(row_max).exp_().sum(dim=1, keepdim=True)  # logits now hold exp(x - max)
    if group is not None:
        sums = torch.cat([exp_sum, target_logit.unsqueeze(1)], dim=1)  # (n, 2): one all-reduce for both sums
        dist.all_reduce(sums, group=group)
        exp_sum, target_logit = sums[:, :1], sums[:, 1]
    token_loss = exp_sum.log().squeeze(1) + row_max.squeeze(1) - target_logit
    # softmax - one-hot; an ignored row divides by inf and gets no -1: all zeros.
    grad_logits = logits.div_(torch.where(valid.unsqueeze(1), exp_sum, float("inf")))
    grad_logits.scatter_add_(1, targets, -in_slice.unsqueeze(1).to(grad_logits.dtype))
    return torch.where(valid, token_loss, 0.0).sum(), grad_logits


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T + bias`` whose forward also computes the gradients.

    Per chunk of tokens: fp32 logits; their loss and, in place, their gradient, softmax minus the one-hot target
    (zero for IGNORE_INDEX rows, or masked out of the products), multiplied into the gradients of hidden and of
    weight and bias. The backward scales those by the incoming gradient. The matmuls run in the compute dtype
    (autocast's, under mixed precision).

    ``vocab_slice``: (first row, process group) when ``weight`` holds only rows first..first + V_local of a
    vocabulary split over the group: max, target logit and sum of exponentials are all-reduced over it, and
    the gradient of hidden is this slice's part of the sum (see :func:`vocab_parallel_loss_sum`).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                labels: torch.Tensor, chunk_tokens: int, vocab_slice: Optional[tuple] = None) -> torch.Tensor:
        first_row, group = vocab_slice if vocab_slice is not None else (0, None)
        want_hidden, want_weight = hidden.requires_grad, weight.requires_grad
        want_bias = bias is not None and bias.requires_grad
        total = hidden.new_zeros((), dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = None  # the first chunk's product, then the others' added by the GEMM (addmm_)
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        for start in range(0, hidden.size(0), chunk_tokens):
            hidden_chunk = hidden[start:start + chunk_tokens]  # (n, C)
            label_chunk = labels[start:start + chunk_tokens]  # (n,)
            logits = F.linear(hidden_chunk, weight, bias).float()  # (n, V) fp32, a fresh tensor
            valid = label_chunk != IGNORE_INDEX
            # NOTE: whether any row is ignored is not asked: on a GPU the answer would wait for the device.
            if group is None and kernel_device_type(logits.device.type) == "cpu":
                chunk_loss, grad_logits = _loss_and_grad_by_log_softmax(logits, label_chunk, valid)
                row_mask = valid.unsqueeze(1)  # (n, 1)
            else:
                chunk_loss, grad_logits = _loss_and_grad_by_max_and_sum(logits, label_chunk, valid, first_row, group)
                row_mask = None  # ignored rows are zero already
            total = total + chunk_loss
            grad_logits = grad_logits.to(hidden.dtype if not torch.is_autocast_enabled(hidden.device.type)
                                         else torch.get_autocast_dtype(hidden.device.type))
            if want_hidden:
                rows = grad_hidden[start:start + chunk_tokens]  # contiguous: whole rows
                if grad_logits.dtype == rows.dtype:
                    torch.mm(grad_logits, weight.to(grad_logits.dtype), out=rows)
                else:  # autocast: bfloat16 products of float32 hidden states
                    rows.copy_(grad_logits.mm(weight.to(grad_logits.dtype)))
                if row_mask is not None:
                    rows.mul_(row_mask.to(rows.dtype))
            if want_weight:
                masked_hidden = hidden_chunk if row_mask is None else hidden_chunk * row_mask.to(hidden_chunk.dtype)
                grad_weight = _accumulate_product(grad_weight, grad_logits.t(), masked_hidden.to(grad_logits.dtype))
            if want_bias:
                grad_bias += (grad_logits.float().sum(0) if row_mask is None
                              else torch.mv(grad_logits.float().t(), row_mask.view(-1).float()))
            del logits, grad_logits
        if want_weight and grad_weight is None:  # no tokens at all
            grad_weight = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return total

    @staticmethod
    @first_order_only  # the saved gradients are constants here
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_total.float()
        out_hidden = (grad_hidden * scale.to(grad_hidden.dtype)) if grad_hidden is not None else None
        out_weight = (grad_weight * scale).to(ctx.weight_dtype) if grad_weight is not None else None
        out_bias = (grad_bias * scale).to(ctx.bias_dtype) if grad_bias is not None else None
        return out_hidden, out_weight, out_bias, None, None, None
