"""What every recipe runs: ``prepare()`` in the launching process, then ``run(spec)`` on every rank.

A recipe's ``setup()`` resolves its model and weights, then calls :func:`prepare`, which checks every flag
cheaply (out_dir, logger, the parallel plan, the launcher's environment, sequence length, disk space, the
data module's files), prints the dry run when one was asked for, and otherwise fills a :class:`RunSpec`
(plain, picklable data, so spawned workers can receive it) and launches ``run`` on every rank. ``run``
builds the runtime, data, model, optimizer and checkpointer the same way for pretraining and both
fine-tuning recipes, and calls the one ``fit()``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from llmtrain.args import BatchDefaults, DryRunArgs, EvalArgs, FSDPArgs, ProfileArgs, TrainArgs
from llmtrain.config import Config
from llmtrain.data.base import DataModule
from llmtrain.data.streaming import check_stream_resume
from llmtrain.data.tokens import cache_dir
from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint import lock as out_dir_lock
from llmtrain.checkpoint.checkpointer import Checkpointer, build_checkpointer
from llmtrain.checkpoint.layout import CONFIG_FILE
from llmtrain.checkpoint.lora import write_lora_settings
from llmtrain.checkpoint.resume import (check_deepspeed_resume, check_resume_lora, check_resume_model,
                                        check_resume_optimizer, resume_fallbacks)
from llmtrain.checkpoint.size import check_disk_space, final_is_separate
from llmtrain.checkpoint.state import load_training_state
from llmtrain.distributed.launch import invocation, is_first_process, launch, plan_launch, resolve_devices
from llmtrain.distributed.parallel_plan import DEEPSPEED_STRATEGIES, ParallelPlan, resolve_device_type
from llmtrain.distributed.parallelize import unwrap
from llmtrain.distributed.pipeline import build_pipeline
from llmtrain.distributed.runtime import Runtime, configure_process
from llmtrain.flops import device_peak_flops, flops_per_token
from llmtrain.lora import LoRAArgs
from llmtrain.optim import OptimizerArg, build_optimizer
from llmtrain.plan.memory import estimate_memory
from llmtrain.plan.report import dry_run
from llmtrain.plan.search import check_state_fits
from llmtrain.prompts import save_prompt_style
from llmtrain import compiling
from llmtrain.compiling import CompileSetting
from llmtrain.recipes import build, checks, hparams
from llmtrain.recipes.flags import LoggerName
from llmtrain.tokenizer import Tokenizer
from llmtrain.train.horizon import plan_horizon, step_limits
from llmtrain.train.loggers import build_loggers
from llmtrain.train.loop import Fit, TrainState, fit
from llmtrain.train.metrics import data_metrics
from llmtrain.train.nonfinite import NonFiniteError, Rewind
from llmtrain.train.profile import build_profiler
from llmtrain.train.schedule import check_min_lr
from llmtrain.signals import catch_stop_signals


@dataclass
class RunSpec:
    """Everything a rank needs to train; built by :func:`prepare` after its checks."""

    recipe: str
    config: Config
    out_dir: Path
    plan: ParallelPlan
    """The layout, batch plan and precision, resolved once in the launching process."""
    data: DataModule
    train: TrainArgs
    eval: EvalArgs
    optimizer: OptimizerArg
    seq_len: int
    hyperparameters: dict
    fsdp: FSDPArgs
    """The checkpoint format settings (state_dict_type, async_save); the layout ones are in ``plan``."""
    seed: int = 42
    compile: CompileSetting = False
    logger_name: LoggerName = "csv"
    resume_from: Optional[Path] = None
    resume_fallbacks: tuple[Path, ...] = ()
    """What the ranks resume from instead when they find ``resume_from`` damaged (resume.resume_fallbacks)."""
    initial_checkpoint_dir: Optional[Path] = None
    """Weights to start from (pretraining's --initial_checkpoint_dir, fine-tuning's CHECKPOINT_DIR)."""
    tokenizer_dir: Optional[Path] = None
    lora: Optional[LoRAArgs] = None
    """The adapters' settings for finetune_lora, else None."""
    quantize: Optional[str] = None
    prompt_style: Optional[str] = None
    """Fine-tuning: a prompt style name; None takes the checkpoint's own, else the model family's."""
    profile: Optional[ProfileArgs] = None
    """--profile's settings when profiling was asked for; None builds no profiler."""
    deepspeed_config: Optional[dict] = None
    """The DeepSpeed config under a ``deepspeed`` strategy (llmtrain_deepspeed.config.build_config), else None."""
    dist_timeout: float = 600.0
    """--dist_timeout: seconds a collective may wait (the default process group's timeout)."""
    command: list[str] = field(default_factory=list)
    """The command line that started the run (llmtrain.distributed.launch.invocation), for a diverged run's advice."""


def prepare(recipe: str, flags: dict[str, Any], *, config: Config, resume_from: Optional[Path],
            initial_checkpoint_dir: Optional[Path] = None, tokenizer_dir: Optional[Path] = None,
            lora: Optional[LoRAArgs] = None, quantize: Optional[str] = None, prompt_style: Optional[str] = None,
            trainable_parameters: Optional[int] = None, hyperparameters: dict,
            batch_defaults: BatchDefaults = BatchDefaults()) -> None:
    """Check everything cheap, then print the dry run or launch ``run`` on every rank.

    ``flags`` are the shared recipe flags (llmtrain.recipes.flags); ``batch_defaults`` fill the batch sizes
    they leave unset. Every bad combination raises
    ``ValueError`` here, before any worker, tokenizer or model exists; under torchrun or srun every rank
    raises the same one before the process group is created.
    """
    train, fsdp, dry = flags["train"], flags["fsdp"], flags["dry_run"]
    if flags["dist_timeout"] <= 0:
        raise ValueError(f"--dist_timeout {flags['dist_timeout']:g} must be a positive number of seconds (default 600)")
    seq_len = checks.check_seq_len(train, config)
    devices = _devices(flags, dry)
    layout = dict(devices=devices, num_nodes=flags["num_nodes"], train=train, precision=flags["precision"],
                  strategy=flags["strategy"], fsdp=fsdp, batch_defaults=batch_defaults, tp=flags["tp_size"],
                  pp=flags["pp_size"], sequence_parallel=flags["tp_sequence_parallel"],
                  pp_schedule=flags["pp_schedule"], pp_virtual_stages=flags["pp_virtual_stages"],
                  zero=_zero_from_file(flags))
    profile = flags["profile"] if flags["profile"].requested else None
    if dry.requested:
        plan = ParallelPlan.resolve(**layout, accelerator=flags["accelerator"], device_type=dry.device_type or
                                    resolve_device_type(flags["accelerator"], here=False), gpu=dry.gpu,
                                    strict_batch=False)
        _check_model_split(plan, config, seq_len, lora=lora, quantize=quantize)
        if profile is not None:
            _check_profile_window(profile, _with_batch(train, plan), seq_len)
        _check_optimizer(hparams.optimizer_spec(flags["optimizer"]), train)  # a bad argument fails a dry run too
        dry_run(recipe=recipe, config=config, plan=plan, train=_with_batch(train, plan), seq_len=seq_len, dry=dry,
                fsdp=fsdp, out_dir=flags["out_dir"], quantize=quantize, trainable_parameters=trainable_parameters,
                compile=flags["compile"])
        if dry.simulate:
            from llmtrain.recipes.simulate import run_simulation  # NOTE: imports torch's fake tensors, only when asked

            run_simulation(config, plan, seq_len=seq_len, train=_with_batch(train, plan), optimizer=flags["optimizer"],
                           lora=lora, quantize=quantize, seed=flags["seed"])
        return
    plan_launch(devices, flags["num_nodes"])  # the launcher's environment agrees with the flags
    plan = ParallelPlan.resolve(**layout, accelerator=flags["accelerator"])
    _check_model_split(plan, config, seq_len, lora=lora, quantize=quantize)
    source = (str(Path(initial_checkpoint_dir) / CONFIG_FILE) if initial_checkpoint_dir is not None
              else f"model {config.name}" if config.name in Config.names() else "--model_config")
    check_state_fits(config, plan, dry, source=source, trainable_parameters=trainable_parameters, quantize=quantize)
    train = _with_batch(train, plan)
    if profile is not None:
        _check_profile_window(profile, train, seq_len)
    hyperparameters["optimizer"] = hparams.optimizer_spec(flags["optimizer"])  # checks the optimizer's arguments
    _check_optimizer(hyperparameters["optimizer"], train)
    if isinstance(hyperparameters.get("train"), dict):  # the checkpoint records the batch this run used
        hyperparameters["train"].update(global_batch_size=train.global_batch_size,
                                        micro_batch_size=train.micro_batch_size)
    deepspeed_config = _deepspeed_config(plan, train, flags, resume_from) if plan.wrapper == "deepspeed" else None
    if resume_from is not None:  # here, not in the workers: one message, before any of them starts
        check_deepspeed_resume(resume_from, deepspeed=deepspeed_config is not None,
                               zero_stage=plan.zero.stage if plan.zero else None,
                               bf16=plan.precision.name == "bf16-mixed")
        check_resume_model(resume_from, config)
        check_resume_lora(resume_from, lora, quantize)
        check_resume_optimizer(resume_from, hyperparameters["optimizer"])
        check_stream_resume(load_training_state(resume_from, mmap=True)["data"],
                            streaming=getattr(flags["data"], "streaming", False),
                            data_parallel_size=plan.data_parallel_size, checkpoint=f"--resume {resume_from}")
    check_disk_space(flags["out_dir"], config, plan.precision, trainable_parameters=trainable_parameters,
                     separate_final=final_is_separate(flags["fsdp"].state_dict_type, plan))
    flags["data"].validate()
    if tokenizer_dir is not None:  # a prepared folder's tokenizer is checked here, not after launch on every rank
        flags["data"].validate_tokenizer(Tokenizer(tokenizer_dir))
    spec = RunSpec(recipe=recipe, config=config, out_dir=Path(flags["out_dir"]), plan=plan, data=flags["data"],
                   train=train, eval=flags["eval"], optimizer=flags["optimizer"], seq_len=seq_len,
                   hyperparameters=hyperparameters, fsdp=fsdp, seed=flags["seed"], compile=flags["compile"],
                   logger_name=flags["logger_name"], resume_from=resume_from,
                   resume_fallbacks=resume_fallbacks(flags["resume"], resume_from),
                   initial_checkpoint_dir=initial_checkpoint_dir, tokenizer_dir=tokenizer_dir, lora=lora,
                   quantize=quantize, prompt_style=prompt_style, profile=profile, dist_timeout=flags["dist_timeout"],
                   deepspeed_config=deepspeed_config, command=invocation())
    if spec.lora is not None and spec.fsdp.async_save:
        raise ValueError("--fsdp.async_save is for sharded checkpoints; LoRA checkpoints hold only the "
                         "adapters and are written by rank 0: drop --fsdp.async_save")
    # One writer per out_dir, for the whole run: the launching process (rank 0 under torchrun or srun) holds the lock.
    with out_dir_lock.hold(spec.out_dir) if is_first_process() else contextlib.nullcontext():
        launch(run, args=(spec,), devices=plan.devices, num_nodes=plan.num_nodes)


def _resumed_step(resume_from: Optional[Path]) -> int:
    """The step a ``--resume`` checkpoint directory holds, from its name (``step-00000400``); 0 without one."""
    match = layout.STEP_DIR.match(Path(resume_from).name) if resume_from is not None else None
    return int(match.group(1)) if match else 0


def _devices(flags: dict[str, Any], dry: DryRunArgs) -> int:
    """``--devices`` as a number: ``auto`` / ``-1`` read from the launcher or this node's GPUs (said once)."""
    if dry.requested and dry.gpu is not None and flags["devices"] in ("auto", -1) and not torch.cuda.is_available():
        print(f"--devices {flags['devices']}: this machine has no {dry.gpu} to count, so the plan is for one per node; "
              "pass --devices N for a full node")
        return 1
    device_type = resolve_device_type(flags["accelerator"], here=not dry.requested)
    devices, how = resolve_devices(flags["devices"], flags["num_nodes"], device_type)
    if how and not (devices == 1 and device_type == "cpu") and is_first_process():
        print(f"--devices {flags['devices']}: {devices} per node ({how})")
    return devices


def _zero_from_file(flags: dict[str, Any]) -> Any:
    """The ZeRO settings of ``--deepspeed.config``, if one was given (read without importing deepspeed)."""
    path = flags["deepspeed"].config
    if path is None:
        return None
    from llmtrain_deepspeed import config as ds_config  # NOTE: the extension, only for a DeepSpeed run

    return ds_config.zero_settings(ds_config.read_config(path), path, DEEPSPEED_STRATEGIES.get(flags["strategy"]))


def _deepspeed_config(plan: ParallelPlan, train: TrainArgs, flags: dict[str, Any],
                      resume_from: Optional[Path]) -> dict:
    """The run's DeepSpeed config: deepspeed must be installed, and the file must agree with the flags. A resume
    on another number of processes than the checkpoint's loads it as DeepSpeed's universal checkpoint."""
    from llmtrain_deepspeed import config as ds_config

    ds_config.require_deepspeed(flags["strategy"])
    path = flags["deepspeed"].config
    config = ds_config.build_config(plan, train, ds_config.read_config(path) if path is not None else None, path)
    return ds_config.resume_config(config, resume_from, plan.world_size) if resume_from is not None else config


def _check_model_split(plan: ParallelPlan, config: Config, seq_len: int, *, lora: Optional[LoRAArgs],
                       quantize: Optional[str]) -> None:
    """Tensor and pipeline parallelism against the model and the recipe, before anything is built."""
    plan.check_model(config, seq_len)
    if quantize is not None and plan.splits_model:
        raise ValueError(f"--quantize {quantize} (QLoRA) keeps each 4-bit or int8 weight whole on one device, so it "
                         "cannot be split by --tp_size or --pp_size: drop --quantize (plain LoRA), or use data "
                         "parallelism alone")
    if lora is not None and plan.splits_model:
        raise ValueError("finetune_lora trains with data parallelism only: drop --tp_size and --pp_size (the "
                         "frozen base model can be sharded with --strategy fsdp instead), or use finetune_full")


def _check_optimizer(spec: dict, train: TrainArgs) -> None:
    """The schedule against the optimizer's rate (``--train.min_lr`` at most ``--optimizer.lr``), before any worker
    loads a model only for the schedule to refuse it."""
    lr = spec["init_args"].get("lr")
    if isinstance(lr, (int, float)):
        check_min_lr(train.min_lr, lr, train.lr_decay)


def _with_batch(train: TrainArgs, plan: ParallelPlan) -> TrainArgs:
    """``train`` with the batch sizes the plan chose where the flags left them unset."""
    return replace(train, global_batch_size=plan.batch.global_batch_size, micro_batch_size=plan.batch.micro_batch_size)


def _check_profile_window(profile: ProfileArgs, train: TrainArgs, seq_len: int) -> None:
    """The window against the run's length where the flags give it; a run that --train.epochs sizes learns
    its length once the data is set up, and ``_run`` checks it then, before the model is built."""
    limits = step_limits(train, train.global_batch_size * seq_len, samples_per_epoch=None)
    if limits:
        set_by, last_step = min(limits.items(), key=lambda limit: limit[1])
        profile.check_within(last_step, set_by)


def run(spec: RunSpec) -> None:
    """One rank's training run. Every process of the job executes this.

    SIGTERM and SIGUSR1 are caught once the ranks have met, so one that arrives while the model is
    built still stops the run cleanly after its first step (exit code 75, see llmtrain.signals);
    before that, nothing is lost when they end the process.
    """
    runtime = Runtime.for_plan(spec.plan, timeout_s=spec.dist_timeout)
    try:
        with catch_stop_signals():
            _run(spec, runtime)
    finally:
        if spec.plan.world_size == 1:  # one-rank FSDP's own group: the process goes on (a test, a notebook)
            runtime.shutdown()


def _check_shared_folders(spec: RunSpec, runtime: Runtime) -> None:
    """Several nodes: every rank writes and reads checkpoints in out_dir, and a module that tokenizes into the
    token cache tokenizes once only if the nodes share it; say so before any work instead of working per node."""
    blind = runtime.ranks_not_seeing(spec.out_dir)
    if blind:
        raise ValueError(f"--out_dir {spec.out_dir} is not the same folder on every node: rank(s) {blind} do not see "
                         "what rank 0 wrote there, and every rank writes and reads checkpoints in it. Put it on a "
                         "filesystem every node shares")
    if spec.data.uses_token_cache():
        cache = cache_dir()
        blind = runtime.ranks_not_seeing(cache / "tokens")
        if blind:
            raise ValueError(f"The token cache {cache} is not shared by every node: rank(s) {blind} do not see it, so "
                             f"each node would tokenize --data {type(spec.data).__name__} itself. Set "
                             "LLMTRAIN_CACHE_DIR to a folder every node shares, or prepare the data once with "
                             "`llmtrain prepare_data ... --out_dir SHARED` and train with --data Prepared "
                             "--data.path SHARED")


def _run(spec: RunSpec, runtime: Runtime) -> None:
    configure_process(runtime, spec.plan.precision)
    plan = spec.plan
    say = print if runtime.is_main else (lambda *a, **k: None)
    if plan.num_nodes > 1:
        _check_shared_folders(spec, runtime)

    with runtime.main_process_first():
        tokenizer = build.resolve_tokenizer(spec.tokenizer_dir, spec.data, spec.resume_from,
                                            spec.initial_checkpoint_dir)
        build.check_vocab(tokenizer, spec.config, str(spec.tokenizer_dir or spec.initial_checkpoint_dir
                                                      or "the data module"))
        prompt_style = _connect_data(spec, tokenizer, plan.batch.micro_batch_size)
        spec.data.prepare_data()
    spec.data.setup(runtime.data_parallel_rank, runtime.data_parallel_size)
    train_loader = spec.data.train_dataloader()
    val_loader = spec.data.val_dataloader()
    horizon = plan_horizon(spec.train, plan.batch.global_batch_size * spec.seq_len, train_loader.samples_per_epoch)
    if spec.profile is not None:  # a run sized by --train.epochs knows its length only now, before the model
        spec.profile.check_within(horizon.total_steps, horizon.set_by)

    started = time.perf_counter()
    compiled = compiling.agree(compiling.choose(
        spec.compile, recipe=spec.recipe, config=spec.config, plan=plan, seq_len=spec.seq_len,
        total_steps=horizon.total_steps - _resumed_step(spec.resume_from), max_time=horizon.max_time,
        device=runtime.device, quantize=spec.quantize), runtime)
    model = build.build_model(spec.config, plan=plan, runtime=runtime, seed=spec.seed, compile=compiled.enabled,
                              initial_checkpoint_dir=spec.initial_checkpoint_dir, lora=spec.lora,
                              quantize=spec.quantize, deepspeed_config=spec.deepspeed_config)
    gpt = unwrap(model)
    gpt.max_seq_length = spec.seq_len
    counted = gpt.whole_model() if plan.pp > 1 else gpt  # a pipeline rank holds only its own stages
    # FSDP2 parameters report their full size; ZeRO stage 3's keep it in ds_numel (their own numel is 0).
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in counted.parameters())
    n_trainable = sum(getattr(p, "ds_numel", p.numel()) for p in counted.parameters() if p.requires_grad)
    torch.manual_seed(spec.seed + runtime.rank)  # dropout and sampling differ per rank, reproducibly
    optimizer = build_optimizer(spec.optimizer, [p for p in model.parameters() if p.requires_grad])
    scaler = plan.precision.grad_scaler(runtime.device)
    strategy = None  # torch's own (llmtrain.train.strategy.TorchStrategy)
    if spec.deepspeed_config is not None:
        from llmtrain_deepspeed.engine import DeepSpeedStrategy, initialize

        model, scaler, strategy = initialize(model, optimizer, spec.deepspeed_config, runtime), None, DeepSpeedStrategy
    state = TrainState()
    checkpointer = _build_checkpointer(spec, runtime=runtime, model=model, optimizer=optimizer,
                                       train_loader=train_loader, tokenizer=tokenizer, scaler=scaler,
                                       write_extras=_extras_writer(spec, prompt_style))
    if spec.resume_from is not None:
        resumed = checkpointer.resume(spec.resume_from, spec.resume_fallbacks, state)
        say(f"resumed from {resumed} at step {state.step} ({state.tokens:,} tokens)")
        if runtime.is_main and (moved := files.set_aside_newer(spec.out_dir, resumed)):
            say(f"moved the {len(moved)} newer checkpoint(s) of the branch this run rewinds into "
                f"{moved[0].parent} (--resume auto would have picked them after a crash)")
    say(f"{spec.recipe}: model {spec.config.name or 'custom'}, {n_params / 1e6:.2f}M parameters "
        f"({n_trainable / 1e6:.2f}M trainable), built in {time.perf_counter() - started:.1f}s, "
        f"{horizon.total_steps} steps of seq {spec.seq_len}{', compiled blocks' if compiled.enabled else ''}")
    if spec.compile == "auto":
        say(compiled.reason)
    say(f"layout: {plan.describe()} | device {runtime.device}")
    memory = estimate_memory(spec.config, plan=plan, seq_len=spec.seq_len, trainable_parameters=n_trainable,
                             quantize=spec.quantize)
    say(f"memory per device (estimate): {memory.describe()}")
    profiler = None
    if spec.profile is not None:
        profiler = build_profiler(spec.profile, spec.out_dir, runtime.rank, runtime.device, first_step=state.step + 1,
                                  last_step=horizon.total_steps, say=say)

    pipeline = build_pipeline(model, plan, runtime) if plan.pp > 1 else None
    rewind = Rewind(checkpoint=spec.resume_from, command=spec.command, on_good=checkpointer.prune)
    job = Fit(runtime=runtime, model=model, optimizer=optimizer, train_loader=train_loader, val_loader=val_loader,
              train=spec.train, eval=spec.eval, plan=plan.batch, horizon=horizon, precision=plan.precision,
              save_checkpoint=lambda state: checkpointer.save(state, good=rewind.checkpoint),
              save_final=checkpointer.save_final,
              wait_for_checkpoint=checkpointer.wait,
              loggers=build_loggers(spec.logger_name, spec.out_dir, state.step if spec.resume_from else None,
                                    spec.hyperparameters, data_columns=list(data_metrics(train_loader)))
              if runtime.is_main else [],
              flops_per_token=flops_per_token(spec.config, spec.seq_len,
                                              adapter_parameters=n_trainable if spec.lora is not None else None),
              peak_flops_per_device=device_peak_flops(runtime.device, plan.precision.compute_dtype),
              state=state, scaler=scaler, autocast_enabled=not plan.mixed_precision_policy,
              grad_sync_only_last=plan.grad_sync_only_last,
              after_validation=_example_generator(spec, model, tokenizer, prompt_style, val_loader),
              callbacks=[profiler] if profiler is not None else [],
              pipeline=pipeline, pp_mesh=pipeline.pp_mesh if pipeline is not None else None, strategy=strategy,
              rewind=rewind)
    try:
        fit(job)
    except NonFiniteError:
        if runtime.is_main:
            _set_aside_diverged(spec.out_dir, rewind, say)
        raise
    finally:  # a streaming loader's reading thread stops here, not mid-chunk as the interpreter exits
        for loader in (train_loader, val_loader):
            close = getattr(loader, "close", None)
            if callable(close):
                close()
    say(f"done: {state.step} steps, {state.tokens:,} tokens in {state.elapsed_s:.0f}s; "
        f"final model in {spec.out_dir / layout.FINAL_DIR}")


def _set_aside_diverged(out_dir: Path, rewind: Rewind, say: Callable[[str], None]) -> None:
    """After a stop for divergence, move the checkpoints newer than the last good one (written before the streak,
    from weights that then gave a NaN or inf gradient) where --resume auto does not look, so that it picks the good
    one (llmtrain.train.nonfinite.Rewind)."""
    moved = files.set_aside_newer(out_dir, rewind.checkpoint)
    if moved:
        say(f"moved {', '.join(path.name for path in moved)} into {moved[0].parent}: the weights it holds gave NaN or "
            "inf gradients after it was written")


def _connect_data(spec: RunSpec, tokenizer: Any, micro_batch_size: int) -> Any:
    """Connect the data module; instruction data also gets the prompt style, which is returned."""
    from llmtrain.data.instruct import InstructDataModule, pad_multiple

    if not isinstance(spec.data, InstructDataModule):
        spec.data.connect(tokenizer, micro_batch_size, spec.seq_len, spec.seed)
        return None
    from llmtrain.prompts import PromptStyle, checkpoint_prompt_style

    if spec.prompt_style is not None:
        style = PromptStyle.from_name(spec.prompt_style)
    else:
        style = checkpoint_prompt_style(spec.initial_checkpoint_dir, spec.config)
    spec.data.connect(tokenizer, micro_batch_size, spec.seq_len, spec.seed, prompt_style=style,
                      pad_multiple=pad_multiple(spec.compile is True,
                                                spec.plan.tp if spec.plan.sequence_parallel else 1))
    return spec.data.resolved_prompt_style


def _extras_writer(spec: RunSpec, prompt_style: Any) -> Optional[Callable[[Path], None]]:
    """Files a checkpoint carries besides weights: the prompt style, LoRA's settings."""
    if prompt_style is None and spec.lora is None:
        return None

    def write(directory: Path) -> None:
        if prompt_style is not None:
            save_prompt_style(prompt_style, directory)
        if spec.lora is not None:
            write_lora_settings(directory, spec.lora, spec.initial_checkpoint_dir, spec.quantize)

    return write


EXAMPLE_TOKENS = 64
"""Most tokens the validation example decodes."""
SHARDED_EXAMPLE_TOKENS = 16
"""Most tokens it decodes under FSDP."""


def example_tokens(plan: ParallelPlan, seq_len: int) -> int:
    """How many tokens the validation example may decode: 64, 16 under FSDP, at most half the sequence.

    NOTE: under FSDP each decoded token is a forward that gathers every layer from every rank (across
    nodes, too) for one token's worth of compute; 16 tokens still show whether the answers take shape.
    """
    limit = SHARDED_EXAMPLE_TOKENS if plan.wrapper == "fsdp" else EXAMPLE_TOKENS
    return min(limit, seq_len // 2)


def _example_generator(spec: RunSpec, model: Any, tokenizer: Any, prompt_style: Any,
                       val_loader: Any) -> Optional[Callable[[], str]]:
    """Fine-tuning prints one greedy answer to the first validation prompt after each validation
    (:func:`example_tokens` long at most).

    Greedy decoding keeps every rank's step count equal, which a sharded model's forward needs. None (no
    example) when tensor or pipeline parallelism splits the model: decoding with the KV cache runs on a whole model.
    """
    prompts = spec.data.validation_prompts() if hasattr(spec.data, "validation_prompts") else []
    if prompt_style is None or not prompts or spec.plan.splits_model:  # no validation set: no prompt to answer
        return None
    from llmtrain.generate import PromptTooLongError, generate_text

    prompt = prompts[0]
    max_new_tokens = example_tokens(spec.plan, spec.seq_len)

    def example() -> str:
        try:
            answer = generate_text(model, tokenizer, prompt_style, prompt, max_new_tokens=max_new_tokens)
        except PromptTooLongError:  # an example is a courtesy; it must never stop training
            return f"example | skipped: the first validation prompt is longer than --train.max_seq_length {spec.seq_len}"
        return f"example | {prompt[-1]['content']!r} -> {answer!r}"

    return example


def _build_checkpointer(spec: RunSpec, **arguments: Any) -> Checkpointer:
    if spec.deepspeed_config is not None:
        from llmtrain_deepspeed.checkpoint import DeepSpeedCheckpointer

        return DeepSpeedCheckpointer(lora=spec.lora is not None, base_dir=spec.initial_checkpoint_dir,
                                     out_dir=spec.out_dir, model_config=spec.config,
                                     hyperparameters=spec.hyperparameters, keep_last=spec.train.keep_last, **arguments)
    return build_checkpointer(spec.fsdp.state_dict_type, async_save=spec.fsdp.async_save, lora=spec.lora is not None,
                              out_dir=spec.out_dir, model_config=spec.config, hyperparameters=spec.hyperparameters,
                              keep_last=spec.train.keep_last, **arguments)
