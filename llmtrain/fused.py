"""Attention's q/k/v projections as one GEMM, with RoPE and block attention written out around it: the CPU's
training path for attention, where block attention runs (``llmtrain.model.attention_kernel``).

Autograd runs the q, k and v projections as three GEMMs forward and three pairs backward, sums the input's three
gradients in two more passes, and RoPE makes about eleven passes over q and over k. :func:`qkv_attention` runs one
GEMM over the three weights stacked row-wise (stacked afresh each step from the separate parameters, which stay
as they are for checkpoints, conversion, LoRA and sharding). RoPE writes the rotated queries and keys straight
into the layouts block attention reads, in three passes; its backward writes the queries' and keys' gradients,
with attention's 1/sqrt(hs) folded into its tables, straight into the one gradient buffer of the GEMM's output,
which the backward's two GEMMs (input and weights) take whole.

The same for the MLP's gate and up projections (one GEMM, the activation's gradients written into one buffer) was
measured and left out: no faster, as the GEMM was no faster and stacking the weights and copying the gradients
cost what the saved pass gained (BENCHMARKS.md, "One GEMM for q, k and v"). What the gated MLP does take is
:func:`gated_product`: act(gate) * up with a backward that writes its two gradients over the buffers it saved
(the activation's output, then ``up``), where autograd's three passes write three fresh tensors; the same passes,
and a llama-20m step 1.6% faster in float32 on the CPU (bfloat16 keeps the composite: 2% slower in place there;
BENCHMARKS.md, "The gated MLP's backward in place").

:func:`fusable` says where the path applies: plain ``nn.Linear`` projections whose weights are plain tensors of
the input's dtype (not LoRA, quantized, tensor-parallel DTensors or DeepSpeed's partitioned parameters), on the
CPU, outside autocast and outside ``torch.compile`` (which fuses the modules' path itself), and where no hook
expects to see the projections run (:func:`runs_hooks`). Both paths compute the same function (tests/model/test_fused.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrain.attention import attend_blocks, attend_blocks_backward
from llmtrain.autograd import first_order_only
from llmtrain.kernel_device import kernel_device_type


# The parallel engines' modules: their hooks on a module gather or free its parameters, which the fused paths read
# directly (and refuse where they are partitioned), rather than watch or change what the module computes.
_ENGINE_MODULES = ("torch.distributed.", "deepspeed.")


def _is_engine_hook(hook) -> bool:
    function = getattr(hook, "__wrapped__", hook)  # FSDP2 wraps its group hooks with functools.wraps
    return getattr(getattr(function, "__func__", function), "__module__", "").startswith(_ENGINE_MODULES)


def runs_hooks(*modules: nn.Module) -> bool:
    """Whether a hook expects to see one of ``modules`` run: a forward or backward hook (or pre-hook) of the module,
    or one on every module (a profiler's, a debugger's), other than a parallel engine's bookkeeping. A fused path
    that computes what ``modules`` compute without calling them must then leave them to run."""
    # NOTE: private registries, read as nn.Module._call_impl reads them.
    registries = [nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks,
                  nn.modules.module._global_backward_hooks, nn.modules.module._global_backward_pre_hooks]
    for module in modules:
        registries += [module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                       module._backward_pre_hooks]
    return any(not _is_engine_hook(hook) for hooks in registries for hook in hooks.values())


def fusable(x: torch.Tensor, *projections: nn.Module) -> bool:
    """Whether ``projections`` of ``x`` may run as one GEMM here (module docstring)."""
    if kernel_device_type(x.device.type) != "cpu" or torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling():
        return False
    if runs_hooks(*projections):
        return False
    for module in projections:
        if type(module) is not nn.Linear:
            return False
        for param in (module.weight, module.bias):
            # NOTE: DTensor by name (importing it costs a second); DeepSpeed marks its partitioned parameters ds_id.
            if param is not None and (type(param.data) is not torch.Tensor or hasattr(param, "ds_id")
                                      or param.dtype != x.dtype):
                return False
    return True


def qkv_attention(x: torch.Tensor, q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear, cos: torch.Tensor,
                  sin: torch.Tensor, head_size: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Causal self-attention of x (B, T, C) up to the output projection: the q/k/v projections, RoPE over whole
    heads (cos and sin (T, head_size)) and block attention in ``dtype``. Returns (B, T, nh * hs) in x's dtype."""
    return _QKVAttention.apply(x, cos, sin, head_size, block, dtype, q_proj.weight, k_proj.weight, v_proj.weight,
                               q_proj.bias, k_proj.bias, v_proj.bias)


def _rope_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> None:
    """out = RoPE of x (sign 1) or its transpose (sign -1, the backward), in the "rotate_half" layout: the first half
    of each head pairs with the second. Three passes, written into ``out`` whatever its strides and dtype."""
    half = x.size(-1) // 2
    torch.mul(x, cos, out=out)
    out[..., :half].addcmul_(x[..., half:], sin[..., half if sign < 0 else 0:][..., :half], value=-sign)
    out[..., half:].addcmul_(x[..., :half], sin[..., 0 if sign < 0 else half:][..., :half], value=sign)


class _QKVAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, hs, block, dtype, wq, wk, wv, bq, bk, bv):
        B, T, C = x.shape
        n_head, groups = wq.size(0) // hs, wk.size(0) // hs
        rep = n_head // groups
        x2d = x.reshape(B * T, C)
        weight, bias = _stacked(wq, wk, wv, bq, bk, bv)
        qkv = torch.mm(x2d, weight.t()) if bias is None else torch.addmm(bias, x2d, weight.t())
        qkv = qkv.view(B, T, n_head + 2 * groups, hs)
        q = qkv[:, :, :n_head].view(B, T, groups, rep, hs).permute(0, 2, 1, 3, 4)  # (B, ng, T, rep, hs)
        k = qkv[:, :, n_head:n_head + groups].transpose(1, 2)  # (B, ng, T, hs)
        v = qkv[:, :, n_head + groups:].transpose(1, 2)
        cos, sin = cos.to(torch.promote_types(dtype, x.dtype)), sin.to(torch.promote_types(dtype, x.dtype))
        # Block attention's layouts, written by RoPE: a group's query heads stacked position-major.
        q_rows = x.new_empty(B, groups, T, rep, hs, dtype=dtype)
        _rope_into(q_rows, q, cos.unsqueeze(1), sin.unsqueeze(1), 1.0)
        keys = x.new_empty(B, groups, T, hs, dtype=dtype)
        _rope_into(keys, k, cos, sin, 1.0)
        values = x.new_empty(B, groups, T, hs, dtype=dtype).copy_(v)
        q_rows, keys, values = q_rows.view(B * groups, T * rep, hs), keys.view(-1, T, hs), values.view(-1, T, hs)
        y, probs = attend_blocks(q_rows, keys, values, B, block)
        ctx.save_for_backward(x, cos, sin, wq, wk, wv, bq, bk, bv, q_rows, keys, values, *probs)
        ctx.block, ctx.shape = block, (B, T, n_head, groups, hs)
        return y.view(B, T, n_head * hs).to(x.dtype)

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        x, cos, sin, wq, wk, wv, bq, bk, bv, q_rows, keys, values, *probs = ctx.saved_tensors
        B, T, n_head, groups, hs = ctx.shape
        rep = n_head // groups
        wide = torch.promote_types(dy.dtype, torch.float32)
        dq = dy.new_empty(B, groups, T, rep, hs, dtype=wide)  # the rows' layout, which RoPE's transpose reads
        dk, dv = attend_blocks_backward(dy.to(q_rows.dtype), q_rows, keys, values, probs, ctx.block,
                                        dq.transpose(2, 3))
        # The GEMM output's gradient, in x's dtype: RoPE's transpose of the queries' and keys' gradients, with the
        # scores' scale 1/sqrt(hs) in its tables, and the values' gradient.
        scale = 1.0 / math.sqrt(hs)
        cos, sin = cos.to(wide) * scale, sin.to(wide) * scale
        grad = dy.new_empty(B, T, n_head + 2 * groups, hs, dtype=wide)
        cos, sin = cos[:, None, None], sin[:, None, None]  # (T, 1, 1, hs): token-major layouts here
        _rope_into(grad[:, :, :n_head].view(B, T, groups, rep, hs), dq.transpose(1, 2), cos, sin, -1.0)
        _rope_into(grad[:, :, n_head:n_head + groups], dk.view(B, groups, T, hs).transpose(1, 2), cos[:, 0],
                   sin[:, 0], -1.0)
        grad[:, :, n_head + groups:].copy_(dv.view(B, groups, T, hs).transpose(1, 2))
        grad = grad.view(B * T, -1).to(x.dtype)
        # The stacked GEMM's backward: one GEMM for the input's gradient, one for the three weights'.
        sizes = [wq.size(0), wk.size(0), wv.size(0)]
        needs = ctx.needs_input_grad
        grad_x = torch.mm(grad, _stacked(wq, wk, wv)[0]).view_as(x) if needs[0] else None
        grad_w = torch.mm(grad.t(), x.reshape(B * T, -1)).split(sizes) if any(needs[6:9]) else (None,) * 3
        grad_b = grad.sum(0).split(sizes) if any(needs[9:]) else (None,) * 3
        grad_b = [g if b is not None else None for g, b in zip(grad_b, (bq, bk, bv))]
        return (grad_x, None, None, None, None, None, *grad_w, *grad_b)


def _stacked(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, bq: Optional[torch.Tensor] = None,
             bk: Optional[torch.Tensor] = None,
             bv: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The weights stacked row-wise, and the biases (zeros for a projection without one) or None where none has."""
    weight = torch.cat((wq, wk, wv))
    if bq is None and bk is None and bv is None:
        return weight, None
    pairs = ((wq, bq), (wk, bk), (wv, bv))
    return weight, torch.cat([b if b is not None else w.new_zeros(w.size(0)) for w, b in pairs])


def gating_activation(x: torch.Tensor, approximate: Optional[str] = None) -> torch.Tensor:
    """The gated MLP's activation: SiLU with ``approximate`` None, else GELU with that approximation."""
    return F.silu(x) if approximate is None else F.gelu(x, approximate=approximate)


def gated_product(gate: torch.Tensor, up: torch.Tensor, approximate: Optional[str] = None) -> torch.Tensor:
    """act(gate) * up, the gated MLP's hidden state: SiLU (SwiGLU) with ``approximate`` None, else GELU with that
    approximation (GeGLU). Its backward writes the two gradients over buffers it saved (the activation's output,
    then ``up``), where the composite's three passes write fresh ones: call it only where
    :func:`may_overwrite_gating` allows."""
    return _GatedProduct.apply(gate, up, approximate)


def may_overwrite_gating(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *projections: nn.Module) -> bool:
    """Whether :func:`gated_product` may run on these projections' outputs: training on the CPU in float32 or wider
    (where it was measured faster; bfloat16's in-place products are slower than its out-of-place ones there) outside
    ``torch.compile`` (which fuses the composite itself), on plain tensors, with no forward hook on the projections
    or on every module that could hold an output whose buffer the backward overwrites."""
    if (kernel_device_type(x.device.type) != "cpu" or torch.compiler.is_compiling()
            or not (gate.requires_grad or up.requires_grad)):
        return False
    if gate.dtype not in (torch.float32, torch.float64):
        return False
    if type(gate) is not torch.Tensor or type(up) is not torch.Tensor or gate.shape != up.shape:
        return False
    if gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr():  # overwriting one would change both
        return False
    if nn.modules.module._global_forward_hooks:  # NOTE: private registry, as in runs_hooks()
        return False
    return not any(module._forward_hooks for module in projections)


class _GatedProduct(torch.autograd.Function):
    # NOTE: the backward overwrites its saved tensors, so a second backward through the same graph
    # (retain_graph=True) must fail loudly instead of computing from them. Their version counters catch it, except
    # where saved-tensor hooks (activation checkpointing, save_on_cpu) hand the backward other tensors: so the
    # backward also refuses to run twice.
    @staticmethod
    def forward(ctx, gate, up, approximate):
        act = gating_activation(gate, approximate)
        ctx.approximate = approximate
        ctx.save_for_backward(gate, up, act)
        return act * up

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        if getattr(ctx, "overwritten", False):
            raise RuntimeError("a second backward through the gated MLP's in-place product (llmtrain.fused."
                               "gated_product): its first backward overwrote the tensors this one needs. Run the "
                               "forward again for each backward, or compile the model (its gated MLP is not in place)")
        ctx.overwritten = True
        gate, up, act = ctx.saved_tensors
        need_gate, need_up = ctx.needs_input_grad[:2]
        grad_up = act.mul_(grad) if need_up else None  # act(gate) is not needed again
        grad_gate = None
        if need_gate:
            grad_act = up.mul_(grad)
            if ctx.approximate is None:
                grad_gate = torch.ops.aten.silu_backward.grad_input(grad_act, gate, grad_input=grad_act)
            else:
                grad_gate = torch.ops.aten.gelu_backward.grad_input(grad_act, gate, approximate=ctx.approximate,
                                                                    grad_input=grad_act)
        return grad_gate, grad_up, None
