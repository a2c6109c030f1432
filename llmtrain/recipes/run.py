"""What every rank runs: ``run(spec)``, after :func:`llmtrain.recipes.prepare.prepare` checked the flags.

``run`` builds the runtime, data, model, optimizer and checkpointer the same way for pretraining and both
fine-tuning recipes, and calls the one ``fit()``. Its phases: load the data (and learn the run's length), build
the model and optimizer through the run's engine (:mod:`llmtrain.recipes.engine`: torch's, or DeepSpeed's),
restore a ``--resume`` checkpoint, describe the run, then train and close.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from llmtrain.args import EvalArgs, FSDPArgs, ProfileArgs, TrainArgs
from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.checkpointer import Checkpointer
from llmtrain.checkpoint.lora import write_lora_settings
from llmtrain.config import Config
from llmtrain.data.base import DataModule
from llmtrain.data.tokens import cache_dir
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.distributed.parallelize import unwrap
from llmtrain.distributed.pipeline import build_pipeline
from llmtrain.distributed.runtime import Runtime, configure_process
from llmtrain.flops import active_parameters, device_peak_flops, flops_per_token
from llmtrain.lora import LoRAArgs
from llmtrain.optim import OptimizerArg, build_optimizer
from llmtrain.plan.memory import estimate_memory
from llmtrain.prompts import save_prompt_style
from llmtrain import compiling
from llmtrain.compiling import CompileChoice, CompileSetting
from llmtrain.recipes import build
from llmtrain.recipes.engine import Engine, engine
from llmtrain.recipes.flags import LoggerName
from llmtrain.train import experts
from llmtrain.train.loggers import build_loggers
from llmtrain.train.horizon import Horizon, plan_horizon
from llmtrain.train.loop import Fit, TrainState, fit
from llmtrain.train.metrics import data_metrics
from llmtrain.train.nonfinite import NonFiniteError, Rewind
from llmtrain.train.profile import build_profiler
from llmtrain.signals import catch_stop_signals


@dataclass
class RunSpec:
    """Everything a rank needs to train; built by :func:`llmtrain.recipes.prepare.prepare` after its checks."""

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


def _resumed_step(resume_from: Optional[Path]) -> int:
    """The step a ``--resume`` checkpoint directory holds, from its name (``step-00000400``); 0 without one."""
    match = layout.STEP_DIR.match(Path(resume_from).name) if resume_from is not None else None
    return int(match.group(1)) if match else 0


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


@dataclass
class _Data:
    """The data side of a rank's run: the tokenizer, the prompt style (instruction data), the loaders, the length."""

    tokenizer: Any
    prompt_style: Any
    train_loader: Any
    val_loader: Any
    horizon: Horizon


@dataclass
class _Built:
    """The model side: what the loop calls as the model, its optimizer, scaler and strategy, and what to say."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    strategy: Optional[Callable[[Fit], Any]]
    """The loop's Strategy for the step; None is torch's own (llmtrain.train.loop.TorchStrategy)."""
    compiled: CompileChoice
    parameters: int
    trainable: int
    started: float
    """time.perf_counter() as the build began."""


def _run(spec: RunSpec, runtime: Runtime) -> None:
    configure_process(runtime, spec.plan.precision)
    say = print if runtime.is_main else (lambda *a, **k: None)
    if spec.plan.num_nodes > 1:
        _check_shared_folders(spec, runtime)
    data = _load_data(spec, runtime)
    run_engine = engine(spec.deepspeed_config is not None)
    built = _build(spec, runtime, data.horizon, run_engine)
    state = TrainState()
    checkpointer = run_engine.checkpointer(spec, runtime=runtime, model=built.model, optimizer=built.optimizer,
                                           train_loader=data.train_loader, tokenizer=data.tokenizer,
                                           scaler=built.scaler, write_extras=_extras_writer(spec, data.prompt_style))
    if spec.resume_from is not None:
        _restore(spec, runtime, checkpointer, state, say)
    _describe(spec, runtime, built, data.horizon, say)
    rewind = Rewind(checkpoint=spec.resume_from, command=spec.command, on_good=checkpointer.prune)
    job = _fit_job(spec, runtime, data, built, state, checkpointer, rewind, say)
    _train(job, spec, runtime, data, rewind, say)
    say(f"done: {state.step} steps, {state.tokens:,} tokens in {state.elapsed_s:.0f}s; "
        f"final model in {spec.out_dir / layout.FINAL_DIR}")


def _load_data(spec: RunSpec, runtime: Runtime) -> _Data:
    """The tokenizer (checked against the model), the data prepared once per node and set up for this rank's
    share, its loaders, and the run's length; a --profile window is checked against it before the model exists."""
    plan = spec.plan
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
    return _Data(tokenizer, prompt_style, train_loader, val_loader, horizon)


def _build(spec: RunSpec, runtime: Runtime, horizon: Horizon, run_engine: Engine) -> _Built:
    """Compile or not (every rank agrees), build this rank's model, its optimizer and scaler, and let the engine
    wrap them."""
    plan = spec.plan
    started = time.perf_counter()
    compiled = compiling.agree(compiling.choose(
        spec.compile, recipe=spec.recipe, config=spec.config, plan=plan, seq_len=spec.seq_len,
        total_steps=horizon.total_steps - _resumed_step(spec.resume_from), max_time=horizon.max_time,
        device=runtime.device, quantize=spec.quantize), runtime)
    model = run_engine.build_model(spec, runtime, compile=compiled.enabled)
    gpt = unwrap(model)
    gpt.max_seq_length = spec.seq_len
    counted = gpt.whole_model() if plan.pp > 1 else gpt  # a pipeline rank holds only its own stages
    # FSDP2 parameters report their full size; ZeRO stage 3's keep it in ds_numel (their own numel is 0).
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in counted.parameters())
    n_trainable = sum(getattr(p, "ds_numel", p.numel()) for p in counted.parameters() if p.requires_grad)
    torch.manual_seed(spec.seed + runtime.rank)  # dropout and sampling differ per rank, reproducibly
    optimizer = build_optimizer(spec.optimizer, [p for p in model.parameters() if p.requires_grad])
    scaler = plan.precision.grad_scaler(runtime.device)
    model, scaler, strategy = run_engine.wrap(model, optimizer, scaler, spec, runtime)
    return _Built(model, optimizer, scaler, strategy, compiled, n_params, n_trainable, started)


def _restore(spec: RunSpec, runtime: Runtime, checkpointer: Checkpointer, state: TrainState,
             say: Callable[[str], None]) -> None:
    """Resume ``--resume``'s checkpoint (or a fallback, if it is damaged) into ``state``; rank 0 sets aside the
    newer checkpoints of the branch this run rewinds."""
    resumed = checkpointer.resume(spec.resume_from, spec.resume_fallbacks, state)
    say(f"resumed from {resumed} at step {state.step} ({state.tokens:,} tokens)")
    if runtime.is_main and (moved := files.set_aside_newer(spec.out_dir, resumed)):
        say(f"moved the {len(moved)} newer checkpoint(s) of the branch this run rewinds into "
            f"{moved[0].parent} (--resume auto would have picked them after a crash)")


def _describe(spec: RunSpec, runtime: Runtime, built: _Built, horizon: Horizon, say: Callable[[str], None]) -> None:
    """The run's opening lines: the model, its build time and length, the compile choice, layout and memory."""
    plan = spec.plan
    active = f", {active_parameters(spec.config) / 1e6:.2f}M active per token" if spec.config.is_moe else ""
    say(f"{spec.recipe}: model {spec.config.name or 'custom'}, {built.parameters / 1e6:.2f}M parameters "
        f"({built.trainable / 1e6:.2f}M trainable{active}), built in {time.perf_counter() - built.started:.1f}s, "
        f"{horizon.total_steps} steps of seq {spec.seq_len}{', compiled blocks' if built.compiled.enabled else ''}")
    if (moe := experts.describe(spec.config)) is not None:
        say(moe)
    say(horizon.describe())
    if spec.compile == "auto":
        say(built.compiled.reason)
    say(f"layout: {plan.describe()} | device {runtime.device}")
    memory = estimate_memory(spec.config, plan=plan, seq_len=spec.seq_len,
                                      trainable_parameters=built.trainable, quantize=spec.quantize)
    say(f"memory per device (estimate): {memory.describe()}")


def _fit_job(spec: RunSpec, runtime: Runtime, data: _Data, built: _Built, state: TrainState,
             checkpointer: Checkpointer, rewind: Rewind, say: Callable[[str], None]) -> Fit:
    """What ``fit()`` runs: the model and data, the schedule, checkpoints, loggers, profiler and pipeline."""
    plan = spec.plan
    profiler = None
    if spec.profile is not None:
        profiler = build_profiler(spec.profile, spec.out_dir, runtime.rank, runtime.device, first_step=state.step + 1,
                                  last_step=data.horizon.total_steps, say=say)
    pipeline = build_pipeline(built.model, plan, runtime) if plan.pp > 1 else None
    loggers = []
    if runtime.is_main:  # rank 0 alone writes metrics
        loggers = build_loggers(spec.logger_name, spec.out_dir, state.step if spec.resume_from else None,
                                spec.hyperparameters,
                                data_columns=list(data_metrics(data.train_loader)) + experts.moe_columns(spec.config))
    return Fit(runtime=runtime, model=built.model, optimizer=built.optimizer, train_loader=data.train_loader,
               val_loader=data.val_loader, train=spec.train, eval=spec.eval, plan=plan.batch, horizon=data.horizon,
               precision=plan.precision, save_checkpoint=lambda state: checkpointer.save(state, good=rewind.checkpoint),
               save_final=checkpointer.save_final,
               wait_for_checkpoint=checkpointer.wait,
               loggers=loggers,
               flops_per_token=flops_per_token(spec.config, spec.seq_len,
                                               adapter_parameters=built.trainable if spec.lora is not None else None),
               peak_flops_per_device=device_peak_flops(runtime.device, plan.precision.compute_dtype),
               state=state, scaler=built.scaler, autocast_enabled=not plan.mixed_precision_policy,
               grad_sync_only_last=plan.grad_sync_only_last,
               after_validation=_example_generator(spec, built.model, data.tokenizer, data.prompt_style,
                                                   data.val_loader),
               callbacks=[profiler] if profiler is not None else [],
               pipeline=pipeline, pp_mesh=pipeline.pp_mesh if pipeline is not None else None,
               strategy=built.strategy, rewind=rewind, config=spec.config)


def _train(job: Fit, spec: RunSpec, runtime: Runtime, data: _Data, rewind: Rewind,
           say: Callable[[str], None]) -> None:
    """``fit(job)``; after a stop for divergence rank 0 sets the bad checkpoints aside, and the loaders close."""
    try:
        fit(job)
    except NonFiniteError:
        if runtime.is_main:
            _set_aside_diverged(spec.out_dir, rewind, say)
        raise
    finally:  # a streaming loader's reading thread stops here, not mid-chunk as the interpreter exits
        for loader in (data.train_loader, data.val_loader):
            close = getattr(loader, "close", None)
            if callable(close):
                close()


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
