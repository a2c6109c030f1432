"""Argument groups shared by every recipe (``--train.*``, ``--eval.*``, ``--fsdp.*``, ``--profile.*``,
``--dry_run.*``).

The flag names follow LitGPT's where the concept is the same, so its users can move over.
Checks that need only these numbers live here; checks that need the world size live in
:func:`batch_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Optional, Union

ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")


@dataclass
class TrainArgs:
    """How long and how to train."""

    save_interval: Optional[int] = 1000
    """Write a checkpoint every this many optimizer steps (and always at the end). None: only at the end."""
    log_interval: int = 1
    """Log metrics every this many optimizer steps."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step, summed over all data-parallel ranks and accumulation steps. None: the
    recipe's default (a zoo model's config_hub recipe, else 64; fine-tuning 16), rounded up to a multiple of
    data-parallel size × micro batch so that it always divides."""
    micro_batch_size: Optional[int] = None
    """Samples per forward/backward pass on one device. None: the recipe's default (a zoo model's config_hub
    recipe, else 4; fine-tuning 1)."""
    lr_warmup_steps: Optional[int] = 100
    """Linear learning-rate warmup, in optimizer steps."""
    lr_warmup_fraction: Optional[float] = None
    """Warmup as a fraction of the total steps; replaces lr_warmup_steps when set."""
    epochs: Optional[float] = None
    """Stop after this many passes over the training data."""
    max_tokens: Optional[int] = None
    """Stop after this many training tokens (input tokens, summed over all ranks)."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps. Without max_steps, max_tokens and epochs, pretraining takes the zoo
    model's config_hub recipe's length, else one epoch; fine-tuning one epoch. Given together, the first to come
    ends the run (the start says which)."""
    max_time: Optional[float] = None
    """Stop after this many seconds of training (a checkpoint is written first)."""
    max_seq_length: Optional[int] = None
    """Tokens per sample. None: the model's block_size."""
    max_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this value. None: no clipping (the norm is still logged)."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    lr_decay: str = "cosine"
    """Schedule after warmup: cosine | linear | constant."""
    keep_last: Optional[int] = None
    """Keep only the newest this many step checkpoints; an older one is deleted once a newer one is complete, and the
    last good one (a later step had a finite gradient norm) only once a newer one is good too. None: keep all."""
    max_nonfinite_steps: int = 5
    """A step whose gradient norm is NaN or inf is skipped (no update); stop the run (non-zero exit) after
    this many such steps in a row. No checkpoint is written while such steps run on."""

    def __post_init__(self) -> None:
        for name in ("log_interval", "max_nonfinite_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--train.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("global_batch_size", "micro_batch_size", "save_interval", "max_steps", "max_tokens",
                     "keep_last", "max_seq_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--train.{name} must be at least 1 or null, got {value}")
        for name in ("epochs", "max_time", "max_norm"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--train.{name} must be positive or null, got {value}")
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction < 1:
            raise ValueError(f"--train.lr_warmup_fraction must be in [0, 1), got {self.lr_warmup_fraction}")
        if self.lr_warmup_steps is not None and self.lr_warmup_steps < 0:
            raise ValueError(f"--train.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_decay not in ("cosine", "linear", "constant"):
            raise ValueError(f"--train.lr_decay must be cosine, linear or constant, got {self.lr_decay!r}")
        if self.min_lr < 0:
            raise ValueError(f"--train.min_lr must be >= 0, got {self.min_lr}")
        if None not in (self.global_batch_size, self.micro_batch_size) and (
                self.global_batch_size < self.micro_batch_size):
            raise ValueError(
                f"--train.global_batch_size {self.global_batch_size} is smaller than "
                f"--train.micro_batch_size {self.micro_batch_size}; raise the global batch or lower the micro batch"
            )


@dataclass
class EvalArgs:
    """When and how much to validate."""

    interval: int = 100
    """Compute the validation loss every this many optimizer steps."""
    max_iters: int = 20
    """Validation batches per evaluation (per rank)."""
    initial_validation: bool = True
    """Validate once before the first step, so the log shows where training started."""
    final_validation: bool = True
    """Validate after the last step."""

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"--eval.interval must be at least 1, got {self.interval}")
        if self.max_iters < 1:
            raise ValueError(f"--eval.max_iters must be at least 1, got {self.max_iters}")


def canonical_checkpointing(value: Union[bool, str]) -> Union[bool, str]:
    """A ``--fsdp.activation_checkpointing`` value in one spelling: False, "full", "selective:N" or "op"."""
    spelled = str(value).strip().lower()
    if value is False or spelled in ("false", "none", "no"):
        return False
    if value is True or spelled in ("true", "full"):
        return "full"
    if spelled == "op":
        return "op"
    kind, _, every = spelled.partition(":")
    if kind == "selective" and every.isdigit() and int(every) >= 1:
        return "full" if int(every) == 1 else f"selective:{int(every)}"
    raise ValueError(f"--fsdp.activation_checkpointing {value!r} is not a mode: pass full (every block), "
                     "selective:N (every Nth block, N >= 1), op (every block, keeping its matmul and attention "
                     "outputs) or false")


def checkpointed_every(mode: Union[bool, str]) -> int:
    """Every how many blocks a mode checkpoints: 0 for none, 1 for full and op, N for selective:N."""
    if not mode:
        return 0
    return int(mode.partition(":")[2]) if mode.startswith("selective:") else 1


@dataclass
class FSDPArgs:
    """How FSDP shards and wraps the model (``--fsdp.*``)."""

    sharding_strategy: Optional[ShardingStrategy] = None
    """FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD (DDP). None: HYBRID_SHARD on several nodes, else FULL_SHARD."""
    activation_checkpointing: Union[bool, str] = False
    """Recompute activations in backward instead of storing them: `full` (or true) every block's whole forward;
    `selective:N` every Nth block's; `op` every block, but the outputs of its matmuls and attention are kept and
    only the cheap operators between them (norms, RoPE, activations) run again. false: store everything."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory, copied to the GPU to compute. GPU runs
    only: a CPU run has them in host memory already and refuses the flag."""
    state_dict_type: Literal["full", "sharded"] = "full"
    """Checkpoint format: `full` (rank 0 writes model.safetensors) or `sharded` (every rank writes its shard)."""
    skip_gradient_sync: bool = True
    """Reduce gradients only after the last micro-batch of a step: less communication, but under FSDP each
    rank holds unsharded gradients during accumulation. Applies to DDP too."""
    async_save: bool = False
    """Write sharded checkpoints in a background thread: training waits only while the shards are copied to
    host memory (one more copy of model and optimizer state there). A checkpoint counts only once its
    write has finished, so a kill during it leaves none that resume picks. Needs state_dict_type sharded."""

    def __post_init__(self) -> None:
        self.activation_checkpointing = canonical_checkpointing(self.activation_checkpointing)
        if self.sharding_strategy is not None and self.sharding_strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"--fsdp.sharding_strategy {self.sharding_strategy!r} must be one of "
                             f"{', '.join(SHARDING_STRATEGIES)} (or null for the default)")
        if self.state_dict_type not in ("full", "sharded"):
            raise ValueError(f"--fsdp.state_dict_type {self.state_dict_type!r} must be `full` or `sharded`")
        if self.async_save and self.state_dict_type != "sharded":
            raise ValueError("--fsdp.async_save true needs --fsdp.state_dict_type sharded (a full checkpoint is "
                             "gathered and written by rank 0 alone)")


@dataclass
class DeepSpeedArgs:
    """DeepSpeed settings (``--deepspeed.*``), for ``--strategy deepspeed`` and ``deepspeed_stage_*`` (extensions/deepspeed)."""

    config: Optional[Path] = None
    """A DeepSpeed config file (JSON) whose ZeRO, communication and offload settings the run takes. Batch sizes,
    accumulation, precision and clipping come from llmtrain's flags: "auto" or the same values there."""


@dataclass
class ProfileArgs:
    """``--profile`` records optimizer steps with torch.profiler into ``out_dir/profile/`` (llmtrain.train.profile)."""

    enabled: bool = False
    """Profile a window of steps (bare `--profile` sets this; so does any other --profile.* flag)."""
    start_step: Optional[int] = None
    """First optimizer step to profile, counted from 1 as the log counts steps, across resumes. None: the second
    step of this run (the first pays one-time costs: allocator growth, compilation)."""
    end_step: Optional[int] = None
    """Last step to profile (inclusive). None: start_step + 2, or the run's last step if that comes first."""
    record_shapes: bool = False
    """Record each operator's input shapes: the trace shows them and the table groups operators by shape."""
    memory: bool = True
    """Record allocations: memory columns in the table, memory events in the trace and, on CUDA, a snapshot of
    every allocation of the window (memory_rankN.pickle, for https://pytorch.org/memory_viz)."""
    with_stack: bool = False
    """Record the Python stack of each operator, so the trace leads to source lines (larger traces)."""

    DEFAULT_STEPS = 3

    @property
    def requested(self) -> bool:
        """Any --profile.* flag turns profiling on: none of them means anything otherwise."""
        return self.enabled or self != ProfileArgs()

    def __post_init__(self) -> None:
        for name in ("start_step", "end_step"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--profile.{name} must be at least 1 (steps count from 1), got {value}")
        if self.start_step is not None and self.end_step is not None and self.end_step < self.start_step:
            raise ValueError(f"--profile.end_step {self.end_step} is before --profile.start_step {self.start_step}; "
                             f"the window is inclusive: use --profile.end_step {self.start_step} or later")

    def check_within(self, last_step: int, set_by: str) -> None:
        """Refuse a step past ``last_step``, the run's last step, which the stop condition ``set_by`` sets."""
        for name in ("start_step", "end_step"):
            value = getattr(self, name)
            if value is not None and value > last_step:
                raise ValueError(f"--profile.{name} {value} is past the run's last step, {last_step} ({set_by}): "
                                 f"profile steps within 1-{last_step}, or train longer")

    def window(self, first_step: int, last_step: int) -> tuple[int, int]:
        """The first and last step to profile in a run that trains steps ``first_step`` to ``last_step``."""
        start = self.start_step
        if start is None:
            start = min(first_step + 1, last_step, self.end_step or last_step)
        end = self.end_step
        if end is None:
            end = min(start + self.DEFAULT_STEPS - 1, last_step)
        return start, end


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


@dataclass(frozen=True)
class BatchDefaults:
    """A recipe's batch sizes where the flags leave them unset (``None``)."""

    global_batch_size: int = 64
    micro_batch_size: int = 4
    source: str = "llmtrain's default"
    """Where they come from, for the run's log (e.g. ``config_hub/pretrain/tinyllama.yaml``)."""


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step is split over ranks and micro-batches."""

    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    grad_accum_steps: int
    note: str = ""
    """How a defaulted batch size was chosen (empty when the flags gave both)."""

    @property
    def samples_per_micro_step(self) -> int:
        """Samples that all data-parallel ranks consume together in one micro-step."""
        return self.micro_batch_size * self.data_parallel_size


def batch_plan(train: TrainArgs, data_parallel_size: int, strict: bool = True,
               defaults: BatchDefaults = BatchDefaults()) -> BatchPlan:
    """Gradient accumulation = global batch / (data-parallel size × micro batch), exactly.

    A batch size the flags leave unset comes from ``defaults``; a defaulted global batch is rounded up to a
    multiple of data-parallel size × micro batch, so that no default combination is refused. A global batch
    given by the flags that does not divide raises a ValueError naming the flags and suggesting valid values;
    with ``strict=False`` (the dry run, which still prints the rest of the plan) the accumulation is rounded down.
    """
    micro = train.micro_batch_size or defaults.micro_batch_size
    per_step = data_parallel_size * micro
    note = ""
    if train.global_batch_size is None:
        base = max(defaults.global_batch_size, micro)
        global_batch = -(-base // per_step) * per_step
        note = f"batch sizes from {defaults.source}" + (
            f", global {base} rounded up to a multiple of {data_parallel_size} ranks × micro {micro}"
            if global_batch != base else "")
        train = replace(train, global_batch_size=global_batch, micro_batch_size=micro)
    elif train.micro_batch_size is None:
        note = f"micro batch from {defaults.source}"
        train = replace(train, micro_batch_size=micro)
    if train.global_batch_size < micro:
        raise ValueError(f"--train.global_batch_size {train.global_batch_size} is smaller than the micro batch {micro} "
                         f"({defaults.source}); raise the global batch or set --train.micro_batch_size")
    if strict and train.global_batch_size % per_step != 0:
        lower = max(per_step, train.global_batch_size // per_step * per_step)
        higher = (train.global_batch_size // per_step + 1) * per_step
        micro_options = [m for m in range(1, micro + 1)
                         if train.global_batch_size % (data_parallel_size * m) == 0]
        hint = f"use --train.global_batch_size {lower} or {higher}" if lower != higher else (
            f"use --train.global_batch_size {higher}")
        if micro_options:
            hint += f", or --train.micro_batch_size {micro_options[-1]}"
        raise ValueError(
            f"--train.global_batch_size {train.global_batch_size} is not divisible by data-parallel size "
            f"{data_parallel_size} × --train.micro_batch_size {micro} = {per_step}; {hint}"
        )
    return BatchPlan(
        global_batch_size=train.global_batch_size,
        micro_batch_size=micro,
        data_parallel_size=data_parallel_size,
        grad_accum_steps=max(1, train.global_batch_size // per_step),
        note=note,
    )
