"""The memory model: what one device holds at the peak of a training step, per quantity.

Everything here is arithmetic on a :class:`Config` and a :class:`ParallelPlan`. Nothing builds a model,
spawns a process or touches the data, so a plan for 8 GPUs × 4 nodes prints on a laptop.

Activation memory counts what autograd keeps for the backward pass, per token and layer, for the
layers llmtrain's model uses (measured with saved-tensor hooks on the real blocks, see
tests/test_plan.py, which also checks the total against a measured peak):

- RMSNorm keeps its input and one fp32 scale per token (d · a + 4 bytes, ``llmtrain.model._RMSNormFunction``);
  LayerNorm keeps its input.
- Attention keeps 2 · q + 4 · kv elements (q = n_head · head_size, kv = n_query_groups · head_size):
  projections, RoPE inputs and the SDPA inputs and output. SDPA's flash kernels keep no T × T matrix;
  block attention (llmtrain.attention, CPU training on short sequences) keeps its probabilities, a block-causal
  part of it.
- A gated MLP (SwiGLU, GeGLU) keeps 4 · f + d elements; a plain GELU MLP 2 · f + d.
- A mixture of experts keeps, per token, its input (d) and for each of its k routed rows the row (d), the
  expert's gated MLP (4 · I) and the row's output (d, for the weighted sum), plus the router's fp32 scores and
  logits (8 · E bytes), three int64 indices per row and the k weights (:func:`moe_bytes_per_token`).
- With activation checkpointing a block keeps only its input (d elements); one block's full set comes
  back at a time during backward, after the head's are freed.
- The loss (llmtrain.model.LinearCrossEntropy) computes its gradients in the forward, one chunk of
  tokens at a time: a chunk's fp32 logits (4 · V bytes per token, plus their copy in the compute dtype
  when that is narrower) exist only while it is processed; every token keeps its hidden state's
  gradient (d elements), and the head's weight gradient (V · d fp32) waits for the backward.

Tensor and pipeline parallelism (``--tp_size``, ``--pp_size``) change what one device holds: each quantity has
one function, which the estimate and the dry run both ask: :func:`rank_parameters` (the blocks of a pipeline rank,
split over tp), :func:`activation_bytes_per_token` (heads and MLP width split over tp, the norms too with sequence
parallelism) and :func:`microbatches_in_flight` (per pipeline schedule); what a split sends and idles is
:mod:`llmtrain.plan.communication`'s. The estimate reports the pipeline rank that needs the most.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch

from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.flops import expert_parameters, moe_mlp_parameters, num_parameters
from llmtrain.quantize import quantized_bytes_per_weight

GiB = 2**30


@dataclass
class MemoryEstimate:
    """Bytes per device at the peak of a training step (forward end / loss)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    pipeline_rank: int = 0
    """The pipeline rank these bytes are of (the one that needs the most)."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        parts = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer", self.optimizer),
                 ("activations", self.activations), ("total", self.total)]
        return " | ".join(f"{name} {format_size(value)}" for name, value in parts)


def format_size(nbytes: float) -> str:
    """``nbytes`` as the dry run prints it: GiB from a tenth of one, MiB below."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 10 else f"{nbytes / 2**20:.1f} MiB"


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.finfo(dtype).bits // 8


def activation_bytes_per_token(config: Config, compute_dtype: torch.dtype, checkpointing: Union[bool, str], *,
                               tp: int = 1, sequence_parallel: bool = False,
                               attention_dtype: Optional[torch.dtype] = None,
                               attention_scores: float = 0.0, ep: int = 1) -> dict[str, float]:
    """Bytes autograd keeps per token on one tensor-parallel rank: per block, for the whole stack, for the loss.

    ``layer``: one block's full set; ``kept``: what a block keeps until its backward, on average over the blocks
    (``layer``, or less under ``checkpointing``: False, "full", "selective:N" or "op"); ``stack``: ``n_layer``
    blocks' ``kept``; ``recomputed``: what a checkpointed block's backward makes again at once (0 without
    checkpointing); ``head_hidden``: norm_f's saved tensors and the hidden state's gradient; ``logits``: one token's
    logits in the loss chunk.

    A ``full`` checkpointed block keeps only its input. ``selective:N`` checkpoints ceil(n_layer / N) of the blocks
    (layer 0, N, 2N, ...) and the others keep their full set. An ``op`` block keeps its input and the outputs of its
    matmuls, attention (with its fp32 log-sum-exp) and tensor-parallel collectives: the norms' tensors, RoPE's and
    the MLP activation's are what it saves.

    Tensor parallelism splits the heads (q, k, v, SDPA) and the MLP width over ``tp`` ranks. The norms' tensors and
    the d-wide inputs of the linears are replicated on every rank, unless sequence parallelism splits them over the
    sequence: then the norms' tensors are divided by ``tp``, but not the inputs of the column-parallel linears
    (attention's q, k, v and the MLP's first): torch's DTensor gathers each over the sequence and keeps it whole for
    the backward, where Megatron-LM gathers it again. NOTE: this estimate divided those by ``tp`` too until
    ``--dry_run.simulate`` measured them whole (TinyLlama at tp 4: 1.0 GiB more than estimated at 32 ranks).
    The vocabulary-sharded head holds ``V / tp`` of each token's logits.

    A mixture of experts' MLP (:func:`moe_bytes_per_token`) is not split over ``tp`` (the ranks of a tensor-parallel
    group route the same tokens; under sequence parallelism each routes its part of the sequence). ``dispatch``: the
    all-to-all's send and receive buffers of one block under expert parallelism (``ep`` > 1), which exist while the
    rows travel, a block at a time.

    ``attention_dtype`` (``llmtrain.model.attention_dtype``; default ``compute_dtype``): where attention computes
    in float32 although the model computes in bfloat16, the q, k, v and output it saves take 4 bytes an element
    (block attention does not keep its output); ``op`` recomputes the float32 copies of q, k, v and keeps only the
    output.

    ``attention_scores``: the probabilities attention keeps per query and head, in ``attention_dtype``, where it
    runs as block-causal matmuls (``llmtrain.attention.saved_scores_per_query``; 0 for SDPA, which keeps a
    log-sum-exp). ``op`` keeps the float32 scores those matmuls write, as many.
    """
    from llmtrain.args import canonical_checkpointing, checkpointed_every

    a = dtype_bytes(compute_dtype)
    d, f = config.n_embd, config.intermediate_size
    q, kv = config.n_head * config.head_size, config.n_query_groups * config.head_size
    # NOTE: the norm's input in the compute dtype, as the other residual-stream terms here; under autocast without
    # FSDP's mixed precision (one device, DDP) the stream stays fp32, 2d bytes a token more per norm than counted.
    norm = d * a + (4 if config.norm_class_name == "RMSNorm" else 0)  # the input, and RMSNorm's fp32 scale per token
    norms = 1 if config.shared_attention_norm else 2
    gated = config.mlp_class_name in ("LLaMAMLP", "GemmaMLP")
    sequence_split = tp if sequence_parallel else 1
    replicated = norms * norm + d * a  # the norms, and the MLP's input
    upcast = dtype_bytes(attention_dtype) - a if attention_dtype is not None else 0  # attention in float32 (above)
    # block attention's (above)
    scores = dtype_bytes(attention_dtype or compute_dtype) * config.n_head * attention_scores
    upcast_saved = (q + 2 * kv if attention_scores else 2 * q + 2 * kv) * upcast  # q, k, v (and SDPA's output)
    mlp = 0 if config.is_moe else (4 if gated else 2) * f * a
    split = (2 * q + 4 * kv) * a + upcast_saved + scores + mlp  # heads, MLP
    experts = moe_bytes_per_token(config, a) / sequence_split  # a mixture of experts: not split over tp (above)
    # the attention's and the MLP's gathered inputs, whole on every rank under sequence parallelism (above)
    gathered_inputs = (2 if sequence_parallel and tp > 1 else 0) * d * a * (1 - 1 / tp)
    layer = replicated / sequence_split + split / tp + gathered_inputs + experts
    block_input = d * a / sequence_split
    mode = canonical_checkpointing(checkpointing)
    if mode == "op":
        # NOTE: attention's o and the MLP's down projection write a d-wide partial sum on every rank; under tensor
        # parallelism each then goes through a collective whose output is kept as well.
        attention_saved = 4 * config.n_head * (attention_scores or 1)  # the float32 scores, or SDPA's log-sum-exp
        mlp_matmuls = 0 if config.is_moe else (2 if gated else 1) * f * a
        matmuls = (((q + 2 * kv) * a + q * (a + upcast) + attention_saved + mlp_matmuls) / tp
                   + 2 * d * a + moe_matmul_bytes_per_token(config, a) / sequence_split)
        collectives = 2 * d * a / sequence_split if tp > 1 else 0
        checkpointed = block_input + matmuls + collectives
    else:
        checkpointed = block_input
    every = checkpointed_every(mode)
    count = -(-config.n_layer // every) if every else 0  # blocks 0, N, 2N, ... below n_layer
    kept = (count * checkpointed + (config.n_layer - count) * layer) / config.n_layer
    logits = (4 + (a if a < 4 else 0)) * config.padded_vocab_size / tp  # fp32, and their compute-dtype copy
    dispatch = 2 * config.n_expert_per_token * d * a / sequence_split if config.is_moe and ep > 1 else 0.0
    return {"layer": layer, "kept": kept, "stack": config.n_layer * kept,
            "recomputed": max(layer - checkpointed, 0.0) if count else 0.0,
            "head_hidden": norm / sequence_split + d * a, "logits": logits, "dispatch": dispatch}


def moe_bytes_per_token(config: Config, a: int) -> float:
    """What a mixture-of-experts MLP (``llmtrain.moe.MoE``) keeps for its backward per token, besides its input (the
    norm's output, counted with the block), in a compute dtype of ``a`` bytes; 0 for a dense MLP.

    Each of the token's k rows: the row gathered for its expert (d), the expert's gate and up outputs, the
    activation's and the product (4 · I), and the expert's output in token order for the weighted sum (d). The
    router: its float32 scores (softmax's output) and logits (the z-loss's log-sum-exp input), 8 · E bytes, and
    the log-sum-exp (4). Per row, three int64 indices (top-k's choice, the row's token, the inverse permutation)
    and its weight (float32 for the renormalisation, in the compute dtype for the sum). The shared experts: one
    gated MLP (4 · I · n_shared_expert). NOTE: measured with saved-tensor hooks on moe-debug's block, within
    0.1% in float32 and bfloat16. Expert parallelism moves the rows, not their count: under balanced routing a
    rank receives as many rows as it sends; a rank whose experts are chosen more keeps more.
    """
    if not config.is_moe:
        return 0.0
    k, d, hidden = config.n_expert_per_token, config.n_embd, config.moe_intermediate_size
    rows = k * (2 * d + 4 * hidden) * a
    router = 8 * config.n_expert + 4
    per_row = k * (3 * 8 + 4 + a) + 4  # indices, the weights (and their sum)
    shared = 4 * config.n_shared_expert * hidden * a
    return float(rows + router + per_row + shared)


def moe_matmul_bytes_per_token(config: Config, a: int) -> float:
    """What ``op`` checkpointing keeps of a mixture-of-experts MLP per token: the outputs of its matmuls (the
    router's logits, each row's gate, up and down products, the shared experts' gate and up) and the indices that
    put the rows back in place; 0 for a dense MLP."""
    if not config.is_moe:
        return 0.0
    k, hidden = config.n_expert_per_token, config.moe_intermediate_size
    return float((config.n_expert + k * (2 * hidden + config.n_embd) + 2 * config.n_shared_expert * hidden) * a
                 + 3 * 8 * k)


def head_chunk_tokens(config: Config) -> int:
    """Tokens per loss chunk (llmtrain.loss.head_loss_sum): the logits of more never exist at once."""
    from llmtrain import loss

    return loss.head_chunk_tokens(config.padded_vocab_size)


def _block_parameters(config: Config) -> int:
    embeddings = config.padded_vocab_size * config.n_embd * (1 if config.tie_embeddings else 2)
    head_bias = config.padded_vocab_size if config.lm_head_bias else 0
    return (num_parameters(config) - embeddings - head_bias - final_norm_parameters(config)) // config.n_layer


def final_norm_parameters(config: Config) -> int:
    """The parameters of one norm (the final one, or a block's): a scale, and a bias for LayerNorm."""
    return 2 * config.n_embd if config.norm_class_name == "LayerNorm" else config.n_embd


def block_parameters_per_rank(config: Config, tp: int, ep: int = 1) -> int:
    """One block's parameters on a tensor-parallel rank: all but its norms are split over ``tp`` (the row-parallel
    biases, replicated in fact, are counted as split: d parameters).

    A mixture of experts' MLP is not split over ``tp`` (tensor parallelism splits its attention); ``ep`` leaves the
    block ``n_expert / ep`` of its routed experts, the router and the shared experts whole: what an expert-parallel
    rank gathers of a block under FSDP (FSDP itself shards the experts over the rest of ``dp_shard``, so that a rank
    *stores* ``1 / dp_shard`` of them at any ep: :func:`rank_parameters` counts every expert, for that division).
    """
    norms = (1 if config.shared_attention_norm else 2) * final_norm_parameters(config)
    if not config.is_moe:
        return (_block_parameters(config) - norms) // tp + norms
    mlp = moe_mlp_parameters(config, config.n_expert)
    local_mlp = mlp - (config.n_expert - config.n_expert // ep) * expert_parameters(config)
    return (_block_parameters(config) - norms - mlp) // tp + norms + local_mlp


def expert_parameters_per_rank(config: Config, plan: ParallelPlan, pipeline_rank: int = 0) -> int:
    """The routed experts' weights among :func:`rank_parameters` (all ``n_expert`` of each block the rank holds;
    0 for a dense model)."""
    return stage_layers(config, plan)[pipeline_rank] * config.n_expert * expert_parameters(config)


def gathered_rank_parameters(config: Config, plan: ParallelPlan, pipeline_rank: int = 0) -> int:
    """:func:`rank_parameters` as the rank gathers them whole: with expert parallelism, ``n_expert / ep`` routed
    experts of each block instead of all of them (the same without it)."""
    experts = expert_parameters_per_rank(config, plan, pipeline_rank)
    return rank_parameters(config, plan, pipeline_rank) - experts + experts // plan.ep


def host_collective_bytes(config: Config, plan: ParallelPlan) -> int:
    """Bytes of /dev/shm that FSDP's collectives map on one CPU host (``llmtrain.distributed.shared_memory``), shared
    by its processes; 0 where they go through gloo or NCCL.

    Each kind of collective has two slots, grown (in whole MiB) to the largest unit: an all-gather slot holds one
    unit's weights in the all-gather dtype, a reduce-scatter slot the unit's gradients from every process of the
    shard group in the reduction dtype. The units are the embedding, each Block, and [final norm, head] (one root
    unit with the embedding when they are tied).
    """
    if plan.device_type != "cpu" or plan.wrapper != "fsdp" or plan.num_nodes > 1 or plan.dp_shard < 2:
        return 0
    from llmtrain.distributed import shared_memory

    if not shared_memory.enabled():
        return 0
    embedding = config.padded_vocab_size * config.n_embd // plan.tp  # tensor parallelism splits the vocabulary
    head_bias = config.padded_vocab_size // plan.tp if config.lm_head_bias else 0
    head = embedding + head_bias + final_norm_parameters(config)
    units = [block_parameters_per_rank(config, plan.tp, plan.ep), head] + ([] if config.tie_embeddings else [embedding])
    largest = max(units)
    precision = plan.precision
    gather = dtype_bytes(precision.compute_dtype if precision.is_mixed else precision.param_dtype)
    reduce = 4 if precision.is_mixed else dtype_bytes(precision.param_dtype)
    return shared_memory.pair_bytes(largest * gather) + shared_memory.pair_bytes(plan.dp_shard * largest * reduce)


# ---- tensor and pipeline parallelism: what one rank holds ------------------------------------------------------
def stage_layers(config: Config, plan: ParallelPlan) -> list[int]:
    """Blocks each pipeline rank holds, rank 0 first (one entry without a pipeline).

    The blocks are split into ``plan.pp_stages`` stages as the pipeline splits them (``n_layer // stages`` blocks,
    the first ``n_layer % stages`` stages one more); rank r holds stages r, r + pp, ... (one stage each, or
    ``pp_virtual_stages`` interleaved).
    """
    from llmtrain.distributed.pipeline import stage_layers as pipeline_stages  # NOTE: the one place of the split

    per_stage = [len(layers) for layers in pipeline_stages(config.n_layer, plan.pp_stages)]
    return [sum(per_stage[rank::plan.pp]) for rank in range(plan.pp)]


def rank_parameters(config: Config, plan: ParallelPlan, pipeline_rank: int = 0) -> int:
    """Parameters on one rank of pipeline rank ``pipeline_rank`` before FSDP shards them: its blocks split over tp;
    the first rank also holds the embedding, the last the final norm and the head (vocabulary rows split over tp).
    A tied embedding is one tensor without a pipeline, a copy on the first and the last rank with one."""
    tp, vocab_by_width = plan.tp, config.padded_vocab_size * config.n_embd
    first, last = pipeline_rank == 0, pipeline_rank == plan.pp - 1
    parameters = stage_layers(config, plan)[pipeline_rank] * block_parameters_per_rank(config, tp)
    if first:
        parameters += vocab_by_width // tp
    if last:
        head = 0 if config.tie_embeddings and first else vocab_by_width
        head += config.padded_vocab_size if config.lm_head_bias else 0
        parameters += head // tp + final_norm_parameters(config)
    return parameters


def microbatches_in_flight(plan: ParallelPlan, pipeline_rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``pipeline_rank`` keeps at its peak, each over all its blocks.

    Without a pipeline 1: accumulation steps run one after the other. GPipe: all m forwards run before the first
    backward. 1F1B (torch's Schedule1F1B): rank r runs min(m, pp - r) forwards before its first backward.
    Interleaved 1F1B (torch's ScheduleInterleaved1F1B, whose warm-up is Megatron-LM's): rank r runs
    (v - 1)·pp + 2·(pp - 1 - r) chunk forwards, then one more before its first backward, m·v at most; a chunk is one
    of its v stages, 1/v of its blocks.
    """
    m, pp, v = plan.pp_microbatches, plan.pp, plan.pp_virtual_stages
    if pp == 1:
        return 1.0
    if plan.pp_schedule == "gpipe":
        return float(m)
    if plan.pp_schedule == "1f1b":
        return float(min(m, pp - pipeline_rank))
    return min(m * v, (v - 1) * pp + 2 * (pp - 1 - pipeline_rank) + 1) / v


# ---- the estimate ------------------------------------------------------------------------------------------------
def state_bytes(config: Config, plan: ParallelPlan, pipeline_rank: int = 0, *,
                trainable_parameters: Optional[int] = None, quantize: Optional[str] = None) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes on one device of pipeline rank ``pipeline_rank``.

    Tensor and pipeline parallelism leave a rank :func:`rank_parameters`; the plan's sharding strategy (None
    without a wrapper) and shard size divide those; its CPU offload counts only when FSDP applies it.
    ``trainable_parameters`` below the total means LoRA: only the adapters have gradients and optimizer state.
    ``quantize`` stores the frozen linear weights in 4 bits (bnb.nf4, bnb.fp4) or 8 (bnb.int8). LoRA and
    quantization never run with tensor or pipeline parallelism (the recipes refuse it).

    Expert parallelism (``plan.ep``) stores as much per rank as FSDP alone (the experts over ``ep × dp_shard / ep``
    ranks, the rest over ``dp_shard``), but what a rank gathers of a block, and the gradients it holds unsharded,
    are its ``n_expert / ep`` experts, not all of them (:func:`block_parameters_per_rank`,
    :func:`gathered_rank_parameters`).
    """
    precision = plan.precision
    sharding = plan.sharding_strategy if plan.wrapper != "none" else None
    local = rank_parameters(config, plan, pipeline_rank)
    trainable = trainable_parameters if _adapters_only(config, plan, trainable_parameters) else local
    if plan.zero is not None:
        return zero_state_bytes(config, plan, local, trainable)
    stored, compute = dtype_bytes(precision.param_dtype), dtype_bytes(precision.compute_dtype)
    shard = plan.shard_size if sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD") else 1
    block = block_parameters_per_rank(config, plan.tp, plan.ep)
    gathered = gathered_rank_parameters(config, plan, pipeline_rank)

    frozen = local - trainable
    if quantize is not None:
        linear = _block_parameters(config) * config.n_layer  # the blocks' weights are what bitsandbytes quantizes
        per_weight = quantized_bytes_per_weight(quantize)
        params = (local - linear) * stored + linear * per_weight + trainable * stored
    else:
        params = (frozen + trainable) * stored
    params /= shard
    fsdp = sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")
    # NOTE: a pipeline schedule runs every backward of a step with FSDP's resharding and gradient sync off
    # (torch.distributed.pipelining's stage), and reduces once after the last: the stage's weights stay gathered
    # and its gradients whole. So do the gradients under --fsdp.skip_gradient_sync with accumulation.
    pipelined = fsdp and plan.pp > 1
    if sharding in ("FULL_SHARD", "HYBRID_SHARD") and not pipelined:
        params += 2 * block * compute  # the gathered block, and the next one prefetched
    elif sharding == "SHARD_GRAD_OP" or pipelined:
        params += gathered * compute  # gathered weights stay until backward (a pipeline's: until the step ends)
    elif sharding in (None, "NO_SHARD") and precision.is_mixed:
        params += local * compute  # autocast keeps low-precision weight copies for backward (one process, DDP)
    grad_bytes = 4 if sharding is not None and precision.is_mixed else stored  # FSDP reduces in fp32
    # --fsdp.skip_gradient_sync under accumulation, or a pipeline: FSDP adds up the micro-batches' gradients
    # unsharded (in the reduction dtype, on the device even under CPU offload) and reduce-scatters them after the last.
    unsharded = fsdp and (plan.grad_sync_only_last or pipelined)
    gradients = (gathered if unsharded and trainable == local else trainable) * grad_bytes / (1 if unsharded else shard)
    if sharding == "NO_SHARD":
        gradients *= 2  # DDP copies the gradients into its reduction buckets, which stay allocated between steps
    if fsdp and trainable == local:
        gradients += block * compute  # one block's unsharded gradients before the reduce-scatter
    optimizer = 2 * trainable * stored / shard  # AdamW's two moments, in the weights' dtype
    if plan.cpu_offload:
        params, optimizer = (gathered if pipelined else 2 * block) * compute, 0
        gradients = block * compute + ((gathered if trainable == local else trainable) * grad_bytes if unsharded else 0)
    return int(params), int(gradients), int(optimizer)


def zero_state_bytes(config: Config, plan: ParallelPlan, parameters: int, trainable: int) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes on one device under DeepSpeed ZeRO (``plan.zero``).

    DeepSpeed keeps the module in the compute dtype (bf16 or fp16 under mixed precision, else fp32) and, in its
    optimizer, an fp32 master copy of the trainable weights' partition (also in fp32 training: a clone), the
    gradient partition in fp32 and AdamW's two fp32 moments (stage 1 in bf16: the whole fp32 gradient). Over N
    ranks, stage 1 partitions the master copy, gradient partition and moments; stage 2 also the module's
    gradients; stage 3 also its parameters, gathering them a block or two at a time (prefetch). Offloading moves
    the optimizer (and its fp32 gradients), or the parameter partitions (stage 3), to host memory. Not counted:
    DeepSpeed's communication buckets (``reduce_bucket_size``, ``allgather_bucket_size`` and stage 3's prefetch
    and live-parameter limits in the config).
    """
    zero, shards = plan.zero, plan.data_parallel_size
    compute = dtype_bytes(plan.precision.compute_dtype)
    working = 2 * block_parameters_per_rank(config, plan.tp) * compute  # gathered: the block and the one prefetched
    if zero.stage < 3:
        params = parameters * compute
    else:
        params = working + (0 if zero.offload_parameters else parameters * compute / shards)
    if zero.stage == 1:
        # NOTE: bf16 gradients accumulate in fp32 (llmtrain_deepspeed.config), and stage 1 keeps them whole: in
        # DeepSpeed's BF16_Optimizer, one fp32 buffer the size of the trainable weights.
        gradients = trainable * (4 if plan.precision.name == "bf16-mixed" else compute)
    else:
        gradients = trainable * compute / shards + working
    optimizer = (4 + 4 + 8) * trainable / shards  # fp32 master, fp32 gradient partition, two fp32 moments
    if zero.offload_optimizer:
        optimizer = 0
    return int(params), int(gradients), int(optimizer)


def activation_bytes(config: Config, plan: ParallelPlan, pipeline_rank: int = 0, *, seq_len: int,
                     trains_head: bool = True) -> int:
    """Activation bytes at the peak of a step on one device of pipeline rank ``pipeline_rank``.

    Its blocks' kept activations for :func:`microbatches_in_flight` micro-batches; with activation checkpointing,
    one block's full set recomputed in backward. The last rank adds the loss: its hidden states' gradients, one
    chunk's logits, and (``trains_head``) the head's fp32 weight gradient, which the fused loss computes in the
    forward and keeps until the backward: one per micro-batch in flight on the last rank (all of them under GPipe).
    """
    from llmtrain.attention import saved_scores_per_query
    from llmtrain.model import attention_block, attention_dtype, attention_kernel

    compute_dtype = plan.precision.compute_dtype
    masked = config.sliding_window is not None and config.sliding_window < seq_len
    dtype = attention_dtype(plan.device_type, compute_dtype, seq_len, masked=masked)
    kernel = attention_kernel(plan.device_type, dtype, seq_len, config.n_head, config.n_query_groups, masked=masked)
    scores = saved_scores_per_query(seq_len, attention_block(seq_len)) if kernel == "blocks" else 0.0
    per_token = activation_bytes_per_token(config, compute_dtype, plan.activation_checkpointing, tp=plan.tp,
                                           sequence_parallel=plan.sequence_parallel, attention_dtype=dtype,
                                           attention_scores=scores, ep=plan.ep)
    tokens = plan.batch.micro_batch_size * seq_len
    layers = stage_layers(config, plan)[pipeline_rank]
    kept = tokens * layers * per_token["kept"] * microbatches_in_flight(plan, pipeline_rank)
    # a checkpointed block's recomputed set, and the all-to-all's buffers of one block (expert parallelism)
    recomputed = tokens * (per_token["recomputed"] + per_token["dispatch"])
    if pipeline_rank < plan.pp - 1:
        return int(kept + recomputed)
    heads_in_flight = plan.pp_microbatches if plan.pp_schedule == "gpipe" else 1
    chunk = min(tokens, head_chunk_tokens(config))  # the loss's logits exist one chunk at a time
    loss = heads_in_flight * tokens * per_token["head_hidden"] + chunk * per_token["logits"]
    head_gradient = 4 * config.padded_vocab_size * config.n_embd / plan.tp * heads_in_flight if trains_head else 0
    return int(kept + head_gradient + max(loss, recomputed))


def _adapters_only(config: Config, plan: ParallelPlan, trainable_parameters: Optional[int]) -> bool:
    """LoRA: fewer trainable parameters than the model has (never with tensor or pipeline parallelism)."""
    return (trainable_parameters is not None and trainable_parameters < num_parameters(config)
            and not plan.splits_model)


def estimate_memory(config: Config, plan: ParallelPlan, *, seq_len: int,
                    trainable_parameters: Optional[int] = None, quantize: Optional[str] = None) -> MemoryEstimate:
    """Peak bytes per device of one training step laid out as ``plan`` says: on the pipeline rank that needs the
    most (:func:`state_bytes` plus :func:`activation_bytes`; the only rank without a pipeline)."""
    estimates = []
    for rank in range(plan.pp):
        params, gradients, optimizer = state_bytes(config, plan, rank, trainable_parameters=trainable_parameters,
                                                   quantize=quantize)
        activations = activation_bytes(config, plan, rank, seq_len=seq_len,
                                       trains_head=not _adapters_only(config, plan, trainable_parameters))
        estimates.append(MemoryEstimate(params, gradients, optimizer, activations, pipeline_rank=rank))
    return max(estimates, key=lambda estimate: estimate.total)


def lora_trainable_parameters(config: Config, lora: Any) -> int:
    """Adapter parameters for these LoRA flags, counted on one- and two-block copies of the model built on the meta
    device (no memory): every block has the same adapters, and a model of a billion blocks is never built."""
    one, two = (_adapter_parameters(replace(config, n_layer=n_layer), lora) for n_layer in (1, 2))
    return one + (config.n_layer - 1) * (two - one)


def _adapter_parameters(config: Config, lora: Any) -> int:
    from llmtrain.lora import apply_lora, mark_only_lora_trainable
    from llmtrain.model import GPT

    with torch.device("meta"):
        model = GPT(config)
    apply_lora(model, lora)
    mark_only_lora_trainable(model)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
