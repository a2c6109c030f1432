"""What a run will need before it runs: memory per device, checkpoint size, time; and ``--dry_run``.

Everything here is arithmetic on a :class:`Config` and the run's flags. Nothing builds a model,
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
- With activation checkpointing a block keeps only its input (d elements); one block's full set comes
  back at a time during backward, after the head's are freed.
- The loss (llmtrain.model.LinearCrossEntropy) computes its gradients in the forward, one chunk of
  tokens at a time: a chunk's fp32 logits (4 · V bytes per token, plus their copy in the compute dtype
  when that is narrower) exist only while it is processed; every token keeps its hidden state's
  gradient (d elements), and the head's weight gradient (V · d fp32) waits for the backward.

Tensor and pipeline parallelism (``--tp_size``, ``--pp_size``) change what one device holds: each quantity has
one function, which the estimate and the dry run both ask: :func:`rank_parameters` (the blocks of a pipeline rank,
split over tp), :func:`activation_bytes_per_token` (heads and MLP width split over tp, the norms too with sequence
parallelism), :func:`microbatches_in_flight` (per pipeline schedule), :func:`pipeline_bubble` and
:func:`tensor_parallel_bytes_per_layer`. The estimate reports the pipeline rank that needs the most.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch

from llmtrain.checkpoint.size import checkpoint_bytes, final_is_separate
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.flops import (flops_per_token, gpu_has_bf16, gpu_memory_bytes, link_bytes_per_s, lookup_peak_flops,
                            num_parameters)
from llmtrain.quantize import quantized_bytes_per_weight
from llmtrain.train.horizon import plan_horizon

GiB = 2**30


@dataclass
class DryRunArgs:
    """``--dry_run`` prints the plan (model, parallel layout, batches, memory, checkpoint size, time) and exits."""

    enabled: bool = False
    """Print the plan and exit without training (bare `--dry_run` sets this)."""
    tokens_per_sec: Optional[float] = None
    """Measured tokens/s per device for the time estimate (from an earlier run: the tokens_per_sec_per_device column of its metrics.csv)."""
    gpu: Optional[str] = None
    """Plan for this GPU (e.g. H100, A100): the layout on CUDA devices, and the time from its peak FLOP/s at
    `mfu` instead of a measured tokens/s."""
    mfu: Optional[float] = None
    """Model FLOPs utilization assumed with `gpu` (default 0.4)."""
    simulate: bool = False
    """Also run rank 0, a rank of the last node and the last pipeline stage's first rank through the real parallelize,
    training step and full-checkpoint gathering on this machine, each in a child process (torch's fake process group
    and fake tensors: nothing is allocated or computed), and print their measured peak memory and per-step
    communication beside the estimate."""

    DEFAULT_MFU = 0.4

    @property
    def requested(self) -> bool:
        """Any --dry_run.* flag starts the dry run: none of them means anything to a training run."""
        return (self.enabled or self.tokens_per_sec is not None or self.gpu is not None or self.mfu is not None
                or self.simulate)

    @property
    def device_type(self) -> Optional[str]:
        """The device the plan is for: cuda with --dry_run.gpu, else whatever --accelerator gives here."""
        return "cuda" if self.gpu is not None else None

    def __post_init__(self) -> None:
        if self.tokens_per_sec is not None and self.tokens_per_sec <= 0:
            raise ValueError(f"--dry_run.tokens_per_sec must be positive, got {self.tokens_per_sec}")
        if self.mfu is not None and not 0 < self.mfu <= 1:
            raise ValueError(f"--dry_run.mfu must be in (0, 1], got {self.mfu}")
        if self.mfu is not None and self.gpu is None:
            raise ValueError("--dry_run.mfu is the utilization assumed on --dry_run.gpu, and means nothing without it: "
                             "add --dry_run.gpu NAME, or give a measured --dry_run.tokens_per_sec")


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
        return " | ".join(f"{name} {_size(value)}" for name, value in parts)


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 10 else f"{nbytes / 2**20:.1f} MiB"


def _bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def activation_bytes_per_token(config: Config, compute_dtype: torch.dtype, checkpointing: Union[bool, str], *,
                               tp: int = 1, sequence_parallel: bool = False,
                               attention_dtype: Optional[torch.dtype] = None,
                               attention_scores: float = 0.0) -> dict[str, float]:
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

    ``attention_dtype`` (``llmtrain.model.attention_dtype``; default ``compute_dtype``): where attention computes
    in float32 although the model computes in bfloat16, the q, k, v and output it saves take 4 bytes an element
    (block attention does not keep its output); ``op`` recomputes the float32 copies of q, k, v and keeps only the
    output.

    ``attention_scores``: the probabilities attention keeps per query and head, in ``attention_dtype``, where it
    runs as block-causal matmuls (``llmtrain.attention.saved_scores_per_query``; 0 for SDPA, which keeps a
    log-sum-exp). ``op`` keeps the float32 scores those matmuls write, as many.
    """
    from llmtrain.args import canonical_checkpointing, checkpointed_every

    a = _bytes(compute_dtype)
    d, f = config.n_embd, config.intermediate_size
    q, kv = config.n_head * config.head_size, config.n_query_groups * config.head_size
    # NOTE: the norm's input in the compute dtype, as the other residual-stream terms here; under autocast without
    # FSDP's mixed precision (one device, DDP) the stream stays fp32, 2d bytes a token more per norm than counted.
    norm = d * a + (4 if config.norm_class_name == "RMSNorm" else 0)  # the input, and RMSNorm's fp32 scale per token
    norms = 1 if config.shared_attention_norm else 2
    gated = config.mlp_class_name in ("LLaMAMLP", "GemmaMLP")
    sequence_split = tp if sequence_parallel else 1
    replicated = norms * norm + d * a  # the norms, and the MLP's input
    upcast = _bytes(attention_dtype) - a if attention_dtype is not None else 0  # attention in float32 (above)
    scores = _bytes(attention_dtype or compute_dtype) * config.n_head * attention_scores  # block attention's (above)
    upcast_saved = (q + 2 * kv if attention_scores else 2 * q + 2 * kv) * upcast  # q, k, v (and SDPA's output)
    split = (2 * q + 4 * kv) * a + upcast_saved + scores + (4 if gated else 2) * f * a  # heads, MLP
    # the attention's and the MLP's gathered inputs, whole on every rank under sequence parallelism (above)
    gathered_inputs = (2 if sequence_parallel and tp > 1 else 0) * d * a * (1 - 1 / tp)
    layer = replicated / sequence_split + split / tp + gathered_inputs
    block_input = d * a / sequence_split
    mode = canonical_checkpointing(checkpointing)
    if mode == "op":
        # NOTE: attention's o and the MLP's down projection write a d-wide partial sum on every rank; under tensor
        # parallelism each then goes through a collective whose output is kept as well.
        attention_saved = 4 * config.n_head * (attention_scores or 1)  # the float32 scores, or SDPA's log-sum-exp
        matmuls = (((q + 2 * kv) * a + q * (a + upcast) + attention_saved + (2 if gated else 1) * f * a) / tp
                   + 2 * d * a)
        collectives = 2 * d * a / sequence_split if tp > 1 else 0
        checkpointed = block_input + matmuls + collectives
    else:
        checkpointed = block_input
    every = checkpointed_every(mode)
    count = -(-config.n_layer // every) if every else 0  # blocks 0, N, 2N, ... below n_layer
    kept = (count * checkpointed + (config.n_layer - count) * layer) / config.n_layer
    logits = (4 + (a if a < 4 else 0)) * config.padded_vocab_size / tp  # fp32, and their compute-dtype copy
    return {"layer": layer, "kept": kept, "stack": config.n_layer * kept,
            "recomputed": max(layer - checkpointed, 0.0) if count else 0.0,
            "head_hidden": norm / sequence_split + d * a, "logits": logits}


def tensor_parallel_passes(plan: ParallelPlan, n_layer: int) -> float:
    """Collectives of (tp - 1)/tp·B·T·C·bytes per block and micro-batch (:func:`tensor_parallel_bytes_per_layer`),
    averaged over the blocks: 8, plus the forward's 4 again in each block that checkpointing recomputes whole
    (``full``, every Nth under ``selective:N``); ``op`` keeps the collectives' outputs except sequence parallelism's
    2 all-gathers, which it runs again."""
    from llmtrain.args import checkpointed_every

    mode = plan.activation_checkpointing
    if mode == "op":
        return 10 if plan.sequence_parallel else 8
    every = checkpointed_every(mode)
    count = -(-n_layer // every) if every else 0
    return 8 + 4 * count / n_layer


def head_chunk_tokens(config: Config) -> int:
    """Tokens per loss chunk (llmtrain.loss.head_loss_sum): the logits of more never exist at once."""
    from llmtrain import loss

    return loss.head_chunk_tokens(config.padded_vocab_size)


def _block_parameters(config: Config) -> int:
    embeddings = config.padded_vocab_size * config.n_embd * (1 if config.tie_embeddings else 2)
    head_bias = config.padded_vocab_size if config.lm_head_bias else 0
    return (num_parameters(config) - embeddings - head_bias - _final_norm_parameters(config)) // config.n_layer


def _final_norm_parameters(config: Config) -> int:
    return 2 * config.n_embd if config.norm_class_name == "LayerNorm" else config.n_embd


def block_parameters_per_rank(config: Config, tp: int) -> int:
    """One block's parameters on a tensor-parallel rank: all but its norms are split over ``tp`` (the row-parallel
    biases, replicated in fact, are counted as split: d parameters)."""
    norms = (1 if config.shared_attention_norm else 2) * _final_norm_parameters(config)
    return (_block_parameters(config) - norms) // tp + norms


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
    head = embedding + head_bias + _final_norm_parameters(config)
    units = [block_parameters_per_rank(config, plan.tp), head] + ([] if config.tie_embeddings else [embedding])
    largest = max(units)
    precision = plan.precision
    gather = _bytes(precision.compute_dtype if precision.is_mixed else precision.param_dtype)
    reduce = 4 if precision.is_mixed else _bytes(precision.param_dtype)
    return shared_memory.pair_bytes(largest * gather) + shared_memory.pair_bytes(plan.dp_shard * largest * reduce)


# ---- tensor and pipeline parallelism: what one rank holds and sends ---------------------------------------------
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
        parameters += head // tp + _final_norm_parameters(config)
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


def pipeline_bubble(plan: ParallelPlan) -> float:
    """Fraction of a step a pipeline rank idles while the pipeline fills and drains.

    (pp - 1) / (m + pp - 1) for GPipe and 1F1B (m micro-batches per step); interleaving v stages per rank makes
    each fill step 1/v as long: (pp - 1) / (v·m + pp - 1) (Narayanan et al., 2021). 0 without a pipeline.
    """
    pp, m, v = plan.pp, plan.pp_microbatches, plan.pp_virtual_stages
    return (pp - 1) / (v * m + pp - 1)


def tensor_parallel_bytes_per_layer(config: Config, plan: ParallelPlan, seq_len: int) -> float:
    """Bytes each tensor-parallel rank sends for one block and one micro-batch, forward and backward.

    S = B·T·C·a is the activation between blocks (micro batch B, sequence T, width C, a bytes of the compute
    dtype). Over tp ranks a ring all-gather or reduce-scatter of S sends (tp - 1)/tp·S from each rank, an
    all-reduce twice that. With sequence parallelism a block all-gathers its input and reduce-scatters its output
    for attention and for the MLP, in the forward and again in the backward: 8 collectives. Without it the
    forward all-reduces the row-parallel outputs (attention's o, the MLP's down) and the backward the gradients of
    the column-parallel inputs: 4 all-reduces. Both send

        8·(tp - 1)/tp·B·T·C·a  bytes per rank, block and micro-batch,

    12·(tp - 1)/tp·B·T·C·a with activation checkpointing (the backward runs the forward again). The embedding's and
    the loss's collectives (about one block's) are not counted.
    """
    tp = plan.tp
    activation = plan.batch.micro_batch_size * seq_len * config.n_embd * _bytes(plan.precision.compute_dtype)
    return tensor_parallel_passes(plan, config.n_layer) * (tp - 1) / tp * activation


def tensor_parallel_bytes_per_step(config: Config, plan: ParallelPlan, seq_len: int) -> float:
    """Bytes a tensor-parallel rank of the busiest pipeline rank sends per optimizer step: every block it holds,
    for every micro-batch of the step (the accumulation steps, or the pipeline's micro-batches)."""
    layers = max(stage_layers(config, plan))
    return tensor_parallel_bytes_per_layer(config, plan, seq_len) * layers * plan.batch.grad_accum_steps


def communication_bytes_per_step(config: Config, plan: ParallelPlan, seq_len: int,
                                 pipeline_rank: int = 0) -> dict[str, float]:
    """Bytes one rank of pipeline rank ``pipeline_rank`` puts through collectives in one optimizer step, by mesh
    dimension: each collective counted by its whole buffer (an all-gather's gathered output, a reduce-scatter's input,
    an all-reduce's or a send's buffer); what crosses the link is (n - 1)/n of an all-gather's or reduce-scatter's.

    - FSDP (``dp_shard``): every unit's weights gathered for each micro-batch's forward (in the compute dtype under
      mixed precision), again for its backward where it was resharded after the forward (the embedding and the blocks
      under FULL_SHARD and HYBRID_SHARD); SHARD_GRAD_OP and a pipeline (whose schedule keeps the stages' weights
      gathered and their gradients unreduced until the last micro-batch) gather once per step. Gradients
      reduce-scattered (fp32 under mixed precision) once per step under --fsdp.skip_gradient_sync or a pipeline, else
      after every micro-batch.
    - HYBRID_SHARD (``dp_replicate``): each reduce-scatter's shard all-reduced across the replicas.
    - DDP (``dp_replicate``): the gradients all-reduced once per step or per micro-batch, as above.
    - tensor parallelism (``tp``): :func:`tensor_parallel_bytes_per_step`.
    - pipeline (``pp``): each micro-batch's activations sent forward and their gradients back, per stage boundary of
      this rank (one boundary for the first and the last rank, two between).
    - ``world``: the step's token count and host numbers, a few bytes.
    """
    if plan.wrapper in ("none", "deepspeed") and not plan.splits_model:
        return {}
    precision, m = plan.precision, plan.batch.grad_accum_steps
    local = rank_parameters(config, plan, pipeline_rank)
    gathered = _bytes(precision.compute_dtype if precision.is_mixed else precision.param_dtype)
    reduced = 4 if precision.is_mixed and plan.wrapper == "fsdp" else _bytes(precision.param_dtype)
    reductions = 1 if plan.grad_sync_only_last or plan.pp > 1 else m
    bytes_by_dim: dict[str, float] = {"world": 8.0 * 2}
    if plan.wrapper == "fsdp":
        dims = plan.mesh_shape()
        shard_dim = "dp_shard" if "dp_shard" in dims else "dp_replicate"
        resharded = local - (_head_unit_parameters(config, plan, pipeline_rank) if pipeline_rank == plan.pp - 1
                             else 0)
        if plan.sharding_strategy == "SHARD_GRAD_OP" or plan.pp > 1:  # held through the step's micro-batches
            gathers = local
        elif plan.reshard_after_forward:
            gathers = m * (local + resharded)
        else:
            gathers = m * local
        if _dim_size(plan, shard_dim) > 1:  # FSDP over one rank (HYBRID_SHARD's shard 1) moves nothing
            bytes_by_dim[shard_dim] = gathers * gathered + reductions * local * reduced
        if plan.sharding_strategy == "HYBRID_SHARD" and plan.dp_replicate > 1:
            bytes_by_dim["dp_replicate"] = reductions * local * reduced / plan.dp_shard
    elif plan.wrapper == "ddp":
        bytes_by_dim["dp_replicate"] = reductions * local * reduced
    if plan.tp > 1:  # what crosses the link is (tp - 1)/tp of each buffer
        bytes_by_dim["tp"] = tensor_parallel_bytes_per_step(config, plan, seq_len) * plan.tp / (plan.tp - 1)
    if plan.pp > 1:
        boundaries = (pipeline_rank > 0) + (pipeline_rank < plan.pp - 1)
        activation = plan.batch.micro_batch_size * seq_len * config.n_embd * _bytes(precision.compute_dtype)
        activation /= plan.tp if plan.sequence_parallel else 1
        bytes_by_dim["pp"] = 2 * boundaries * m * plan.pp_virtual_stages * activation
    return bytes_by_dim


def _dim_size(plan: ParallelPlan, dim: str) -> int:
    return plan.mesh_shape().get(dim, 1)


def _head_unit_parameters(config: Config, plan: ParallelPlan, pipeline_rank: int) -> int:
    """The parameters of the units FSDP never reshards after the forward on the last pipeline rank: [final norm, head]
    (with the embedding, when tied, in the root)."""
    head = config.padded_vocab_size * config.n_embd // plan.tp + _final_norm_parameters(config)
    if config.tie_embeddings and pipeline_rank == 0:
        return head
    return head + (config.padded_vocab_size // plan.tp if config.lm_head_bias else 0)


# ---- the estimate ------------------------------------------------------------------------------------------------
def state_bytes(config: Config, plan: ParallelPlan, pipeline_rank: int = 0, *,
                trainable_parameters: Optional[int] = None, quantize: Optional[str] = None) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes on one device of pipeline rank ``pipeline_rank``.

    Tensor and pipeline parallelism leave a rank :func:`rank_parameters`; the plan's sharding strategy (None
    without a wrapper) and shard size divide those; its CPU offload counts only when FSDP applies it.
    ``trainable_parameters`` below the total means LoRA: only the adapters have gradients and optimizer state.
    ``quantize`` stores the frozen linear weights in 4 bits (bnb.nf4, bnb.fp4) or 8 (bnb.int8). LoRA and
    quantization never run with tensor or pipeline parallelism (the recipes refuse it).
    """
    precision = plan.precision
    sharding = plan.sharding_strategy if plan.wrapper != "none" else None
    local = rank_parameters(config, plan, pipeline_rank)
    trainable = trainable_parameters if _adapters_only(config, plan, trainable_parameters) else local
    if plan.zero is not None:
        return zero_state_bytes(config, plan, local, trainable)
    stored, compute = _bytes(precision.param_dtype), _bytes(precision.compute_dtype)
    shard = plan.shard_size if sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD") else 1
    block = block_parameters_per_rank(config, plan.tp)

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
        params += local * compute  # gathered weights stay until backward (a pipeline's: until the step ends)
    elif sharding in (None, "NO_SHARD") and precision.is_mixed:
        params += local * compute  # autocast keeps low-precision weight copies for backward (one process, DDP)
    grad_bytes = 4 if sharding is not None and precision.is_mixed else stored  # FSDP reduces in fp32
    # --fsdp.skip_gradient_sync under accumulation, or a pipeline: FSDP adds up the micro-batches' gradients
    # unsharded (in the reduction dtype, on the device even under CPU offload) and reduce-scatters them after the last.
    unsharded = fsdp and (plan.grad_sync_only_last or pipelined)
    gradients = trainable * grad_bytes / (1 if unsharded else shard)
    if sharding == "NO_SHARD":
        gradients *= 2  # DDP copies the gradients into its reduction buckets, which stay allocated between steps
    if fsdp and trainable == local:
        gradients += block * compute  # one block's unsharded gradients before the reduce-scatter
    optimizer = 2 * trainable * stored / shard  # AdamW's two moments, in the weights' dtype
    if plan.cpu_offload:
        params, optimizer = (local if pipelined else 2 * block) * compute, 0
        gradients = block * compute + (trainable * grad_bytes if unsharded else 0)
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
    compute = _bytes(plan.precision.compute_dtype)
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
                                           attention_scores=scores)
    tokens = plan.batch.micro_batch_size * seq_len
    layers = stage_layers(config, plan)[pipeline_rank]
    kept = tokens * layers * per_token["kept"] * microbatches_in_flight(plan, pipeline_rank)
    recomputed = tokens * per_token["recomputed"]
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


# ---- will it fit, and what would ----------------------------------------------------------------------------------
USABLE_MEMORY_FRACTION = 0.9
"""Share of a GPU's memory a plan may fill: the CUDA context, NCCL's buffers and the allocator's fragmentation take
the rest. An assumed margin, not a measured one: check a plan close to it with a few steps before a long job."""


@dataclass(frozen=True)
class Suggestion:
    """A layout that fits: the flags to add, its plan and its memory per device."""

    flags: str
    plan: ParallelPlan
    memory: MemoryEstimate


def gpu_name(dry: DryRunArgs, plan: ParallelPlan) -> Optional[str]:
    """The GPU the plan is for: --dry_run.gpu, else this machine's first GPU; None for a plan on CPU."""
    if dry.gpu is not None:
        return dry.gpu
    return torch.cuda.get_device_name(0) if plan.device_type == "cuda" and torch.cuda.is_available() else None


def device_memory_bytes(dry: DryRunArgs, plan: ParallelPlan) -> Optional[int]:
    """Memory of the GPU the plan is for (:func:`gpu_name`); None on CPU or for a GPU of unknown size."""
    name = gpu_name(dry, plan)
    if name is None:
        return None
    return gpu_memory_bytes(name) if dry.gpu is not None else torch.cuda.get_device_properties(0).total_memory


def check_state_fits(config: Config, plan: ParallelPlan, dry: DryRunArgs, *, source: str,
                     trainable_parameters: Optional[int] = None, quantize: Optional[str] = None) -> None:
    """Refuse a model whose weights, gradients and optimizer state on one device (the pipeline rank that holds
    the most, after this plan's sharding) and RoPE tables exceed that device, before any rank builds it.

    A GPU's whole memory counts (the launcher holds no CUDA context to ask for its free memory); on the CPU, the
    host's available memory is shared by the plan's processes on this node. Activations are left out: the check
    refuses what cannot fit at all; the dry run says what fits comfortably.
    """
    from llmtrain.memory import CONFIG_FIX, check_fits, host_available_bytes, rope_cache_bytes

    state = max(sum(state_bytes(config, plan, rank, trainable_parameters=trainable_parameters, quantize=quantize))
                for rank in range(plan.pp))
    capacity = device_memory_bytes(dry, plan)
    where = f"one {gpu_name(dry, plan)}"
    if capacity is None:
        capacity = host_available_bytes() // plan.devices
        where = "this machine's memory" + (f", shared by {plan.devices} ranks" if plan.devices > 1 else "")
    check_fits(config, needed=state + rope_cache_bytes(config), available=capacity, where=where, source=source,
               fix=f"{CONFIG_FIX}, or shard it over more devices (--devices, --num_nodes, --strategy fsdp; --dry_run "
                   "says what fits)")


def fits(memory: MemoryEstimate, capacity: int) -> bool:
    return memory.total <= USABLE_MEMORY_FRACTION * capacity


def model_splits(devices: int, world: int) -> list[tuple[int, int]]:
    """(tp, pp) pairs to try, the smallest split first and, among equal ones, tensor parallelism before pipeline:
    tp divides a node's devices (at most 8: its collectives need one node's links), pp divides the ranks left."""
    tps = [tp for tp in range(1, min(devices, 8) + 1) if devices % tp == 0]
    pairs = [(tp, pp) for tp in tps for pp in range(1, world // tp + 1) if (world // tp) % pp == 0]
    return sorted(pairs, key=lambda pair: (pair[0] * pair[1], pair[1]))


SYNC_EVERY_MICRO_BATCH = "--fsdp.skip_gradient_sync false"
"""The remedy for gradients kept whole through accumulation: reduce-scatter them after every micro-batch."""


def suggest_layout(config: Config, plan: ParallelPlan, *, seq_len: int, train: Any, fsdp: Any,
                   capacity: int) -> tuple[str, Optional[Suggestion]]:
    """A layout that fits ``capacity`` bytes (a DDP run's with FSDP in DDP's place, named in the flags): first,
    where the run keeps its gradients whole through accumulation, the same layout with them reduce-scattered
    after every micro-batch; then the first layout of :func:`model_splits` that fits with the run's other flags.

    If none does, the flags that lower memory are added one after another (those gradients, activation
    checkpointing, micro batch 1, FULL_SHARD instead of HYBRID_SHARD, twice the nodes, CPU offload) until one does.
    Returns (the flags added before the split, empty if none were needed; the suggestion, None if nothing fits
    even then).
    """
    remedies = [("", train, fsdp, plan.num_nodes)]
    if plan.wrapper == "ddp":
        # NOTE: DDP keeps every state whole on every rank and splits nothing; the splits put FSDP in its place
        # (_resolve_split), which the suggestion must then name.
        sharding = "HYBRID_SHARD" if plan.num_nodes > 1 else "FULL_SHARD"
        fsdp = replace(fsdp, sharding_strategy=sharding)
        remedies = [(f"--strategy fsdp --fsdp.sharding_strategy {sharding}", train, fsdp, plan.num_nodes)]
    own_skip_sync = fsdp.skip_gradient_sync  # what a pipeline split keeps (see the NOTE below)
    if plan.grad_sync_only_last and plan.wrapper == "fsdp":
        # The accumulated gradients are whole on every rank; sharding them after each micro-batch costs only
        # communication, which overlaps the backward: tried first, before any split. (DDP's are whole either way.)
        fsdp = replace(fsdp, skip_gradient_sync=False)
        flag = SYNC_EVERY_MICRO_BATCH
        candidate = _resolve_split(config, plan, seq_len=seq_len, train=train, fsdp=fsdp, num_nodes=plan.num_nodes,
                                   tp=1, pp=1)
        memory = estimate_memory(config, candidate, seq_len=seq_len) if candidate is not None else None
        if memory is not None and fits(memory, capacity):
            return "", Suggestion(flag, candidate, memory)
        remedies.append((flag, train, fsdp, plan.num_nodes))
    if not fsdp.activation_checkpointing:
        fsdp = replace(fsdp, activation_checkpointing=True)
        remedies.append(("--fsdp.activation_checkpointing true", train, fsdp, plan.num_nodes))
    if plan.batch.micro_batch_size > 1:
        train = replace(train, micro_batch_size=1)
        remedies.append(("--train.micro_batch_size 1", train, fsdp, plan.num_nodes))
    if plan.sharding_strategy == "HYBRID_SHARD":
        fsdp = replace(fsdp, sharding_strategy="FULL_SHARD")
        remedies.append(("--fsdp.sharding_strategy FULL_SHARD", train, fsdp, plan.num_nodes))
    remedies.append((f"--num_nodes {2 * plan.num_nodes}", train, fsdp, 2 * plan.num_nodes))
    remedies.append(("--fsdp.cpu_offload true", train, replace(fsdp, cpu_offload=True), 2 * plan.num_nodes))
    added = []
    for flag, train, fsdp, num_nodes in remedies:
        added += [flag] if flag else []
        for tp, pp in model_splits(plan.devices, plan.devices * num_nodes):
            # NOTE: --pp_size refuses --fsdp.skip_gradient_sync false (its schedule reduces once per step anyway), so a
            # pipeline split is tried, and suggested, without that remedy.
            flags = [remedy for remedy in added if remedy != SYNC_EVERY_MICRO_BATCH] if pp > 1 else added
            candidate = _resolve_split(config, plan, seq_len=seq_len, train=train, num_nodes=num_nodes, tp=tp, pp=pp,
                                       fsdp=replace(fsdp, skip_gradient_sync=own_skip_sync) if pp > 1 else fsdp)
            if candidate is None:
                continue
            memory = estimate_memory(config, candidate, seq_len=seq_len)
            if fits(memory, capacity):
                split = " ".join(f"--{name} {size}" for name, size in (("tp_size", tp), ("pp_size", pp)) if size > 1)
                return " ".join(flags), Suggestion(split, candidate, memory)
    return " ".join(added), None


def _resolve_split(config: Config, plan: ParallelPlan, *, seq_len: int, train: Any, fsdp: Any, num_nodes: int,
                   tp: int, pp: int) -> Optional[ParallelPlan]:
    """The plan with these flags and this split, or None where they do not go together (the model does not divide,
    the batch gives the pipeline too few micro-batches, DDP)."""
    if fsdp.sharding_strategy == "NO_SHARD":
        fsdp = replace(fsdp, sharding_strategy=None)  # DDP does not compose with a split; FSDP is the alternative
    try:
        candidate = ParallelPlan.resolve(devices=plan.devices, num_nodes=num_nodes, train=train, fsdp=fsdp,
                                         precision=plan.precision, device_type=plan.device_type, tp=tp, pp=pp,
                                         strict_batch=False)
        candidate.check_model(config, seq_len)
    except ValueError:
        return None
    return candidate if candidate.batch_problem is None else None


def _shards(step_bytes: int, plan: ParallelPlan, state_dict_type: str, lora: bool) -> str:
    """How a step checkpoint is written: one file from rank 0, or one shard per rank of a shard group (DCP writes
    a replicated shard once, so HYBRID_SHARD's replicas add nothing on disk)."""
    shard_size = plan.shard_size
    if plan.zero is not None:
        return f" (DeepSpeed's files: one optimizer partition per rank, {shard_size} of about " \
               f"{_size(step_bytes // shard_size)})"
    if lora:
        return " (one file, rank 0)"
    if state_dict_type == "sharded" and (plan.wrapper != "fsdp" or shard_size == 1):
        return " (sharded: one DCP shard)"  # the format asked for, on one rank
    if plan.wrapper != "fsdp" or shard_size == 1:
        return " (one file, rank 0)"
    if state_dict_type == "sharded":
        return f" (sharded: {shard_size} shards of {_size(step_bytes // shard_size)})"
    return f" (one file gathered on rank 0; --fsdp.state_dict_type sharded: {shard_size} shards of " \
           f"{_size(step_bytes // shard_size)})"


def dry_run(*, recipe: str, config: Config, plan: ParallelPlan, train: Any, seq_len: int, dry: DryRunArgs,
            fsdp: Any, out_dir: Path, trainable_parameters: Optional[int] = None,
            quantize: Optional[str] = None, compile: Union[bool, str] = False) -> None:
    """Print the plan of a run with these flags, for the devices it names (not the ones this machine has).

    ``plan`` was resolved with ``strict_batch=False``: a batch that does not divide is printed as a problem
    and then raised, so the rest of the plan still shows how to choose it.
    """
    import shutil

    world = plan.world_size
    tokens_per_step = plan.batch.global_batch_size * seq_len
    total = num_parameters(config)
    trainable = total if trainable_parameters is None else trainable_parameters
    memory = estimate_memory(config, plan, seq_len=seq_len, trainable_parameters=trainable_parameters,
                             quantize=quantize)
    sizes = checkpoint_bytes(config, plan.precision, trainable_parameters,
                             separate_final=final_is_separate(fsdp.state_dict_type, plan))
    steps = _planned_steps(train, tokens_per_step)
    if plan.wrapper == "none":
        layout = "one process"
    elif plan.zero is not None:
        layout = f"DeepSpeed {plan.zero.describe()} over {plan.data_parallel_size} ranks"
    elif plan.sharding_strategy == "HYBRID_SHARD":
        layout = f"HYBRID_SHARD: replicate {plan.dp_replicate} × shard {plan.dp_shard}"
    elif plan.sharding_strategy == "NO_SHARD":
        layout = f"NO_SHARD (DDP): replicate {world}"
    else:
        layout = f"{plan.sharding_strategy}: shard {plan.dp_shard}"
    if plan.splits_model:
        layout = f"{layout if plan.wrapper != 'none' else 'no data-parallel wrapper'}; {_describe_split(plan)}"
    batch = plan.batch
    precision = plan.precision
    lines = [
        f"dry run of `llmtrain {recipe}` (nothing is built or trained)",
        f"model        {config.name or 'custom'}: {total / 1e6:,.1f}M parameters, {trainable / 1e6:,.1f}M trainable"
        f"{f', base quantized {quantize}' if quantize else ''}",
        f"layout       {plan.devices} devices × {plan.num_nodes} nodes = {world} ranks on {plan.device_type}; {layout}"
        f"{f'; activation checkpointing {plan.activation_checkpointing}' if plan.activation_checkpointing else ''}"
        f"{'; CPU offload' if plan.cpu_offload else ''}",
        f"precision    {precision.name} (weights {precision.param_dtype}, compute {precision.compute_dtype})"
        f"{f'; auto: {precision.chosen_because}' if precision.chosen_because else ''}",
        f"batch        micro {batch.micro_batch_size} × {plan.data_parallel_size} ranks × {batch.grad_accum_steps} "
        f"accumulation steps = global {batch.global_batch_size} sequences of {seq_len} tokens"
        f"{f' ({batch.note})' if batch.note else ''}"
        if plan.batch_problem is None else
        f"batch        PROBLEM: global {batch.global_batch_size} is no multiple of micro {batch.micro_batch_size} × "
        f"{plan.data_parallel_size} ranks (see the end)",
        f"tokens/step  {tokens_per_step:,}",
        f"length       {_describe_length(steps, tokens_per_step, train)}",
        f"memory       per device (estimate{_describe_rank(config, plan, memory)}): {memory.describe()}",
        f"checkpoint   weights {_size(sizes['weights'])}; each resumable step checkpoint {_size(sizes['step'])}"
        f"{_shards(sizes['step'], plan, fsdp.state_dict_type, trainable < total)}",
    ]
    shared = host_collective_bytes(config, plan)
    if shared:
        lines.append(f"shared mem   {_size(shared)} of /dev/shm for FSDP's collectives between the {plan.dp_shard} "
                     "processes of this host (two slots each of the largest unit's weights and of its gradients "
                     "from every process); with less room free they go through gloo, slower")
        room = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
        if room < shared:
            lines.append(f"warning      /dev/shm has {_size(room)} free here, under the {_size(shared)} above: FSDP's "
                         "collectives would go through gloo (mount a larger /dev/shm, e.g. docker --shm-size)")
    lines += _describe_split_costs(config, plan, seq_len, dry)
    if plan.zero is not None:
        lines += _describe_zero_stages(config, plan, seq_len=seq_len, trainable_parameters=trainable_parameters)
    capacity = device_memory_bytes(dry, plan)
    if capacity is not None:
        lines += _describe_fit(config, plan, memory, seq_len=seq_len, train=train, fsdp=fsdp, capacity=capacity,
                               gpu=gpu_name(dry, plan), splittable=trainable == total and quantize is None)
    free = shutil.disk_usage(_existing_parent(out_dir)).free
    if free < sizes["needed"]:
        lines.append(f"warning      --out_dir {out_dir} has {_size(free)} free here: too little for one checkpoint")
    lines.append(_describe_time(config, plan, dry, seq_len, tokens_per_step, steps))
    lines.append(_describe_compile(compile, recipe=recipe, config=config, plan=plan, seq_len=seq_len, steps=steps,
                                   train=train, dry=dry, quantize=quantize))
    print("\n".join(lines))
    if plan.batch_problem is not None:
        raise ValueError(f"this plan would not start: {plan.batch_problem}")


def _describe_time(config: Config, plan: ParallelPlan, dry: DryRunArgs, seq_len: int, tokens_per_step: int,
                   steps: Optional[int]) -> str:
    per_device, source = dry.tokens_per_sec, "--dry_run.tokens_per_sec"
    mfu = dry.mfu if dry.mfu is not None else DryRunArgs.DEFAULT_MFU
    if per_device is None and dry.gpu is not None:
        peak = lookup_peak_flops(dry.gpu, plan.precision.compute_dtype)
        if peak is None and plan.precision.compute_dtype == torch.bfloat16 and gpu_has_bf16(dry.gpu) is False:
            raise ValueError(f"--dry_run.gpu {dry.gpu!r} has no bfloat16 units, so --precision {plan.precision.name} "
                             "would run emulated there, far slower: pass --precision 16-mixed or 32-true")
        if peak is None:
            raise ValueError(f"--dry_run.gpu {dry.gpu!r}: its peak FLOP/s is unknown; pass --dry_run.tokens_per_sec")
        per_device = mfu * peak / flops_per_token(config, seq_len)
        source = f"{dry.gpu} at {mfu:.0%} MFU"
    if per_device is None:
        return "time         pass --dry_run.tokens_per_sec N or --dry_run.gpu NAME for an estimate"
    bubble = pipeline_bubble(plan)
    step_s = tokens_per_step / (per_device * plan.world_size) / (1 - bubble)
    total_s = f", {_duration(step_s * steps)} for {steps:,} steps" if steps else ""
    idle = f" with the pipeline bubble ({bubble:.1%} idle)" if bubble else ""
    return f"time         {per_device:,.0f} tokens/s per device ({source}): {step_s:.2f} s per step{idle}{total_s}"


def _describe_compile(setting: Union[bool, str], *, recipe: str, config: Config, plan: ParallelPlan, seq_len: int,
                      steps: Optional[int], train: Any, dry: DryRunArgs, quantize: Optional[str]) -> str:
    """What --compile does in this run: ``auto``'s decision with the peak of the planned device (--dry_run.gpu's
    datasheet rate, this machine's GPU, or a CPU's rate measured here), or why it is decided only at start."""
    import torch

    from llmtrain.recipes.compiling import choose

    if setting != "auto":
        return f"compile      {'each Block' if setting else 'no'} (--compile {str(setting).lower()})"
    dtype = plan.precision.compute_dtype
    peak = None  # a CPU plan: measured here, and only where the run is not short at any CPU's rate
    if dry.gpu is not None:
        rate = lookup_peak_flops(dry.gpu, dtype)
        peak = lambda device, dtype: rate  # noqa: E731
    elif plan.device_type == "cuda":
        rate = (lookup_peak_flops(torch.cuda.get_device_name(), dtype) if torch.cuda.is_available() else None)
        peak = lambda device, dtype: rate  # noqa: E731
    if steps is None or (peak is not None and rate is None):
        why = "the step count" if steps is None else "the device's peak (--dry_run.gpu NAME gives it)"
        return f"compile      --compile auto: decided at start, once it knows {why}"
    choice = choose("auto", recipe=recipe, config=config, plan=plan, seq_len=seq_len, total_steps=steps,
                    max_time=train.max_time, device=torch.device(plan.device_type), quantize=quantize,
                    peak=peak, check_compiler=False)
    return f"compile      {choice.reason}"


def _plural(count: float, noun: str) -> str:
    return f"{count:g} {noun}{'es' if noun.endswith('h') else 's'}" if count != 1 else f"1 {noun}"


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _describe_split(plan: ParallelPlan) -> str:
    """ "tensor 2 (sequence parallel) × pipeline 2 (1f1b)" """
    parts = []
    if plan.tp > 1:
        parts.append(f"tensor {plan.tp}{' (sequence parallel)' if plan.sequence_parallel else ''}")
    if plan.pp > 1:
        virtual = f", {plan.pp_virtual_stages} stages per rank" if plan.pp_virtual_stages > 1 else ""
        parts.append(f"pipeline {plan.pp} ({plan.pp_schedule}{virtual})")
    return " × ".join(parts)


def _describe_rank(config: Config, plan: ParallelPlan, memory: MemoryEstimate) -> str:
    """ ", pipeline rank 0 of 2: 16 blocks + embedding, 2 micro-batches in flight" (empty without a pipeline)."""
    if plan.pp == 1:
        return ""
    rank = memory.pipeline_rank
    ends = (" + embedding" if rank == 0 else "") + (" + head" if rank == plan.pp - 1 else "")
    return (f", the largest pipeline rank: {rank} of {plan.pp}, {stage_layers(config, plan)[rank]} blocks{ends}, "
            f"{_plural(microbatches_in_flight(plan, rank), 'micro-batch')} in flight")


def _describe_split_costs(config: Config, plan: ParallelPlan, seq_len: int, dry: DryRunArgs) -> list[str]:
    """The pipeline's bubble and tensor parallelism's traffic (no lines without them)."""
    lines = []
    if plan.pp > 1:
        m, v = plan.pp_microbatches, plan.pp_virtual_stages
        formula = "(pp - 1)/(v·m + pp - 1)" if v > 1 else "(pp - 1)/(m + pp - 1)"
        lines.append(f"pipeline     {plan.pp_schedule} over {plan.pp} ranks{f' × {v} stages each' if v > 1 else ''}, "
                     f"m = {m} micro-batches per step: bubble {formula} = {plan.pp - 1}/{v * m + plan.pp - 1} = "
                     f"{pipeline_bubble(plan):.1%} of each step idle")
    if plan.tp > 1:
        per_layer = tensor_parallel_bytes_per_layer(config, plan, seq_len)
        per_step = tensor_parallel_bytes_per_step(config, plan, seq_len)
        gpu = gpu_name(dry, plan)
        link, known = link_bytes_per_s(gpu)
        where = (f"{gpu} NVLink, one way" if known else
                 "assumed: PCIe 4.0 x16 one way; --dry_run.gpu names a GPU with NVLink")
        passes = f"{tensor_parallel_passes(plan, config.n_layer):g}"
        lines.append(f"tensor       each of {plan.tp} ranks sends {passes}·(tp - 1)/tp·B·T·C·bytes = {_size(per_layer)} per "
                     f"block and micro-batch, {_size(per_step)} per step ({max(stage_layers(config, plan))} blocks × "
                     f"{_plural(plan.batch.grad_accum_steps, 'micro-batch')}): {_seconds(per_step / link)} per step at "
                     f"{link / 1e9:.0f} GB/s ({where})")
    return lines


def _describe_zero_stages(config: Config, plan: ParallelPlan, *, seq_len: int,
                          trainable_parameters: Optional[int]) -> list[str]:
    """Memory per device under each DeepSpeed strategy, for the same run: what another stage would save (on a CPU
    run, which refuses offloading, the stages without it)."""
    from llmtrain.distributed.parallel_plan import DEEPSPEED_STRATEGIES

    lines = []
    for name, zero in DEEPSPEED_STRATEGIES.items():
        if plan.device_type == "cpu" and zero.offload_optimizer:
            continue
        memory = estimate_memory(config, replace(plan, zero=zero), seq_len=seq_len,
                                 trainable_parameters=trainable_parameters)
        mark = " (this run)" if zero == plan.zero else ""
        lines.append(f"{'zero stages' if not lines else '':13}--strategy {name:26} {_size(memory.total):>10} per device "
                     f"(parameters {_size(memory.parameters)}, gradients {_size(memory.gradients)}, optimizer "
                     f"{_size(memory.optimizer)}){mark}")
    return lines


def _describe_fit(config: Config, plan: ParallelPlan, memory: MemoryEstimate, *, seq_len: int, train: Any, fsdp: Any,
                  capacity: int, gpu: str, splittable: bool) -> list[str]:
    """Whether the estimate fits the GPU; if not, a layout that does (:func:`suggest_layout`), unless the recipe
    cannot split the model (LoRA and QLoRA train with data parallelism only)."""
    usable = USABLE_MEMORY_FRACTION * capacity
    of = f"{_size(usable)} usable of the {gpu}'s {_size(capacity)} ({USABLE_MEMORY_FRACTION:.0%})"
    if fits(memory, capacity):
        return [f"fits         yes: {_size(memory.total)} per device, {memory.total / usable:.0%} of the {of}"]
    lines = [f"fits         no: {_size(memory.total)} per device, more than the {of}"]
    if not splittable:
        return lines + ["suggest      LoRA and QLoRA do not split the model: see tutorials/out_of_memory.md"]
    if plan.zero is not None:
        return lines + ["suggest      a higher ZeRO stage or an *_offload strategy (the zero stages above), "
                        "--fsdp.activation_checkpointing true, or a smaller --train.micro_batch_size; tensor and "
                        "pipeline parallelism need --strategy fsdp"]
    added, suggestion = suggest_layout(config, plan, seq_len=seq_len, train=train, fsdp=fsdp, capacity=capacity)
    if suggestion is None:
        lines.append(f"suggest      nothing fits on {plan.num_nodes} × {plan.devices} {gpu}, not even with {added} and "
                     "any --tp_size × --pp_size: use GPUs with more memory, or more nodes")
        return lines
    flags = " ".join(part for part in (added, suggestion.flags) if part)
    chosen = suggestion.plan
    costs = [f"mesh {chosen.describe_mesh()}"] if chosen.describe_mesh() else []
    if chosen.pp > 1:
        costs.append(f"{chosen.pp_schedule} bubble {pipeline_bubble(chosen):.1%}")
    before = "" if not added else f"no --tp_size × --pp_size fits with these flags; with "
    lines.append(f"suggest      {before}{flags}: {_size(suggestion.memory.total)} per device ({'; '.join(costs)})")
    lines.append(f"             {suggestion.memory.describe()}")
    return lines


def _planned_steps(train: Any, tokens_per_step: int) -> Optional[int]:
    """The run's step count, from the run's own function; None where it needs the data's size (epochs)."""
    try:
        return plan_horizon(train, tokens_per_step, samples_per_epoch=None).total_steps
    except ValueError:
        return None


def _describe_length(steps: Optional[int], tokens_per_step: int, train: Any) -> str:
    if steps is None:
        return "set by --train.epochs or --train.max_time; the step count is known once the data is tokenized"
    return f"{steps:,} steps = {steps * tokens_per_step:,} tokens"


def _duration(seconds: float) -> str:
    hours = seconds / 3600
    return f"{hours / 24:.1f} days" if hours >= 48 else f"{hours:.1f} h" if hours >= 1 else f"{seconds / 60:.0f} min"


def _existing_parent(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path
