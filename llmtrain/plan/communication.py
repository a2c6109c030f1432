"""What a tensor or pipeline split costs besides memory: the pipeline's bubble, and the bytes each rank puts
through collectives per step, by mesh dimension.

Arithmetic on a :class:`Config` and a :class:`ParallelPlan`, as :mod:`llmtrain.plan.memory`, whose count of a
rank's parameters and blocks it uses. The dry run prints these; ``--dry_run.simulate`` compares
:func:`communication_bytes_per_step` with the collectives the real code issues.
"""

from __future__ import annotations

from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.plan.memory import (dtype_bytes, expert_parameters_per_rank, final_norm_parameters, rank_parameters,
                                  stage_layers)


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
    activation = plan.batch.micro_batch_size * seq_len * config.n_embd * dtype_bytes(plan.precision.compute_dtype)
    return tensor_parallel_passes(plan, config.n_layer) * (tp - 1) / tp * activation


def tensor_parallel_bytes_per_step(config: Config, plan: ParallelPlan, seq_len: int) -> float:
    """Bytes a tensor-parallel rank of the busiest pipeline rank sends per optimizer step: every block it holds,
    for every micro-batch of the step (the accumulation steps, or the pipeline's micro-batches)."""
    layers = max(stage_layers(config, plan))
    return tensor_parallel_bytes_per_layer(config, plan, seq_len) * layers * plan.batch.grad_accum_steps


def tokens_routed_per_rank(plan: ParallelPlan, seq_len: int) -> int:
    """Tokens each rank routes per micro-batch: its micro-batch, or under sequence parallelism its ``1 / tp`` of it
    (the ranks of a tensor-parallel group route the same tokens otherwise)."""
    tokens = plan.batch.micro_batch_size * seq_len
    return tokens // plan.tp if plan.sequence_parallel else tokens


def all_to_all_passes(plan: ParallelPlan, n_layer: int) -> float:
    """All-to-alls of an MoE block per micro-batch, averaged over the blocks: the forward's dispatch and combine, the
    backward's two (their gradients, the other way), and the forward's two again in each block that checkpointing
    recomputes (``full``, every Nth under ``selective:N``; ``op`` keeps the collectives' outputs)."""
    from llmtrain.args import checkpointed_every

    mode = plan.activation_checkpointing
    if mode == "op":
        return 4
    every = checkpointed_every(mode)
    count = -(-n_layer // every) if every else 0
    return 4 + 2 * count / n_layer


def all_to_all_bytes_per_layer(config: Config, plan: ParallelPlan, seq_len: int) -> float:
    """Bytes of the all-to-alls' buffers on one expert-parallel rank for one MoE block and one micro-batch (0 without
    expert parallelism).

    Each rank sends its N·k rows (N tokens, :func:`tokens_routed_per_rank`; k experts each) of d elements to the ranks
    of their experts and receives as many back (balanced routing): dispatch and combine in the forward, their
    gradients in the backward, :func:`all_to_all_passes` buffers of N·k·d·a bytes. What leaves the rank is
    (ep - 1)/ep of each (the rows of its own experts stay); a rank whose experts are chosen more receives more.
    """
    if not config.is_moe or plan.ep == 1:
        return 0.0
    rows = tokens_routed_per_rank(plan, seq_len) * config.n_expert_per_token
    buffer = rows * config.n_embd * dtype_bytes(plan.precision.compute_dtype)
    return all_to_all_passes(plan, config.n_layer) * buffer


def all_to_all_bytes_per_step(config: Config, plan: ParallelPlan, seq_len: int) -> float:
    """:func:`all_to_all_bytes_per_layer` for every block of the busiest pipeline rank and every micro-batch of a
    step."""
    layers = max(stage_layers(config, plan))
    return all_to_all_bytes_per_layer(config, plan, seq_len) * layers * plan.batch.grad_accum_steps


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
    - expert parallelism (``ep``): the all-to-alls, :func:`all_to_all_bytes_per_step`. FSDP gathers and reduces a
      block's routed experts over ``dp_shard_mod_ep`` (the ``dp_shard / ep`` ranks that hold the same experts), each
      rank's ``n_expert / ep`` of them, and the rest of the model over ``dp_shard``; nothing over
      ``dp_shard_mod_ep`` when ``ep`` is the whole shard.
    - pipeline (``pp``): each micro-batch's activations sent forward and their gradients back, per stage boundary of
      this rank (one boundary for the first and the last rank, two between).
    - ``world``: the step's token count and host numbers, a few bytes.
    """
    if plan.wrapper in ("none", "deepspeed") and not plan.splits_model:
        return {}
    precision, m = plan.precision, plan.batch.grad_accum_steps
    local = rank_parameters(config, plan, pipeline_rank)
    gathered = dtype_bytes(precision.compute_dtype if precision.is_mixed else precision.param_dtype)
    reduced = 4 if precision.is_mixed and plan.wrapper == "fsdp" else dtype_bytes(precision.param_dtype)
    reductions = 1 if plan.grad_sync_only_last or plan.pp > 1 else m
    bytes_by_dim: dict[str, float] = {"world": 8.0 * 2}
    if plan.wrapper == "fsdp":
        dims = plan.mesh_shape()
        shard_dim = "dp_shard" if "dp_shard" in dims else "dp_replicate"
        head = _head_unit_parameters(config, plan, pipeline_rank) if pipeline_rank == plan.pp - 1 else 0

        def gathers(parameters: float, resharded: float) -> float:
            if plan.sharding_strategy == "SHARD_GRAD_OP" or plan.pp > 1:  # held through the step's micro-batches
                return parameters
            return m * (parameters + resharded) if plan.reshard_after_forward else m * parameters

        # the routed experts (expert parallelism): each rank's n_expert / ep of them over dp_shard / ep ranks
        experts = expert_parameters_per_rank(config, plan, pipeline_rank) if plan.ep > 1 else 0
        volume = {shard_dim: (local - experts, _dim_size(plan, shard_dim)),
                  "dp_shard_mod_ep": (experts / plan.ep, _dim_size(plan, shard_dim) // plan.ep)}
        for dim, (parameters, size) in volume.items():
            if size > 1 and parameters:  # FSDP over one rank (HYBRID_SHARD's shard 1, ep = dp_shard) moves nothing
                resharded = parameters - (head if dim == shard_dim else 0)
                bytes_by_dim[dim] = gathers(parameters, resharded) * gathered + reductions * parameters * reduced
        if plan.sharding_strategy == "HYBRID_SHARD" and plan.dp_replicate > 1:
            bytes_by_dim["dp_replicate"] = reductions * local * reduced / plan.dp_shard
    elif plan.wrapper == "ddp":
        bytes_by_dim["dp_replicate"] = reductions * local * reduced
    if plan.ep > 1:
        bytes_by_dim["ep"] = all_to_all_bytes_per_step(config, plan, seq_len)
    if plan.tp > 1:  # what crosses the link is (tp - 1)/tp of each buffer
        bytes_by_dim["tp"] = tensor_parallel_bytes_per_step(config, plan, seq_len) * plan.tp / (plan.tp - 1)
    if plan.pp > 1:
        boundaries = (pipeline_rank > 0) + (pipeline_rank < plan.pp - 1)
        activation = plan.batch.micro_batch_size * seq_len * config.n_embd * dtype_bytes(precision.compute_dtype)
        activation /= plan.tp if plan.sequence_parallel else 1
        bytes_by_dim["pp"] = 2 * boundaries * m * plan.pp_virtual_stages * activation
    return bytes_by_dim


def _dim_size(plan: ParallelPlan, dim: str) -> int:
    return plan.mesh_shape().get(dim, 1)


def _head_unit_parameters(config: Config, plan: ParallelPlan, pipeline_rank: int) -> int:
    """The parameters of the units FSDP never reshards after the forward on the last pipeline rank: [final norm, head]
    (with the embedding, when tied, in the root)."""
    head = config.padded_vocab_size * config.n_embd // plan.tp + final_norm_parameters(config)
    if config.tie_embeddings and pipeline_rank == 0:
        return head
    return head + (config.padded_vocab_size // plan.tp if config.lm_head_bias else 0)
