"""The ``--dry_run`` report: the plan of a run printed before anything is built (model, layout, batch, memory,
checkpoint size, split costs, whether it fits and what would, time, compile), from the memory model
(:mod:`llmtrain.plan.memory`), the split costs (:mod:`llmtrain.plan.communication`) and the layout search
(:mod:`llmtrain.plan.search`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Union

import torch

from llmtrain.args import DryRunArgs
from llmtrain.checkpoint.size import checkpoint_bytes, final_is_separate
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.flops import (active_parameters, flops_per_token, gpu_has_bf16, link_bytes_per_s, lookup_peak_flops,
                            num_parameters)
from llmtrain.plan.communication import (all_to_all_bytes_per_step, communication_bytes_per_step, pipeline_bubble,
                                         tensor_parallel_bytes_per_layer, tensor_parallel_bytes_per_step,
                                         tensor_parallel_passes)
from llmtrain.plan.memory import (MemoryEstimate, estimate_memory, format_size, host_collective_bytes,
                                  microbatches_in_flight, stage_layers)
from llmtrain.plan.search import USABLE_MEMORY_FRACTION, device_memory_bytes, fits, gpu_name, suggest_layout
from llmtrain.train.horizon import plan_horizon


def _shards(step_bytes: int, plan: ParallelPlan, state_dict_type: str, lora: bool) -> str:
    """How a step checkpoint is written: one file from rank 0, or one shard per rank of a shard group (DCP writes
    a replicated shard once, so HYBRID_SHARD's replicas add nothing on disk)."""
    shard_size = plan.shard_size
    if plan.zero is not None:
        return f" (DeepSpeed's files: one optimizer partition per rank, {shard_size} of about " \
               f"{format_size(step_bytes // shard_size)})"
    if lora:
        return " (one file, rank 0)"
    if state_dict_type == "sharded" and (plan.wrapper != "fsdp" or shard_size == 1):
        return " (sharded: one DCP shard)"  # the format asked for, on one rank
    if plan.wrapper != "fsdp" or shard_size == 1:
        return " (one file, rank 0)"
    if state_dict_type == "sharded":
        return f" (sharded: {shard_size} shards of {format_size(step_bytes // shard_size)})"
    return f" (one file gathered on rank 0; --fsdp.state_dict_type sharded: {shard_size} shards of " \
           f"{format_size(step_bytes // shard_size)})"


def dry_run(*, recipe: str, config: Config, plan: ParallelPlan, train: Any, seq_len: int, dry: DryRunArgs,
            fsdp: Any, out_dir: Path, trainable_parameters: Optional[int] = None,
            quantize: Optional[str] = None, compile: Union[bool, str] = False) -> None:
    """Print the plan of a run with these flags, for the devices it names (not the ones this machine has).

    ``plan`` was resolved with ``strict_batch=False``: a batch that does not divide is printed as a problem
    and then raised, so the rest of the plan still shows how to choose it.
    """
    tokens_per_step = plan.batch.global_batch_size * seq_len
    total = num_parameters(config)
    trainable = total if trainable_parameters is None else trainable_parameters
    memory = estimate_memory(config, plan, seq_len=seq_len, trainable_parameters=trainable_parameters,
                             quantize=quantize)
    sizes = checkpoint_bytes(config, plan.precision, trainable_parameters,
                             separate_final=final_is_separate(fsdp.state_dict_type, plan))
    steps = _planned_steps(train, tokens_per_step)
    precision = plan.precision
    lines = [
        f"dry run of `llmtrain {recipe}` (nothing is built or trained)",
        f"model        {config.name or 'custom'}: {total / 1e6:,.1f}M parameters"
        f"{f' ({active_parameters(config) / 1e6:,.1f}M active per token)' if config.is_moe else ''}, "
        f"{trainable / 1e6:,.1f}M trainable"
        f"{f', base quantized {quantize}' if quantize else ''}",
        f"layout       {plan.devices} devices × {plan.num_nodes} nodes = {plan.world_size} ranks on "
        f"{plan.device_type}; {_describe_layout(plan)}"
        f"{f'; activation checkpointing {plan.activation_checkpointing}' if plan.activation_checkpointing else ''}"
        f"{'; CPU offload' if plan.cpu_offload else ''}",
        f"precision    {precision.name} (weights {precision.param_dtype}, compute {precision.compute_dtype})"
        f"{f'; auto: {precision.chosen_because}' if precision.chosen_because else ''}"
        f"{_describe_float8(plan)}",
        _describe_batch(plan, seq_len),
        f"tokens/step  {tokens_per_step:,}",
        f"length       {_describe_length(steps, tokens_per_step, train)}",
        f"memory       per device (estimate{_describe_rank(config, plan, memory)}): {memory.describe()}",
        f"checkpoint   weights {format_size(sizes['weights'])}; each resumable step checkpoint "
        f"{format_size(sizes['step'])}{_shards(sizes['step'], plan, fsdp.state_dict_type, trainable < total)}",
    ]
    lines += _describe_shared_memory(config, plan)
    lines += _describe_split_costs(config, plan, seq_len, dry)
    lines += _describe_experts(config, plan, seq_len, dry)
    if plan.zero is not None:
        lines += _describe_zero_stages(config, plan, seq_len=seq_len, trainable_parameters=trainable_parameters)
    capacity = device_memory_bytes(dry, plan)
    if capacity is not None:
        lines += _describe_fit(config, plan, memory, seq_len=seq_len, train=train, fsdp=fsdp, capacity=capacity,
                               gpu=gpu_name(dry, plan), splittable=trainable == total and quantize is None)
    free = shutil.disk_usage(_existing_parent(out_dir)).free
    if free < sizes["needed"]:
        lines.append(f"warning      --out_dir {out_dir} has {format_size(free)} free here: too little for one "
                     "checkpoint")
    lines.append(_describe_time(config, plan, dry, seq_len, tokens_per_step, steps))
    lines.append(_describe_compile(compile, recipe=recipe, config=config, plan=plan, seq_len=seq_len, steps=steps,
                                   train=train, dry=dry, quantize=quantize))
    print("\n".join(lines))
    if plan.batch_problem is not None:
        raise ValueError(f"this plan would not start: {plan.batch_problem}")


def _describe_float8(plan: ParallelPlan) -> str:
    if not plan.float8:
        return ""
    return f"; float8 {plan.float8} products in the blocks (torchao; the time below is at the bf16 peak)"


def _describe_layout(plan: ParallelPlan) -> str:
    """ "HYBRID_SHARD: replicate 4 × shard 8", and the tensor × pipeline split (:func:`_describe_split`)."""
    if plan.wrapper == "none":
        layout = "one process"
    elif plan.zero is not None:
        layout = f"DeepSpeed {plan.zero.describe()} over {plan.data_parallel_size} ranks"
    elif plan.sharding_strategy == "HYBRID_SHARD":
        layout = f"HYBRID_SHARD: replicate {plan.dp_replicate} × shard {plan.dp_shard}"
    elif plan.sharding_strategy == "NO_SHARD":
        layout = f"NO_SHARD (DDP): replicate {plan.world_size}"
    else:
        layout = f"{plan.sharding_strategy}: shard {plan.dp_shard}"
    if plan.ep > 1:  # taken from the shard: dp_shard_mod_ep × ep for the experts
        layout += f" (experts: shard {plan.expert_shard_size} × expert {plan.ep})"
    if plan.splits_model:
        layout = f"{layout if plan.wrapper != 'none' else 'no data-parallel wrapper'}; {_describe_split(plan)}"
    return layout


def _describe_batch(plan: ParallelPlan, seq_len: int) -> str:
    """The batch line: micro × ranks × accumulation steps, or the problem of a batch that does not divide."""
    batch = plan.batch
    if plan.batch_problem is not None:
        return (f"batch        PROBLEM: global {batch.global_batch_size} is no multiple of micro "
                f"{batch.micro_batch_size} × {plan.data_parallel_size} ranks (see the end)")
    return (f"batch        micro {batch.micro_batch_size} × {plan.data_parallel_size} ranks × "
            f"{batch.grad_accum_steps} accumulation steps = global {batch.global_batch_size} sequences of "
            f"{seq_len} tokens"
            f"{f' ({batch.note})' if batch.note else ''}")


def _describe_shared_memory(config: Config, plan: ParallelPlan) -> list[str]:
    """The /dev/shm that FSDP's collectives map on a CPU host (:func:`host_collective_bytes`), and a warning where
    this machine has less free (no lines where they do not use it)."""
    shared = host_collective_bytes(config, plan)
    if not shared:
        return []
    lines = [f"shared mem   {format_size(shared)} of /dev/shm for FSDP's collectives between the {plan.dp_shard} "
             "processes of this host (two slots each of the largest unit's weights and of its gradients "
             "from every process); with less room free they go through gloo, slower"]
    room = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    if room < shared:
        lines.append(f"warning      /dev/shm has {format_size(room)} free here, under the {format_size(shared)} above: "
                     "FSDP's collectives would go through gloo (mount a larger /dev/shm, e.g. docker --shm-size)")
    return lines


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
    from llmtrain.compiling import choose

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
        lines.append(f"tensor       each of {plan.tp} ranks sends {passes}·(tp - 1)/tp·B·T·C·bytes = "
                     f"{format_size(per_layer)} per block and micro-batch, {format_size(per_step)} per step "
                     f"({max(stage_layers(config, plan))} blocks × "
                     f"{_plural(plan.batch.grad_accum_steps, 'micro-batch')}): {_seconds(per_step / link)} per step at "
                     f"{link / 1e9:.0f} GB/s ({where})")
    return lines


def _describe_experts(config: Config, plan: ParallelPlan, seq_len: int, dry: DryRunArgs) -> list[str]:
    """A mixture of experts: the experts a rank holds and gathers, the all-to-all's bytes per step and rank under
    expert parallelism, beside FSDP's gathers and reductions by mesh dimension (no lines for a dense model)."""
    if not config.is_moe:
        return []
    lines = [f"experts      {config.n_expert} routed per block, {config.n_expert_per_token} per token"
             f"{f', {config.n_shared_expert} shared' if config.n_shared_expert else ''}; {_describe_ep(config, plan)}"]
    traffic = _describe_traffic(config, plan, seq_len, dry)
    return lines + ([f"{'':13}{traffic}"] if traffic else [])


def _describe_ep(config: Config, plan: ParallelPlan) -> str:
    if plan.wrapper != "fsdp":
        return "every rank holds every expert (--ep_size splits them, under FSDP)"
    if plan.ep == 1:
        return ("no expert parallelism: FSDP gathers all of a block's experts on every rank (--ep_size N gathers "
                "n_expert / N, and sends each token's rows to its experts' ranks)")
    return f"expert parallel {plan.ep}: {config.n_expert // plan.ep} experts of each block per rank"


def _describe_traffic(config: Config, plan: ParallelPlan, seq_len: int, dry: DryRunArgs) -> str:
    """ "per step and rank: all-to-all 1.2 GiB, (ep - 1)/ep of it leaves the rank: ... ; FSDP dp_shard 3.4 GiB, ..." """
    volume = communication_bytes_per_step(config, plan, seq_len)
    parts = []
    if plan.ep > 1:
        sent = all_to_all_bytes_per_step(config, plan, seq_len)
        leaves = sent * (plan.ep - 1) / plan.ep
        link, known = link_bytes_per_s(gpu_name(dry, plan))
        where = "NVLink, one way" if known else "assumed PCIe 4.0 x16"
        across = " (across nodes: slower)" if plan.ep * plan.tp > plan.devices else ""
        parts.append(f"all-to-all {format_size(sent)} (dispatch and combine, forward and backward: "
                     f"4·B·T·k·C·bytes per block and micro-batch), (ep - 1)/ep of it leaves the rank: "
                     f"{format_size(leaves)}, {_seconds(leaves / link)} at {link / 1e9:.0f} GB/s ({where}){across}")
    fsdp = [f"{dim} {format_size(volume[dim])}" for dim in ("dp_shard", "dp_shard_mod_ep", "dp_replicate")
            if dim in volume]
    if fsdp:
        what = "FSDP's gathers and reductions" if plan.wrapper == "fsdp" else "DDP's all-reduce"
        parts.append(f"{what} {', '.join(fsdp)}")
    return f"per step and rank: {'; '.join(parts)}" if parts else ""


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
        lines.append(f"{'zero stages' if not lines else '':13}--strategy {name:26} {format_size(memory.total):>10} "
                     f"per device (parameters {format_size(memory.parameters)}, gradients "
                     f"{format_size(memory.gradients)}, optimizer {format_size(memory.optimizer)}){mark}")
    return lines


def _describe_fit(config: Config, plan: ParallelPlan, memory: MemoryEstimate, *, seq_len: int, train: Any, fsdp: Any,
                  capacity: int, gpu: str, splittable: bool) -> list[str]:
    """Whether the estimate fits the GPU; if not, a layout that does (:func:`suggest_layout`), unless the recipe
    cannot split the model (LoRA and QLoRA train with data parallelism only)."""
    usable = USABLE_MEMORY_FRACTION * capacity
    of = f"{format_size(usable)} usable of the {gpu}'s {format_size(capacity)} ({USABLE_MEMORY_FRACTION:.0%})"
    if fits(memory, capacity):
        return [f"fits         yes: {format_size(memory.total)} per device, {memory.total / usable:.0%} of the {of}"]
    lines = [f"fits         no: {format_size(memory.total)} per device, more than the {of}"]
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
    if chosen.ep > 1:
        costs.append(_why_expert_parallel(config, chosen, seq_len))
    splits = "--ep_size × --tp_size × --pp_size" if config.is_moe else "--tp_size × --pp_size"
    before = "" if not added else f"no {splits} fits with these flags; with "
    lines.append(f"suggest      {before}{flags}: {format_size(suggestion.memory.total)} per device "
                 f"({'; '.join(costs)})")
    lines.append(f"             {suggestion.memory.describe()}")
    return lines


def _why_expert_parallel(config: Config, plan: ParallelPlan, seq_len: int) -> str:
    """What ``plan``'s expert parallelism saves and costs against the same plan without it: the experts FSDP gathers
    per block, the bytes it moves per step and rank, and the all-to-all's."""
    without = communication_bytes_per_step(config, replace(plan, ep=1), seq_len)
    with_ep = communication_bytes_per_step(config, plan, seq_len)
    fsdp_dims = ("dp_shard", "dp_shard_mod_ep", "dp_replicate")
    before, after = (sum(volume.get(dim, 0.0) for dim in fsdp_dims) for volume in (without, with_ep))
    return (f"ep {plan.ep}: each rank gathers {config.n_expert // plan.ep} of each block's {config.n_expert} experts, "
            f"so FSDP moves {format_size(after)} per step and rank instead of {format_size(before)}, for an "
            f"all-to-all of {format_size(with_ep.get('ep', 0.0))}")


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
