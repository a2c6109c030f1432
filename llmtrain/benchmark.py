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
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

import torch

from llmtrain.args import EvalArgs, FSDPArgs, TrainArgs
from llmtrain.distributed.parallel_plan import ParallelPlan, StrategyName, data_parallel_ranks
from llmtrain.flops import MATMUL_SIZES, measure_matmul_peak
from llmtrain.lora import LoRAArgs
from llmtrain.train.precision import PrecisionName

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE = ROOT / "scripts" / "benchmark_baseline.json"
# Full runs and --short: (micro batch, sequence length, timed steps, warm-up steps) unless flags say otherwise.
FULL_DEFAULTS = (8, 256, 20, 5)
SHORT_DEFAULTS = (4, 128, 3, 2)
RecipeName = Literal["pretrain", "finetune_lora", "finetune_full"]
RECORD_FIELDS = (
    "recipe", "model", "parameters", "trainable_parameters", "lora", "precision", "micro_batch_size", "seq_len",
    "devices", "strategy", "sharding_strategy",
    "compile", "activation_checkpointing",
    "tp_size", "pp_size", "pp_schedule", "global_batch_size", "steps", "warmup",
    "tokens_per_sec_per_device", "tokens_per_sec", "step_time_median_s", "step_time_min_s", "step_time_max_s",
    "step_time_p25_s", "step_time_p75_s", "flops_per_token", "matmul_peak_flops", "matmul_peak_size", "mfu",
    "data_wait_fraction", "data_wait_fraction_logged", "peak_memory_gb", "save_interval", "async_save",
    "checkpoint_saves", "checkpoint_stall_s", "checkpoint_stall_max_s", "device", "threads_per_process", "torch",
    "load_average", "commit", "command", "time",
)


# ------------------------------------------------------------------------------------ machine
def device_name(device_type: str) -> str:
    """The run's device: the GPU's name, or the CPU's (asking CUDA only for a GPU run)."""
    if device_type == "cuda":
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "cpu"


def git_commit() -> str:
    """Short hash of HEAD, with ``-dirty`` when the working tree has changes (the numbers are not HEAD's)."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=7"],
                              capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def threads_per_process(devices: int) -> int:
    """The CPU threads each training process runs with: this process's, or the launcher's share per worker."""
    if devices == 1:
        return torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    from llmtrain.distributed.launch import _usable_cores

    return max(1, _usable_cores() // devices)  # what the launcher gives each worker


# --------------------------------------------------------------------------------- data timing
class TimedData:
    """A data module that behaves as ``inner`` but times every batch the training loop asks for.

    Rank 0 appends one line per ``next()`` (seconds waited) to ``wait_log``. Plain attributes, so the
    spawned workers of a multi-process run receive it with the rest of the run's spec.
    """

    def __init__(self, inner: Any, wait_log: Path) -> None:
        self.inner = inner
        self.wait_log = Path(wait_log)
        self.dp_rank = 0

    def validate(self) -> None:
        self.inner.validate()

    def default_tokenizer(self) -> Any:
        return self.inner.default_tokenizer()

    def connect(self, *args: Any, **kwargs: Any) -> None:
        self.inner.connect(*args, **kwargs)

    def prepare_data(self) -> None:
        self.inner.prepare_data()

    def setup(self, dp_rank: int = 0, dp_size: int = 1) -> None:
        self.dp_rank = dp_rank
        self.inner.setup(dp_rank, dp_size)

    def train_dataloader(self) -> "TimedLoader":
        return TimedLoader(self.inner.train_dataloader(), self.wait_log if self.dp_rank == 0 else None)

    def val_dataloader(self) -> Any:
        return self.inner.val_dataloader()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "inner":  # unpickling looks these up before inner exists
            raise AttributeError(name)
        return getattr(self.inner, name)


class TimedLoader:
    """Passes every attribute through to the training loader; ``next()`` is also timed and logged."""

    def __init__(self, loader: Any, wait_log: Optional[Path]) -> None:
        object.__setattr__(self, "_loader", loader)
        object.__setattr__(self, "_log", open(wait_log, "a", buffering=1) if wait_log is not None else None)

    def __iter__(self) -> "TimedLoader":
        object.__setattr__(self, "_iterator", iter(self._loader))
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        batch = next(self._iterator)
        waited = time.perf_counter() - start
        if self._log is not None:
            self._log.write(f"{waited:.9f}\n")
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_loader"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._loader, name, value)  # e.g. the loop's pin_memory switch reaches the real loader


# ----------------------------------------------------------------------------------- command
def benchmark(
    model: str = "llama-debug",
    recipe: RecipeName = "pretrain",
    lora: LoRAArgs = LoRAArgs(),
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
    from llmtrain.config import Config, resolve_name
    from llmtrain.flops import flops_per_token, num_parameters
    from llmtrain.plan import lora_trainable_parameters

    defaults = SHORT_DEFAULTS if short else FULL_DEFAULTS
    micro_batch_size, seq_len, steps, warmup = (given if given is not None else default for given, default in
                                                zip((micro_batch_size, seq_len, steps, warmup), defaults))
    for flag, value, least in (("--micro_batch_size", micro_batch_size, 1), ("--seq_len", seq_len, 2),
                               ("--steps", steps, 1), ("--warmup", warmup, 0), ("--devices", devices, 1)):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
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
    results = Path(results) if results is not None else Path(out_dir) / "benchmarks.jsonl"
    _check_record_files(results, Path(baseline) if baseline is not None else None)
    if recipe != "finetune_lora" and lora != LoRAArgs():
        raise ValueError(f"--lora.* flags set the adapters of --recipe finetune_lora, not of --recipe {recipe}: "
                         "drop them or add --recipe finetune_lora")
    adapters = lora if recipe == "finetune_lora" else None
    try:
        deepspeed = strategy.startswith("deepspeed")  # DeepSpeed writes its own sharded files
        # NOTE: finetune_lora's checkpoints hold only the adapters and are always full.
        sharded = save_interval and not deepspeed and adapters is None
        fsdp = FSDPArgs(sharding_strategy=sharding_strategy, async_save=async_save,
                        state_dict_type="sharded" if sharded else "full",
                        activation_checkpointing=activation_checkpointing)
        global_batch_size = global_batch_size or default_global_batch(
            dict(micro_batch_size=micro_batch_size, devices=devices, tp_size=tp_size, pp_size=pp_size))
        train = _train_args(micro_batch_size, global_batch_size, seq_len, warmup + steps, save_interval)
        plan = ParallelPlan.resolve(devices=devices, num_nodes=1, precision=precision, fsdp=fsdp, train=train,
                                    strategy=strategy, tp=tp_size, pp=pp_size, pp_schedule=pp_schedule)
    except ValueError as error:
        raise ValueError(_in_benchmark_flags(str(error))) from None
    config = Config.from_name(model)
    if seq_len > config.block_size:
        raise ValueError(f"--seq_len {seq_len} exceeds {model}'s block size {config.block_size}")
    trainable = lora_trainable_parameters(config, adapters) if adapters is not None else num_parameters(config)
    flops = flops_per_token(config, seq_len, adapter_parameters=trainable if adapters is not None else None)
    dtype = plan.precision.compute_dtype
    threads = threads_per_process(devices)
    peak_device = plan.device_type
    print(f"layout: {plan.describe()}", flush=True)

    peak, peak_size = _matmul_peak(dtype, threads, peak_device)
    print(f"matmul peak: {peak / 1e9:,.1f} GFLOP/s ({dtype}, {threads} threads, best over n = "
          f"{', '.join(map(str, MATMUL_SIZES))}; measured again after the run)", flush=True)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=out_dir))
    try:
        _train(run_dir, model=model, plan=plan, fsdp=fsdp, train=train, compile=compile, strategy=strategy,
               recipe=recipe, lora=adapters)
        rows = _train_rows(run_dir / "train" / "metrics.csv")
        waits = [float(line) for line in (run_dir / "data_wait.txt").read_text().split()]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    # NOTE: a neighbour that slowed only the first measurement would inflate MFU; the faster of the two counts.
    peak, peak_size = max((peak, peak_size), _matmul_peak(dtype, threads, peak_device))

    timing = _step_timing(rows, waits, warmup, save_interval, plan.batch.grad_accum_steps)
    tokens_per_sec_per_device = global_batch_size * seq_len / timing["step_time_median_s"] / devices
    record = {
        "recipe": recipe, "model": model, "parameters": num_parameters(config), "trainable_parameters": trainable,
        "lora": dataclasses.asdict(adapters) if adapters is not None else None, "precision": plan.precision.name,
        "micro_batch_size": micro_batch_size, "seq_len": seq_len, "devices": devices, "strategy": strategy,
        "sharding_strategy": sharding_strategy, "compile": compile,
        "activation_checkpointing": fsdp.activation_checkpointing, "tp_size": tp_size, "pp_size": pp_size,
        "pp_schedule": plan.pp_schedule, "global_batch_size": global_batch_size,
        "save_interval": save_interval, "async_save": async_save,
        "steps": steps, "warmup": warmup, "tokens_per_sec_per_device": tokens_per_sec_per_device,
        "tokens_per_sec": tokens_per_sec_per_device * devices, **timing,
        "flops_per_token": flops, "matmul_peak_flops": peak,
        "matmul_peak_size": peak_size, "mfu": flops * tokens_per_sec_per_device / peak,
        "device": device_name(peak_device), "threads_per_process": threads, "torch": torch.__version__,
        "load_average": _load_average(), "commit": git_commit(), "command": _command_line(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    record = {key: record[key] for key in RECORD_FIELDS}
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
    return record


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


def _train_args(micro_batch_size: int, global_batch_size: int, seq_len: int, total_steps: int,
                save_interval: Optional[int]) -> TrainArgs:
    """A log row per step, checkpoints only as --save_interval says."""
    return TrainArgs(micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                     max_seq_length=seq_len, max_steps=total_steps, log_interval=1, lr_warmup_steps=1,
                     save_interval=save_interval)


def _matmul_peak(dtype: torch.dtype, threads: int, device: str) -> tuple[float, int]:
    """The matmul peak, measured in this process with the threads each training process has."""
    all_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure_matmul_peak(dtype, device=device)
    finally:
        torch.set_num_threads(all_threads)


def _train(run_dir: Path, *, model: str, plan: ParallelPlan, fsdp: FSDPArgs, train: TrainArgs,
           compile: bool, strategy: str = "auto", recipe: RecipeName = "pretrain",
           lora: Optional[LoRAArgs] = None, **extra: Any) -> None:
    """The recipe on the built-in corpus with the plan's layout, no validation; fine-tuning from random weights.
    ``extra`` goes to the recipe's setup as it is (``profile=ProfileArgs(...)`` for scripts/profile_step.py)."""
    from llmtrain.data import BuiltinStories
    from llmtrain.recipes import finetune, pretrain

    data = TimedData(BuiltinStories(), run_dir / "data_wait.txt")
    flags = dict(out_dir=run_dir / "train", precision=plan.precision.name, data=data, train=train,
                 eval=EvalArgs(interval=10**9, initial_validation=False, final_validation=False),
                 devices=plan.devices, fsdp=fsdp, compile=compile, tp_size=plan.tp, pp_size=plan.pp,
                 pp_schedule=plan.pp_schedule, strategy=strategy, **extra)
    if recipe == "pretrain":
        pretrain.setup(model_name=model, **flags)
        return
    base = write_random_model_dir(run_dir / "base", model, data.default_tokenizer())
    if recipe == "finetune_full":
        finetune.setup_full(base, **flags)
    else:
        finetune.setup_lora(base, **dataclasses.asdict(lora), **flags)


def write_random_model_dir(directory: Path, model: str, tokenizer: Any, seed: int = 0) -> Path:
    """A model directory of zoo model ``model`` with weights initialised as pretraining's are, under ``seed``,
    and ``tokenizer``: what the fine-tuning recipes take as CHECKPOINT_DIR."""
    from llmtrain.checkpoint.files import write_model_dir
    from llmtrain.config import Config
    from llmtrain.model import GPT

    config = Config.from_name(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gpt = GPT(config)
        gpt.init_weights()
    return write_model_dir(directory, state_dict=gpt.state_dict(), model_config=config, hyperparameters=None,
                           tokenizer=tokenizer)


def _step_timing(rows: list[dict], waits: list[float], warmup: int, save_interval: Optional[int] = None,
                 micro_batches_per_step: int = 1) -> dict:
    """Step-time statistics of the steps after ``warmup``, and the share of their time spent waiting for data.

    Step k's time is the loop's elapsed time at its log row minus that at the row before (a step whose
    update was skipped logs no row: the gap is shared out); each step fetches ``micro_batches_per_step``
    batches (the accumulation steps, also the micro-batches of a pipeline), so step k's are the ``next()``
    calls after the first (k - 1) × that many. With ``save_interval``, a checkpoint is
    written after every step k that it divides, so step k + 1's time holds the save's stall: those steps
    are left out of the statistics, and ``checkpoint_stall_s`` is their median time minus the others'.
    """
    timed, times, previous = [], {}, {"step": 0, "elapsed_s": 0.0}
    for row in sorted(rows, key=lambda row: row["step"]):
        if row["step"] > warmup:
            timed.append(row)
            gap = row["step"] - previous["step"]
            for step in range(previous["step"] + 1, row["step"] + 1):
                times[step] = (row["elapsed_s"] - previous["elapsed_s"]) / gap
        previous = row
    if not times or len(waits) < timed[-1]["step"] * micro_batches_per_step:
        raise RuntimeError(f"the benchmark run logged {len(times)} timed steps and {len(waits)} batch "
                           f"fetches; expected one row and {micro_batches_per_step} fetch(es) per step")
    after_save = {step for step in times if save_interval and (step - 1) % save_interval == 0 and step > 1}
    step_times = [time for step, time in times.items() if step not in after_save] or list(times.values())
    stalls = [times[step] for step in sorted(after_save)]
    quartiles = statistics.quantiles(step_times, n=4, method="inclusive") if len(step_times) > 1 else step_times * 3
    logged = [row["data_wait_fraction"] for row in timed if row["data_wait_fraction"] is not None]
    median = statistics.median(step_times)
    return {
        "step_time_median_s": median, "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times), "step_time_p25_s": quartiles[0], "step_time_p75_s": quartiles[2],
        "data_wait_fraction": sum(waits[warmup * micro_batches_per_step:timed[-1]["step"] * micro_batches_per_step])
                              / sum(times.values()),
        # The loop's own measure of the same wait, when its metrics have the column; a cross-check.
        "data_wait_fraction_logged": statistics.mean(logged) if logged else None,
        "peak_memory_gb": max(row["peak_memory_gb"] for row in timed),
        "checkpoint_saves": len(stalls),
        "checkpoint_stall_s": statistics.median(stalls) - median if stalls else None,
        "checkpoint_stall_max_s": max(stalls) - median if stalls else None,
    }


def _train_rows(path: Path) -> list[dict]:
    """The training rows of metrics.csv (validation rows have no loss)."""
    import csv

    with open(path) as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("loss")]

    def number(row: dict, key: str) -> Optional[float]:
        return float(row[key]) if row.get(key) not in (None, "") else None

    return [{"step": int(row["step"]), "elapsed_s": number(row, "elapsed_s"),
             "peak_memory_gb": number(row, "peak_memory_gb") or 0.0,
             "data_wait_fraction": number(row, "data_wait_fraction")} for row in rows]


def _command_line() -> str:
    """The command as typed: ``llmtrain benchmark ...`` or ``scripts/benchmark.py ...`` (which passes 'benchmark')."""
    arguments = sys.argv[1:]
    if arguments[:1] == ["benchmark"]:
        arguments = arguments[1:]
    return shlex.join(["llmtrain", "benchmark", *arguments])


def baseline_key(record: dict) -> str:
    """The machine and setting a baseline belongs to. The machine is the device's model (a CPU's with its core
    count), since another CPU is another speed. Threads are part of the setting: on a shared box a run with one
    thread per process is steadier than one whose OpenMP threads wait for each other behind other work. A setting
    left at its default adds nothing, so keys stay those of the runs recorded before it was a flag."""
    key = "|".join(str(record[k]) for k in ("device", "model", "precision", "micro_batch_size", "seq_len",
                                            "devices", "compile", "threads_per_process"))
    split = [f"{name} {record.get(name)}" for name in ("tp_size", "pp_size") if (record.get(name) or 1) > 1]
    if record.get("strategy", "auto") not in ("auto", "fsdp"):
        split.append(record["strategy"])
    if record.get("sharding_strategy") not in (None, "FULL_SHARD"):  # FULL_SHARD: the default on one node
        split.append(record["sharding_strategy"])
    if record.get("global_batch_size", default_global_batch(record)) != default_global_batch(record):
        split.append(f"global batch {record['global_batch_size']}")  # accumulation: fewer optimizer steps per token
    if record.get("activation_checkpointing"):
        split.append(f"activation checkpointing {record['activation_checkpointing']}")
    if record.get("recipe", "pretrain") != "pretrain":  # a pretraining key stays as it was before --recipe
        split.append(record["recipe"])
    if record.get("lora"):
        split.append(_lora_words(record["lora"]))
    return "|".join([key, *split])


def default_global_batch(record: dict) -> int:
    """--global_batch_size's default for a record's setting: micro batch × data-parallel ranks × pipeline stages."""
    tp, pp, devices = record.get("tp_size") or 1, record.get("pp_size") or 1, record["devices"]
    data_parallel = data_parallel_ranks(devices, tp, pp) or devices
    return record["micro_batch_size"] * data_parallel * pp


def _lora_words(lora: dict) -> str:
    """"r 8, alpha 16, dropout 0.05 on query, value": the adapters a finetune_lora record timed."""
    targets = [name.removeprefix("lora_") for name in ("lora_query", "lora_key", "lora_value", "lora_projection",
                                                       "lora_mlp", "lora_head") if lora[name]]
    return f"r {lora['lora_r']}, alpha {lora['lora_alpha']}, dropout {lora['lora_dropout']:g} on {', '.join(targets)}"


def _checkpointing_words(record: dict) -> str:
    mode = record.get("activation_checkpointing")
    return f", activation checkpointing {mode}" if mode else ""


def _load_average() -> Optional[float]:
    """The machine's 1-minute load average at the end of the run: numbers taken next to other work are noisy."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def machine_baseline_file() -> Path:
    """Where a machine that the repository has no baseline for keeps its own: the llmtrain cache."""
    from llmtrain.data.tokens import cache_dir

    return cache_dir() / "benchmark_baseline.json"


def _baseline_files(path: Path) -> list[Path]:
    """The files a baseline is looked up in: ``path``, and for the default the machine's own file after it."""
    return [path, machine_baseline_file()] if path == DEFAULT_BASELINE else [path]


def _read_baseline(file: Path) -> dict:
    """A baseline file's {key: numbers}; {} for a file not there yet. Raises naming the file when it is not one."""
    if not file.exists():
        return {}
    if file.is_dir():
        raise ValueError(f"baseline file {file} is a folder; pass --baseline a JSON file (it is created when missing)")
    try:
        stored = json.loads(file.read_text())
    except ValueError as error:
        raise ValueError(f"baseline file {file} is not valid JSON ({error}); fix it, delete it (the next run "
                         "records a new baseline) or pass another --baseline") from None
    if not isinstance(stored, dict):
        raise ValueError(f"baseline file {file} holds a {type(stored).__name__}, not an object of baselines by "
                         "machine and setting; fix it, delete it or pass another --baseline")
    return stored


def _check_record_files(results: Path, baseline: Optional[Path]) -> None:
    """Before the run, not after it: --results is no folder, and the baselines it compares with parse."""
    if results.is_dir():
        raise ValueError(f"--results {results} is a folder; name the JSON-lines file to append to, e.g. "
                         f"{results / 'benchmarks.jsonl'}")
    for file in _baseline_files(baseline) if baseline is not None else []:
        _read_baseline(file)


def _stored_baseline(record: dict, path: Path) -> Optional[dict]:
    """The baseline for this machine and setting: from ``path`` (for the default, the repository's file and then
    :func:`machine_baseline_file`). Where none is stored, this run becomes it (in ``path``, or for the default in
    the machine's file, never in the repository) and None is returned: there is nothing to compare with yet."""
    key = baseline_key(record)
    files = _baseline_files(path)
    for file in files:
        stored = _read_baseline(file)
        if key in stored:
            return stored[key]
    target = files[-1]
    stored = _read_baseline(target)
    stored[key] = {name: record[name] for name in ("tokens_per_sec_per_device", "mfu", "commit", "device", "torch",
                                                   "load_average", "time", "command")}
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(stored, indent=2) + "\n")
    os.replace(partial, target)  # never a half-written file
    print(f"no baseline for this machine and setting ({key}) in {' or '.join(map(str, files))}: this run "
          f"({record['tokens_per_sec_per_device']:,.0f} tokens/s) is now the baseline, in {target}")
    return None


def _print_table(record: dict) -> None:
    ms = {key: record[key] * 1000 for key in record if key.startswith("step_time_")}
    logged = record["data_wait_fraction_logged"]
    lines = [
        ("setting", f"{_recipe_words(record)}{record['model']} ({record['parameters'] / 1e6:.1f}M) "
                    f"{record['precision']}, micro batch "
                    f"{record['micro_batch_size']} × seq {record['seq_len']}, {record['devices']} process(es)"
                    f"{' ' + record['sharding_strategy'] if record['sharding_strategy'] else ''}"
                    f"{' ' + record['strategy'] if record.get('strategy', 'auto') != 'auto' else ''}"
                    f"{_split_words(record)}, global batch {record['global_batch_size']}"
                    f"{', compiled' if record['compile'] else ''}"
                    f"{_checkpointing_words(record)}"),
        ("device", f"{record['device']}, {record['threads_per_process']} threads per process, torch {record['torch']}"),
        ("tokens/s per device", f"{record['tokens_per_sec_per_device']:,.0f} ({record['tokens_per_sec']:,.0f} in all)"),
        ("step time", f"median {ms['step_time_median_s']:.1f} ms, IQR {ms['step_time_p25_s']:.1f}–"
                      f"{ms['step_time_p75_s']:.1f}, min {ms['step_time_min_s']:.1f}, max "
                      f"{ms['step_time_max_s']:.1f} over {record['steps']} steps after {record['warmup']}"),
        ("matmul peak", f"{record['matmul_peak_flops'] / 1e9:,.1f} GFLOP/s (measured, n = "
                        f"{record['matmul_peak_size']})"),
        ("MFU", f"{record['mfu']:.1%} ({record['flops_per_token'] / 1e6:,.1f} MFLOP per token)"),
        ("waiting for data", f"{record['data_wait_fraction']:.2%} of step time"
                             + (f" (the loop's log: {logged:.2%})" if logged is not None else "")),
        ("peak memory", f"{record['peak_memory_gb']:.2f} GB"),
        *([("checkpoint stall", f"median {record['checkpoint_stall_s']:.3f} s, max "
                                f"{record['checkpoint_stall_max_s']:.3f} s over {record['checkpoint_saves']} "
                                f"{'asynchronous' if record['async_save'] else 'synchronous'} sharded saves")]
          if record["checkpoint_saves"] else []),
        ("load average", f"{record['load_average']} on {os.cpu_count()} cores"
                         + (" (other work ran alongside: noisy numbers)" if _busy(record) else "")),
    ]
    width = max(len(name) for name, _ in lines)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in lines))


def _recipe_words(record: dict) -> str:
    """"finetune_lora (r 8, ... ; 0.1M trainable) of " before the model, nothing for pretraining."""
    if record["recipe"] == "pretrain":
        return ""
    adapters = f"{_lora_words(record['lora'])}; " if record["lora"] else ""
    return f"{record['recipe']} ({adapters}{record['trainable_parameters'] / 1e6:.2f}M trainable) of "


def _split_words(record: dict) -> str:
    """", tp 2, pp 2 (1f1b)" for a run that splits the model, else nothing."""
    words = [f"tp {record['tp_size']}"] if record["tp_size"] > 1 else []
    words += [f"pp {record['pp_size']} ({record['pp_schedule']})"] if record["pp_size"] > 1 else []
    return "".join(f", {word}" for word in words)


def _busy(record: dict) -> bool:
    """More runnable work than cores at the end (this run's own threads included) means it shared them."""
    return record["load_average"] is not None and record["load_average"] > (os.cpu_count() or 1) + 0.5
