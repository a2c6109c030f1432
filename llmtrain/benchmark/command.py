"""``llmtrain benchmark``: tokens/s, step time, MFU against this machine's measured matmul peak, data wait.

It runs a real recipe (``pretrain.setup``, or with ``--recipe`` ``finetune.setup_lora`` / ``setup_full`` from
a model directory of random weights; then ``run(spec)`` → ``fit()``: the same data loader, parallel setup and
training step as any run) for ``warmup + steps`` optimizer steps with a log row per step, and reads the step
times back from the run's metrics.csv. The training loader is handed to the
loop inside a thin proxy that times every ``next()``, which is the time the loop waits for data.

MFU is the model's FLOPs per token (llmtrain.flops, the 6N + attention convention of the training log)
times tokens/s per device, over the best FLOP/s of square matmuls measured just before and again just after the run
(the faster of the two counts, so a neighbour that slowed one of them does not inflate MFU), in the run's
compute dtype and with the threads one training process gets: this machine's ceiling, not a datasheet's.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import torch

from llmtrain.args import FSDPArgs, TrainArgs
from llmtrain.benchmark.baseline import (DEFAULT_BASELINE, _check_record_files, _stored_baseline,
                                         default_global_batch)
from llmtrain.benchmark.machine import _load_average, _matmul_peak, device_name, git_commit, threads_per_process
from llmtrain.benchmark.table import _print_table
from llmtrain.benchmark.timing import _step_timing, _train_rows
from llmtrain.benchmark.training import RecipeName, _train, _train_args
from llmtrain.distributed.parallel_plan import ParallelPlan, StrategyName
from llmtrain.flops import MATMUL_SIZES
from llmtrain.lora import LoRAArgs
from llmtrain.precision import PrecisionName
from llmtrain.quantize import QuantizeMode

if TYPE_CHECKING:
    from llmtrain.config import Config

# Full runs and --short: (micro batch, sequence length, timed steps, warm-up steps) unless flags say otherwise.
FULL_DEFAULTS = (8, 256, 20, 5)
SHORT_DEFAULTS = (4, 128, 3, 2)
RECORD_FIELDS = (
    "recipe", "model", "parameters", "active_parameters", "trainable_parameters", "lora", "quantize", "precision", "micro_batch_size", "seq_len",
    "devices", "strategy", "sharding_strategy",
    "compile", "activation_checkpointing",
    "tp_size", "pp_size", "pp_schedule", "global_batch_size", "steps", "warmup",
    "tokens_per_sec_per_device", "tokens_per_sec", "step_time_median_s", "step_time_min_s", "step_time_max_s",
    "step_time_p25_s", "step_time_p75_s", "flops_per_token", "matmul_peak_flops", "matmul_peak_size", "mfu",
    "data_wait_fraction", "data_wait_fraction_logged", "peak_memory_gb", "save_interval", "async_save",
    "checkpoint_saves", "checkpoint_stall_s", "checkpoint_stall_max_s", "device", "threads_per_process", "torch",
    "load_average", "commit", "command", "time",
)


def benchmark(
    model: str = "llama-debug",
    recipe: RecipeName = "pretrain",
    lora: LoRAArgs = LoRAArgs(),
    quantize: Optional[QuantizeMode] = None,
    precision: PrecisionName = "32-true",
    micro_batch_size: Optional[int] = None,
    seq_len: Optional[int] = None,
    steps: Optional[int] = None,
    warmup: Optional[int] = None,
    devices: int = 1,
    strategy: StrategyName = "auto",
    sharding_strategy: Optional[str] = None,
    tp_size: int = 1,
    pp_size: int = 1,
    pp_schedule: Optional[str] = None,
    global_batch_size: Optional[int] = None,
    save_interval: Optional[int] = None,
    async_save: bool = False,
    compile: bool = False,
    activation_checkpointing: Union[bool, str] = False,
    short: bool = False,
    out_dir: Path = Path("out/benchmark"),
    results: Optional[Path] = None,
    baseline: Optional[Path] = DEFAULT_BASELINE,
    fail_below: Optional[float] = None,
) -> dict:
    """Measure training speed of a zoo model on this machine and append the numbers to a JSON-lines file.

    Args:
        model: A zoo name (`llmtrain pretrain list`); the presets are llama-debug (4.9M parameters) and
            pythia-70m.
        recipe: What to time: pretrain (from random init), finetune_lora or finetune_full. Fine-tuning starts
            from a model directory of MODEL with random weights, written first (the step does the same work
            whatever the weights), and reads the same fixed-length token windows as pretraining (no padding).
        lora: With --recipe finetune_lora: the adapters, as finetune_lora's flags, e.g. `--lora.lora_r 16
            --lora.lora_dropout 0 --lora.lora_mlp true`. Default: finetune_lora's (rank 8, alpha 16, dropout
            0.05, on the query and value projections).
        quantize: With --recipe finetune_lora: QLoRA, the frozen base in bitsandbytes layers, as `finetune_lora
            --quantize` (bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq, bnb.int8-training); one device, a `-true`
            precision.
        precision: auto (bf16-mixed on a GPU with bf16, 16-mixed on an older one, 32-true on a CPU), 32-true,
            bf16-true, bf16-mixed, 16-true or 16-mixed.
        micro_batch_size: Sequences per data-parallel rank and micro-batch. Default 8, or 4 with --short.
        seq_len: Tokens per sequence. Default 256, or 128 with --short.
        steps: Timed optimizer steps. Default 20, or 3 with --short.
        warmup: Steps run first and not timed (allocator, caches, compilation). Default 5, or 2 with --short.
        devices: Processes, as `pretrain --devices` (FSDP when more than one).
        strategy: As `pretrain --strategy`: auto, ddp, fsdp, or a DeepSpeed ZeRO stage (deepspeed_stage_1, ...,
            deepspeed_stage_3_offload; needs the deepspeed extra).
        sharding_strategy: With several devices, as `pretrain --fsdp.sharding_strategy` (FULL_SHARD,
            SHARD_GRAD_OP, NO_SHARD); None: pretrain's default (FULL_SHARD on one node).
        tp_size: Tensor-parallel degree, as `pretrain --tp_size`.
        pp_size: Pipeline stages, as `pretrain --pp_size`.
        pp_schedule: As `pretrain --pp_schedule` (gpipe, 1f1b, interleaved_1f1b); 1f1b by default.
        global_batch_size: Sequences per optimizer step. Default: micro batch × data-parallel ranks, times
            --pp_size under pipeline parallelism (one micro-batch per stage in flight). Compare layouts at the
            same global batch.
        save_interval: Write a sharded checkpoint every this many steps and report the training loop's
            stall per save (the time of the step after a save minus the median step's); those steps stay
            out of the step-time statistics. None: no checkpoints until the end.
        async_save: Write those checkpoints as `--fsdp.async_save true` does, to compare the stall with
            a synchronous save.
        compile: torch.compile every block, as `pretrain --compile`.
        activation_checkpointing: As `pretrain --fsdp.activation_checkpointing`: false, true (full), selective:N
            or op; the record's peak memory and step time show what the mode costs and saves.
        short: A quick check for CI: the small defaults above, and the ratio to the stored baseline.
        out_dir: The run trains in a temporary folder here (removed afterwards); results go here too.
        results: JSON-lines file that each run appends one record to. Default: out_dir/benchmarks.jsonl.
        baseline: JSON file of reference numbers per machine (the CPU or GPU model) and setting; the run prints
            its tokens/s ratio to the matching one. Where it has none, the run is recorded as it, and passes: by
            default (the repository's file) in the machine's own file under the llmtrain cache, which later runs
            read too; a file given here gets the record itself. null: no comparison.
        fail_below: Exit with an error (after recording the run) when that ratio is below this, e.g. 0.3
            to catch a regression and not noise. None: report the ratio, never fail on it.
    """
    from llmtrain.config import Config

    micro_batch_size, seq_len, steps, warmup = _sizes(short, micro_batch_size, seq_len, steps, warmup, devices)
    model = _checked_flags(model, save_interval, async_save, fail_below, baseline)
    results = Path(results) if results is not None else Path(out_dir) / "benchmarks.jsonl"
    _check_record_files(results, Path(baseline) if baseline is not None else None)
    if recipe != "finetune_lora" and lora != LoRAArgs():
        raise ValueError(f"--lora.* flags set the adapters of --recipe finetune_lora, not of --recipe {recipe}: "
                         "drop them or add --recipe finetune_lora")
    if quantize is not None and recipe != "finetune_lora":
        raise ValueError(f"--quantize {quantize} quantizes the frozen base of --recipe finetune_lora (QLoRA), not "
                         f"of --recipe {recipe}: drop it or use --recipe finetune_lora")
    adapters = lora if recipe == "finetune_lora" else None
    fsdp, train, plan, global_batch_size = _layout(
        micro_batch_size=micro_batch_size, seq_len=seq_len, steps=warmup + steps, devices=devices, strategy=strategy,
        sharding_strategy=sharding_strategy, tp_size=tp_size, pp_size=pp_size, pp_schedule=pp_schedule,
        global_batch_size=global_batch_size, save_interval=save_interval, async_save=async_save,
        activation_checkpointing=activation_checkpointing, precision=precision, lora=adapters)
    config = Config.from_name(model)
    if seq_len > config.block_size:
        raise ValueError(f"--seq_len {seq_len} exceeds {model}'s block size {config.block_size}")
    trainable, flops = _model_costs(config, seq_len, adapters)
    threads = threads_per_process(devices)
    print(f"layout: {plan.describe()}", flush=True)
    measured = _measure(plan, threads, Path(out_dir), warmup, save_interval, model=model, fsdp=fsdp, train=train,
                        compile=compile, strategy=strategy, recipe=recipe, lora=adapters,
                        **({"quantize": quantize} if quantize is not None else {}))
    setting = dict(recipe=recipe, quantize=quantize, model=model, micro_batch_size=micro_batch_size, seq_len=seq_len, devices=devices,
                   strategy=strategy, sharding_strategy=sharding_strategy, compile=compile, tp_size=tp_size,
                   pp_size=pp_size, global_batch_size=global_batch_size, save_interval=save_interval,
                   async_save=async_save, steps=steps, warmup=warmup)
    record = _record(setting, plan, fsdp, config, adapters, trainable, flops, threads, measured)
    _report(record, baseline, results, fail_below)
    return record


def _sizes(short: bool, micro_batch_size: Optional[int], seq_len: Optional[int], steps: Optional[int],
           warmup: Optional[int], devices: int) -> tuple[int, int, int, int]:
    """Micro batch, sequence length, timed and warm-up steps: the flags', else --short's or a full run's defaults;
    checked, with --devices."""
    defaults = SHORT_DEFAULTS if short else FULL_DEFAULTS
    micro_batch_size, seq_len, steps, warmup = (given if given is not None else default for given, default in
                                                zip((micro_batch_size, seq_len, steps, warmup), defaults))
    for flag, value, least in (("--micro_batch_size", micro_batch_size, 1), ("--seq_len", seq_len, 2),
                               ("--steps", steps, 1), ("--warmup", warmup, 0), ("--devices", devices, 1)):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    return micro_batch_size, seq_len, steps, warmup


def _checked_flags(model: str, save_interval: Optional[int], async_save: bool, fail_below: Optional[float],
                   baseline: Optional[Path]) -> str:
    """The zoo name of ``model``, once the flags that need no layout agree with each other."""
    from llmtrain.config import resolve_name

    try:
        model = resolve_name(model)  # short names and aliases too
    except ValueError as error:
        raise ValueError(f"--model: {error} (benchmark presets: llama-debug, pythia-70m)") from None
    if save_interval is not None and save_interval < 1:
        raise ValueError(f"--save_interval must be at least 1, got {save_interval}")
    if async_save and save_interval is None:
        raise ValueError("--async_save true needs --save_interval N: without checkpoints there is no stall to time")
    if fail_below is not None and baseline is None:
        raise ValueError("--fail_below compares with a baseline, and --baseline null turns the comparison off: "
                         "drop one of them")
    return model


def _layout(*, micro_batch_size: int, seq_len: int, steps: int, devices: int, strategy: StrategyName,
            sharding_strategy: Optional[str], tp_size: int, pp_size: int, pp_schedule: Optional[str],
            global_batch_size: Optional[int], save_interval: Optional[int], async_save: bool,
            activation_checkpointing: Union[bool, str], precision: PrecisionName,
            lora: Optional[LoRAArgs]) -> tuple[FSDPArgs, TrainArgs, ParallelPlan, int]:
    """The run's FSDP and training arguments and its parallel plan (``steps``: warm-up and timed), with the
    recipe's errors in the benchmark's flags."""
    try:
        deepspeed = strategy.startswith("deepspeed")  # DeepSpeed writes its own sharded files
        # NOTE: finetune_lora's checkpoints hold only the adapters and are always full.
        sharded = save_interval and not deepspeed and lora is None
        fsdp = FSDPArgs(sharding_strategy=sharding_strategy, async_save=async_save,
                        state_dict_type="sharded" if sharded else "full",
                        activation_checkpointing=activation_checkpointing)
        global_batch_size = global_batch_size or default_global_batch(
            dict(micro_batch_size=micro_batch_size, devices=devices, tp_size=tp_size, pp_size=pp_size))
        train = _train_args(micro_batch_size, global_batch_size, seq_len, steps, save_interval)
        plan = ParallelPlan.resolve(devices=devices, num_nodes=1, precision=precision, fsdp=fsdp, train=train,
                                    strategy=strategy, tp=tp_size, pp=pp_size, pp_schedule=pp_schedule)
    except ValueError as error:
        raise ValueError(_in_benchmark_flags(str(error))) from None
    return fsdp, train, plan, global_batch_size


# The recipe's flags that the benchmark sets from its own: its errors name the benchmark's.
RECIPE_FLAGS = {"--fsdp.sharding_strategy": "--sharding_strategy", "--fsdp.activation_checkpointing":
                "--activation_checkpointing", "--fsdp.async_save": "--async_save", "--train.global_batch_size":
                "--global_batch_size", "--train.micro_batch_size": "--micro_batch_size", "--train.max_seq_length":
                "--seq_len", "--train.save_interval": "--save_interval"}


def _in_benchmark_flags(message: str) -> str:
    """A recipe's error message with the flags named as ``llmtrain benchmark`` spells them."""
    for recipe_flag, flag in RECIPE_FLAGS.items():
        message = message.replace(recipe_flag, flag)
    return message


def _model_costs(config: Config, seq_len: int, adapters: Optional[LoRAArgs]) -> tuple[int, float]:
    """Trainable parameters (the adapters' under LoRA) and the model's FLOPs per token."""
    from llmtrain.flops import flops_per_token, num_parameters
    from llmtrain.plan.memory import lora_trainable_parameters

    trainable = lora_trainable_parameters(config, adapters) if adapters is not None else num_parameters(config)
    return trainable, flops_per_token(config, seq_len, adapter_parameters=trainable if adapters is not None else None)


def _measure(plan: ParallelPlan, threads: int, out_dir: Path, warmup: int, save_interval: Optional[int],
             **run) -> dict:
    """The matmul peak before and after the run (the faster counts) and the run's step timing; ``run`` goes to
    :func:`~llmtrain.benchmark.training._train`. The run trains in a folder of ``out_dir`` removed afterwards."""
    dtype, peak_device = plan.precision.compute_dtype, plan.device_type
    peak, peak_size = _matmul_peak(dtype, threads, peak_device)
    print(f"matmul peak: {peak / 1e9:,.1f} GFLOP/s ({dtype}, {threads} threads, best over n = "
          f"{', '.join(map(str, MATMUL_SIZES))}; measured again after the run)", flush=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=out_dir))
    try:
        _train(run_dir, plan=plan, **run)
        rows = _train_rows(run_dir / "train" / "metrics.csv")
        waits = [float(line) for line in (run_dir / "data_wait.txt").read_text().split()]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    # NOTE: a neighbour that slowed only the first measurement would inflate MFU; the faster of the two counts.
    peak, peak_size = max((peak, peak_size), _matmul_peak(dtype, threads, peak_device))
    timing = _step_timing(rows, waits, warmup, save_interval, plan.batch.grad_accum_steps)
    return {**timing, "matmul_peak_flops": peak, "matmul_peak_size": peak_size}


def _record(setting: dict, plan: ParallelPlan, fsdp: FSDPArgs, config: Config, adapters: Optional[LoRAArgs],
            trainable: int, flops: float, threads: int, measured: dict) -> dict:
    """The run's JSON record, in RECORD_FIELDS' order: its ``setting`` (the flags), the layout and the numbers."""
    from llmtrain.flops import active_parameters, num_parameters

    tokens_per_sec_per_device = (setting["global_batch_size"] * setting["seq_len"] / measured["step_time_median_s"]
                                 / setting["devices"])
    record = {
        **setting, "parameters": num_parameters(config), "active_parameters": active_parameters(config),
        "trainable_parameters": trainable,
        "lora": dataclasses.asdict(adapters) if adapters is not None else None, "precision": plan.precision.name,
        "activation_checkpointing": fsdp.activation_checkpointing, "pp_schedule": plan.pp_schedule,
        "tokens_per_sec_per_device": tokens_per_sec_per_device,
        "tokens_per_sec": tokens_per_sec_per_device * setting["devices"], **measured, "flops_per_token": flops,
        "mfu": flops * tokens_per_sec_per_device / measured["matmul_peak_flops"],
        "device": device_name(plan.device_type), "threads_per_process": threads, "torch": torch.__version__,
        "load_average": _load_average(), "commit": git_commit(), "command": _command_line(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return {key: record[key] for key in RECORD_FIELDS}


def _report(record: dict, baseline: Optional[Path], results: Path, fail_below: Optional[float]) -> None:
    """Print the table and the ratio to the baseline (adding ``baseline_ratio`` to ``record``), append the record
    to ``results``, then fail when --fail_below says so."""
    _print_table(record)
    stored = _stored_baseline(record, Path(baseline)) if baseline is not None else None
    if stored is not None:
        record["baseline_ratio"] = record["tokens_per_sec_per_device"] / stored["tokens_per_sec_per_device"]
        print(f"tokens/s vs baseline: {record['baseline_ratio']:.2f}x ({record['tokens_per_sec_per_device']:,.0f} "
              f"now, {stored['tokens_per_sec_per_device']:,.0f} stored at commit {stored.get('commit', '?')} on "
              f"{stored.get('device', '?')})")
    results.parent.mkdir(parents=True, exist_ok=True)
    with open(results, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    print(f"appended to {results}")
    if fail_below is not None and stored is not None and record["baseline_ratio"] < fail_below:
        raise SystemExit(f"error: tokens/s is {record['baseline_ratio']:.2f}x the baseline in {baseline} "
                         f"(below {fail_below:g}x, the --fail_below threshold): a performance regression, or a much "
                         "slower machine")


def _command_line() -> str:
    """The command as typed: ``llmtrain benchmark ...`` or ``bench/benchmark.py ...`` (which passes 'benchmark')."""
    arguments = sys.argv[1:]
    if arguments[:1] == ["benchmark"]:
        arguments = arguments[1:]
    return shlex.join(["llmtrain", "benchmark", *arguments])

