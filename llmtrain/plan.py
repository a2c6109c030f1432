"""What a run will need before it runs: memory per device, checkpoint size, time; and ``--dry_run``.

Everything here is arithmetic on a :class:`Config` and the run's flags. Nothing builds a model,
spawns a process or touches the data, so a plan for 8 GPUs × 4 nodes prints on a laptop.

Activation memory counts what autograd keeps for the backward pass, per token and layer, for the
layers llmtrain's model uses (measured with saved-tensor hooks on the real blocks, see
tests/test_plan.py, which also checks the total against a measured peak):

- RMSNorm keeps its input and the normalised tensor in fp32 (2 · d · 4 bytes); LayerNorm keeps its input.
- Attention keeps 2 · q + 4 · kv elements (q = n_head · head_size, kv = n_query_groups · head_size):
  projections, RoPE inputs and the SDPA inputs and output. SDPA's flash kernels keep no T × T matrix.
- A gated MLP (SwiGLU, GeGLU) keeps 4 · f + d elements; a plain GELU MLP 2 · f + d.
- With activation checkpointing a block keeps only its input (d elements); one block's full set comes
  back at a time during backward, after the head's are freed.
- The loss (llmtrain.model.LinearCrossEntropy) computes its gradients in the forward, one chunk of
  tokens at a time: a chunk's fp32 logits (4 · V bytes per token, plus their copy in the compute dtype
  when that is narrower) exist only while it is processed; every token keeps its hidden state's
  gradient (d elements), and the head's weight gradient (V · d fp32) waits for the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from llmtrain.checkpoint.size import checkpoint_bytes
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.flops import flops_per_token, lookup_peak_flops, num_parameters
from llmtrain.train.loop import plan_horizon

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

    DEFAULT_MFU = 0.4

    @property
    def requested(self) -> bool:
        """Any --dry_run.* flag starts the dry run: none of them means anything to a training run."""
        return self.enabled or self.tokens_per_sec is not None or self.gpu is not None or self.mfu is not None

    @property
    def device_type(self) -> Optional[str]:
        """The device the plan is for: cuda with --dry_run.gpu, else whatever --accelerator gives here."""
        return "cuda" if self.gpu is not None else None

    def __post_init__(self) -> None:
        if self.tokens_per_sec is not None and self.tokens_per_sec <= 0:
            raise ValueError(f"--dry_run.tokens_per_sec must be positive, got {self.tokens_per_sec}")
        if self.mfu is not None and not 0 < self.mfu <= 1:
            raise ValueError(f"--dry_run.mfu must be in (0, 1], got {self.mfu}")


@dataclass
class MemoryEstimate:
    """Bytes per device at the peak of a training step (forward end / loss)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int

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


def activation_bytes_per_token(config: Config, compute_dtype: torch.dtype, checkpointing: bool) -> dict[str, float]:
    """Bytes autograd keeps per token: per layer, for the whole stack, and for the head and loss."""
    a = _bytes(compute_dtype)
    d, f = config.n_embd, config.intermediate_size
    q, kv = config.n_head * config.head_size, config.n_query_groups * config.head_size
    norm = 2 * d * 4 if config.norm_class_name == "RMSNorm" else d * a
    norms = 1 if config.shared_attention_norm else 2
    gated = config.mlp_class_name in ("LLaMAMLP", "GemmaMLP")
    layer = norms * norm + (2 * q + 4 * kv) * a + ((4 if gated else 2) * f + d) * a
    # norm_f's saved tensors and the hidden gradient per token; one chunk's logits on top (see module docstring)
    head = norm + d * a + (4 + (a if a < 4 else 0)) * config.padded_vocab_size
    if checkpointing:
        # A block keeps only its input. Its full activations return one block at a time during
        # backward, after the head's are freed, so the peak holds the larger of the two.
        return {"layer": layer, "stack": config.n_layer * d * a, "head": max(head, layer), "head_hidden": norm + d * a}
    return {"layer": layer, "stack": config.n_layer * layer, "head": head, "head_hidden": norm + d * a}


def head_chunk_tokens(config: Config) -> int:
    """Tokens per loss chunk (llmtrain.loss.head_loss_sum): the logits of more never exist at once."""
    from llmtrain import loss

    return loss.head_chunk_tokens(config.padded_vocab_size)


def _block_parameters(config: Config) -> int:
    embeddings = config.padded_vocab_size * config.n_embd * (1 if config.tie_embeddings else 2)
    return (num_parameters(config) - embeddings) // config.n_layer


def estimate_memory(config: Config, plan: ParallelPlan, *, seq_len: int,
                    trainable_parameters: Optional[int] = None, quantize: Optional[str] = None) -> MemoryEstimate:
    """Peak bytes per device of one training step laid out as ``plan`` says.

    The plan's sharding strategy (None without a wrapper) and shard size divide the states; its CPU
    offload counts only when FSDP applies it. ``trainable_parameters`` below the total means LoRA: only
    the adapters have gradients and optimizer state. ``quantize`` stores the frozen linear weights in 4
    bits (bnb.nf4, bnb.fp4) or 8 (bnb.int8).
    """
    precision, micro_batch_size = plan.precision, plan.batch.micro_batch_size
    sharding = plan.sharding_strategy if plan.wrapper != "none" else None
    shard_size, cpu_offload = plan.shard_size, plan.cpu_offload
    total = num_parameters(config)
    trainable = total if trainable_parameters is None else trainable_parameters
    stored, compute = _bytes(precision.param_dtype), _bytes(precision.compute_dtype)
    shard = shard_size if sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD") else 1
    block = _block_parameters(config)

    frozen = total - trainable
    if quantize is not None:
        linear = block * config.n_layer  # the blocks' weights are what bitsandbytes quantizes
        per_weight = 1.0 if quantize == "bnb.int8" else 0.5 + 4 / 64  # 4-bit codes plus one fp32 absmax per 64
        params = (total - linear) * stored + linear * per_weight + trainable * stored
    else:
        params = (frozen + trainable) * stored
    params /= shard
    if sharding in ("FULL_SHARD", "HYBRID_SHARD"):
        params += 2 * block * compute  # the gathered block, and the next one prefetched
    elif sharding == "SHARD_GRAD_OP":
        params += total * compute  # gathered weights stay until backward
    elif sharding is None and precision.is_mixed:
        params += total * compute  # autocast keeps low-precision weight copies for backward
    grad_bytes = 4 if sharding is not None and precision.is_mixed else stored  # FSDP reduces in fp32
    gradients = trainable * grad_bytes / shard
    if sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD") and trainable == total:
        gradients += block * compute  # one block's unsharded gradients before the reduce-scatter
    optimizer = 2 * trainable * stored / shard  # AdamW's two moments, in the weights' dtype
    if cpu_offload:
        params, gradients, optimizer = 2 * block * compute, block * compute, 0
    tokens = micro_batch_size * seq_len
    per_token = activation_bytes_per_token(config, precision.compute_dtype, plan.activation_checkpointing)
    chunk = min(tokens, head_chunk_tokens(config))  # the loss's logits exist one chunk at a time
    head = tokens * per_token["head_hidden"] + chunk * (per_token["head"] - per_token["head_hidden"])
    activations = tokens * per_token["stack"] + head
    if trainable == total:
        activations += 4 * config.padded_vocab_size * config.n_embd  # the head's fp32 weight gradient, early
    return MemoryEstimate(int(params), int(gradients), int(optimizer), int(activations))


def lora_trainable_parameters(config: Config, lora: Any) -> int:
    """Adapter parameters for these LoRA flags, counted on a model built on the meta device (no memory)."""
    from llmtrain.lora import apply_lora, mark_only_lora_trainable
    from llmtrain.model import GPT

    with torch.device("meta"):
        model = GPT(config)
    apply_lora(model, lora)
    mark_only_lora_trainable(model)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _shards(step_bytes: int, plan: ParallelPlan, state_dict_type: str, lora: bool) -> str:
    """How a step checkpoint is written: one file from rank 0, or one shard per rank of a shard group (DCP writes
    a replicated shard once, so HYBRID_SHARD's replicas add nothing on disk)."""
    shard_size = plan.shard_size
    if lora or plan.wrapper != "fsdp" or shard_size == 1:
        return " (one file, rank 0)"
    if state_dict_type == "sharded":
        return f" (sharded: {shard_size} shards of {_size(step_bytes // shard_size)})"
    return f" (one file gathered on rank 0; --fsdp.state_dict_type sharded: {shard_size} shards of " \
           f"{_size(step_bytes // shard_size)})"


def dry_run(*, recipe: str, config: Config, plan: ParallelPlan, train: Any, seq_len: int, dry: DryRunArgs,
            fsdp: Any, out_dir: Path, trainable_parameters: Optional[int] = None,
            quantize: Optional[str] = None) -> None:
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
    sizes = checkpoint_bytes(config, plan.precision, trainable_parameters)
    steps = _planned_steps(train, tokens_per_step)
    if plan.wrapper == "none":
        layout = "one process"
    elif plan.sharding_strategy == "HYBRID_SHARD":
        layout = f"HYBRID_SHARD: replicate {plan.dp_replicate} × shard {plan.dp_shard}"
    elif plan.sharding_strategy == "NO_SHARD":
        layout = f"NO_SHARD (DDP): replicate {world}"
    else:
        layout = f"{plan.sharding_strategy}: shard {plan.dp_shard}"
    batch = plan.batch
    precision = plan.precision
    lines = [
        f"dry run of `llmtrain {recipe}` (nothing is built or trained)",
        f"model        {config.name or 'custom'}: {total / 1e6:,.1f}M parameters, {trainable / 1e6:,.1f}M trainable"
        f"{f', base quantized {quantize}' if quantize else ''}",
        f"layout       {plan.devices} devices × {plan.num_nodes} nodes = {world} ranks on {plan.device_type}; {layout}"
        f"{'; activation checkpointing' if plan.activation_checkpointing else ''}"
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
        f"memory       per device (estimate): {memory.describe()}",
        f"checkpoint   weights {_size(sizes['weights'])}; each resumable step checkpoint {_size(sizes['step'])}"
        f"{_shards(sizes['step'], plan, fsdp.state_dict_type, trainable < total)}",
    ]
    free = shutil.disk_usage(_existing_parent(out_dir)).free
    if free < sizes["needed"]:
        lines.append(f"warning      --out_dir {out_dir} has {_size(free)} free here: too little for one checkpoint")
    lines.append(_describe_time(config, plan, dry, seq_len, tokens_per_step, steps))
    print("\n".join(lines))
    if plan.batch_problem is not None:
        raise ValueError(f"this plan would not start: {plan.batch_problem}")


def _describe_time(config: Config, plan: ParallelPlan, dry: DryRunArgs, seq_len: int, tokens_per_step: int,
                   steps: Optional[int]) -> str:
    per_device, source = dry.tokens_per_sec, "--dry_run.tokens_per_sec"
    mfu = dry.mfu if dry.mfu is not None else DryRunArgs.DEFAULT_MFU
    if per_device is None and dry.gpu is not None:
        peak = lookup_peak_flops(dry.gpu, plan.precision.compute_dtype)
        if peak is None:
            raise ValueError(f"--dry_run.gpu {dry.gpu!r}: its peak FLOP/s is unknown; pass --dry_run.tokens_per_sec")
        per_device = mfu * peak / flops_per_token(config, seq_len)
        source = f"{dry.gpu} at {mfu:.0%} MFU"
    if per_device is None:
        return "time         pass --dry_run.tokens_per_sec N or --dry_run.gpu NAME for an estimate"
    step_s = tokens_per_step / (per_device * plan.world_size)
    total_s = f", {_duration(step_s * steps)} for {steps:,} steps" if steps else ""
    return f"time         {per_device:,.0f} tokens/s per device ({source}): {step_s:.2f} s per step{total_s}"


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
