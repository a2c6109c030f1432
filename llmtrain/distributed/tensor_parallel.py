"""Tensor parallelism (Megatron-style) with optional sequence parallelism, applied to a plain ``GPT`` from outside.

Inside each Block the two matmul pairs are split so that each needs one collective forward and one backward:

    attention   q, k, v column-parallel (each rank its heads)  →  o_proj row-parallel (partial sums reduced)
    MLP         gate, up / fc column-parallel                  →  down / proj row-parallel

The embedding is split over the vocabulary (row-parallel: each rank looks up its rows, the partial embeddings
are summed), the head over the vocabulary too (column-parallel); tied embeddings are one weight, sharded the same
way (``Shard(0)``) for both. The loss reads the head's vocabulary shard directly (:mod:`llmtrain.loss`).

With sequence parallelism the residual stream between those pairs, the norms and their activations are split
over the sequence (``Shard(1)``): each rank normalises T / tp positions, the row-parallel outputs are
reduce-scattered instead of all-reduced, and the inputs of attention and MLP are all-gathered. Same traffic,
tp times less activation memory outside the matmuls.

The model may be a pipeline stage: an embedding, final norm or head it does not hold (None) is skipped.

A mixture-of-experts MLP (:class:`llmtrain.moe.MoE`) is not split: its router, shared experts and routed experts run
whole on every tensor-parallel rank, on the whole sequence (gathered first under sequence parallelism, and split
again after). Routing is per token and the experts are many small matmuls: splitting each expert's width over the
tensor-parallel ranks would add two collectives per block for products a fraction the size of the dense MLP's.
What splits the routed experts is expert parallelism (``--ep_size``, ``llmtrain.distributed.expert_parallel``),
over the data-parallel ranks; FSDP shards the rest.
"""

from __future__ import annotations

import torch.nn as nn

from llmtrain.model import transformer_blocks
from llmtrain.moe import MoE


def apply_tensor_parallel(model: nn.Module, tp_mesh, *, sequence_parallel: bool) -> None:
    """Shard ``model``'s parameters over the 1-D ``tp_mesh`` in place, with ``parallelize_module``.

    Works on the meta device (the weights are materialised later, see ``parallelize.materialize``) or on real
    weights. The residual stream is a DTensor ``Shard(1)`` between the layers with ``sequence_parallel``,
    a plain (replicated) tensor without; inside attention and the MLP activations are plain local tensors.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between layers
    tied = _is_tied(model)
    plan: dict[str, object] = {}
    if getattr(model, "wte", None) is not None:
        plan["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream,
                                      use_local_output=not sequence_parallel)
    if getattr(model, "norm_f", None) is not None:
        plan["norm_f"] = SequenceParallel() if sequence_parallel else _replicated_norm()
    if getattr(model, "lm_head", None) is not None:
        # NOTE: model(idx) without labels returns the whole vocabulary's logits, gathered; training reads the
        # weight's shard in the loss instead and never calls the head.
        plan["lm_head"] = ColwiseParallel(input_layouts=stream, output_layouts=Replicate(), use_local_output=True)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if tied:
        model.lm_head.weight = model.wte.weight  # each style distributed its own copy: one weight again
    for block in transformer_blocks(model):
        parallelize_module(block, tp_mesh, _block_plan(block, stream, sequence_parallel))


def _block_plan(block: nn.Module, stream, sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel)

    colwise = ColwiseParallel()  # replicated input, this rank's output features as a plain tensor
    rowwise = RowwiseParallel(output_layouts=stream, use_local_output=not sequence_parallel)
    # attention(x, cos, sin, mask, input_pos) and mlp(x): gather x once for all of its projections.
    plan = {
        "attn": PrepareModuleInput(input_layouts=(stream, None, None, None, None),
                                   desired_input_layouts=(Replicate(), None, None, None, None)),
        "attn.q_proj": colwise, "attn.k_proj": colwise, "attn.v_proj": colwise, "attn.o_proj": rowwise,
    }
    if isinstance(block.mlp, MoE):  # whole on every rank (the module's docstring): the whole sequence in and out
        plan["mlp"] = PrepareModuleInputOutput(input_layouts=(stream,), desired_input_layouts=(Replicate(),),
                                               use_local_input=True, output_layouts=(Replicate(),),
                                               desired_output_layouts=(stream,),
                                               use_local_output=not sequence_parallel)
    else:
        plan["mlp"] = PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
        up, down = (("fc",), "proj") if hasattr(block.mlp, "fc") else (("gate_proj", "up_proj"), "down_proj")
        plan.update({f"mlp.{name}": colwise for name in up})
        plan[f"mlp.{down}"] = rowwise
    norm = SequenceParallel if sequence_parallel else _replicated_norm
    plan["attn_norm"] = norm()
    if block.mlp_norm is not None:  # Phi shares the attention norm
        plan["mlp_norm"] = norm()
    return plan


def _replicated_norm():
    """Without sequence parallelism every tensor-parallel rank normalises the whole sequence: the norm's weights
    become replicated DTensors (plain tensors in and out), so that every parameter of the model is a DTensor on
    the tensor-parallel mesh, which a fused or foreach optimizer step over all of them needs."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class ReplicatedNorm(ParallelStyle):
        def _apply(self, module: nn.Module, mesh) -> nn.Module:
            return distribute_module(module, mesh, input_fn=self._wrap, output_fn=self._unwrap)

        @staticmethod
        def _wrap(module, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

        @staticmethod
        def _unwrap(module, output, mesh):
            return output.to_local()

    return ReplicatedNorm()


def _is_tied(model: nn.Module) -> bool:
    wte, lm_head = getattr(model, "wte", None), getattr(model, "lm_head", None)
    return wte is not None and lm_head is not None and lm_head.weight is wte.weight
