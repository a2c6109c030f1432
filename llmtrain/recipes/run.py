"""What every recipe runs on every rank once its arguments are checked: ``run(spec)``.

A recipe's ``setup()`` validates its flags cheaply, fills a :class:`RunSpec` (plain, picklable data,
so spawned workers can receive it) and hands it to the launcher. ``run`` builds the runtime, data,
model, optimizer and checkpointer the same way for pretraining and both fine-tuning recipes, and
calls the one ``fit()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from llmtrain.args import EvalArgs, TrainArgs, batch_plan
from llmtrain.checkpoint import layout
from llmtrain.checkpoint.checkpointer import Checkpointer, build_checkpointer
from llmtrain.checkpoint.lora import write_lora_settings
from llmtrain.config import Config
from llmtrain.distributed.parallelize import FSDPArgs
from llmtrain.prompts import save_prompt_style
from llmtrain.recipes import common
from llmtrain.train.precision import Precision


@dataclass
class RunSpec:
    """Everything a rank needs to train; built by a recipe after its checks."""

    recipe: str
    config: Config
    out_dir: Path
    precision: Precision
    data: Any
    train: TrainArgs
    eval: EvalArgs
    optimizer: Any
    seq_len: int
    hyperparameters: dict
    seed: int = 42
    accelerator: str = "auto"
    strategy: str = "auto"
    fsdp: FSDPArgs = field(default_factory=FSDPArgs)
    compile: bool = False
    num_nodes: int = 1
    logger_name: str = "csv"
    resume_from: Optional[Path] = None
    initial_checkpoint_dir: Optional[Path] = None
    """Weights to start from (pretraining's --initial_checkpoint_dir, fine-tuning's CHECKPOINT_DIR)."""
    tokenizer_dir: Optional[Path] = None
    lora: Any = None
    """LoRAArgs for finetune_lora, else None."""
    quantize: Optional[str] = None
    prompt_style: Optional[str] = None
    """Fine-tuning: a prompt style name; None takes the checkpoint's own, else the model family's."""


def run(spec: RunSpec) -> None:
    """One rank's training run. Every process of the job executes this.

    SIGTERM and SIGUSR1 are caught once the ranks have met, so one that arrives while the model is
    built still stops the run cleanly after its first step (exit code 75, see llmtrain.train.signals);
    before that, nothing is lost when they end the process.
    """
    from llmtrain.distributed.runtime import Runtime
    from llmtrain.train.signals import catch_stop_signals

    runtime = Runtime.from_env(spec.accelerator)
    with catch_stop_signals():
        _run(spec, runtime)


def _run(spec: RunSpec, runtime: Any) -> None:
    from llmtrain.distributed.parallelize import unwrap
    from llmtrain.flops import device_peak_flops, flops_per_token
    from llmtrain.train.loggers import build_loggers
    from llmtrain.train.loop import Fit, TrainState, fit, plan_horizon

    common.configure_process(runtime)
    plan = batch_plan(spec.train, runtime.data_parallel_size)
    say = print if runtime.is_main else (lambda *a, **k: None)

    with runtime.main_process_first():
        tokenizer = common.resolve_tokenizer(spec.tokenizer_dir, spec.data, spec.resume_from,
                                             spec.initial_checkpoint_dir)
        common.check_vocab(tokenizer, spec.config, str(spec.tokenizer_dir or spec.initial_checkpoint_dir
                                                       or "the data module"))
        prompt_style = _connect_data(spec, tokenizer, plan.micro_batch_size)
        spec.data.prepare_data()
    spec.data.setup(runtime.data_parallel_rank, runtime.data_parallel_size)
    train_loader = spec.data.train_dataloader()
    val_loader = spec.data.val_dataloader()
    horizon = plan_horizon(spec.train, plan.global_batch_size * spec.seq_len, train_loader.samples_per_epoch)

    started = time.perf_counter()
    model, info = common.build_model(spec.config, runtime=runtime, seed=spec.seed, precision=spec.precision,
                                     strategy=spec.strategy, fsdp=spec.fsdp, num_nodes=spec.num_nodes,
                                     compile=spec.compile, initial_checkpoint_dir=spec.initial_checkpoint_dir,
                                     lora=spec.lora, quantize=spec.quantize)
    gpt = unwrap(model)
    gpt.max_seq_length = spec.seq_len
    n_params = sum(p.numel() for p in gpt.parameters())  # FSDP2 parameters report their full size
    n_trainable = sum(p.numel() for p in gpt.parameters() if p.requires_grad)
    torch.manual_seed(spec.seed + runtime.rank)  # dropout and sampling differ per rank, reproducibly
    optimizer = common.build_optimizer(spec.optimizer, [p for p in model.parameters() if p.requires_grad])
    scaler = spec.precision.grad_scaler(runtime.device)
    state = TrainState()
    checkpointer = _build_checkpointer(spec, runtime=runtime, model=model, optimizer=optimizer,
                                       train_loader=train_loader, tokenizer=tokenizer, scaler=scaler,
                                       write_extras=_extras_writer(spec, prompt_style))
    if spec.resume_from is not None:
        checkpointer.load(spec.resume_from, state)
        say(f"resumed from {spec.resume_from} at step {state.step} ({state.tokens:,} tokens)")
    say(f"{spec.recipe}: model {spec.config.name or 'custom'}, {n_params / 1e6:.2f}M parameters "
        f"({n_trainable / 1e6:.2f}M trainable), built in {time.perf_counter() - started:.1f}s | {info.describe()} | "
        f"world {runtime.world_size}, micro batch {plan.micro_batch_size}, global batch {plan.global_batch_size}, "
        f"grad accumulation {plan.grad_accum_steps}, seq {spec.seq_len}, {horizon.total_steps} steps, "
        f"precision {spec.precision.name}, device {runtime.device}")
    say(f"memory per device (estimate): {_memory_estimate(spec, runtime, plan, n_trainable).describe()}")

    job = Fit(runtime=runtime, model=model, optimizer=optimizer, train_loader=train_loader, val_loader=val_loader,
              train=spec.train, eval=spec.eval, plan=plan, horizon=horizon, precision=spec.precision,
              save_checkpoint=checkpointer.save, save_final=checkpointer.save_final,
              wait_for_checkpoint=checkpointer.wait,
              loggers=build_loggers(spec.logger_name, spec.out_dir, state.step if spec.resume_from else None,
                                    spec.hyperparameters)
              if runtime.is_main else [],
              flops_per_token=flops_per_token(spec.config, spec.seq_len),
              peak_flops_per_device=device_peak_flops(runtime.device, spec.precision.compute_dtype),
              state=state, scaler=scaler, autocast_enabled=info.autocast_enabled,
              grad_sync_only_last=spec.fsdp.skip_gradient_sync,
              after_validation=_example_generator(spec, model, tokenizer, prompt_style, val_loader))
    fit(job)
    say(f"done: {state.step} steps, {state.tokens:,} tokens in {state.elapsed_s:.0f}s; "
        f"final model in {spec.out_dir / layout.FINAL_DIR}")


def _memory_estimate(spec: RunSpec, runtime: Any, plan: Any, n_trainable: int) -> Any:
    from llmtrain.distributed.parallelize import resolve_sharding_strategy
    from llmtrain.plan import estimate_memory

    sharding = resolve_sharding_strategy(spec.strategy, spec.fsdp, runtime.world_size, spec.num_nodes)
    shard_size = runtime.world_size // spec.num_nodes if sharding == "HYBRID_SHARD" else runtime.world_size
    return estimate_memory(spec.config, precision=spec.precision, micro_batch_size=plan.micro_batch_size,
                           seq_len=spec.seq_len, sharding=sharding, shard_size=shard_size,
                           activation_checkpointing=spec.fsdp.activation_checkpointing,
                           cpu_offload=spec.fsdp.cpu_offload, trainable_parameters=n_trainable,
                           quantize=spec.quantize, grad_accum_steps=plan.grad_accum_steps)


def _connect_data(spec: RunSpec, tokenizer: Any, micro_batch_size: int) -> Any:
    """Connect the data module; instruction data also gets the prompt style, which is returned."""
    from llmtrain.data.instruct import InstructDataModule

    if not isinstance(spec.data, InstructDataModule):
        spec.data.connect(tokenizer, micro_batch_size, spec.seq_len, spec.seed)
        return None
    from llmtrain.prompts import PromptStyle, has_prompt_style, load_prompt_style

    if spec.prompt_style is not None:
        style = PromptStyle.from_name(spec.prompt_style)
    elif spec.initial_checkpoint_dir is not None and has_prompt_style(spec.initial_checkpoint_dir):
        style = load_prompt_style(spec.initial_checkpoint_dir)
    else:
        style = PromptStyle.from_config(spec.config)
    spec.data.connect(tokenizer, micro_batch_size, spec.seq_len, spec.seed, prompt_style=style)
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


def _example_generator(spec: RunSpec, model: Any, tokenizer: Any, prompt_style: Any,
                       val_loader: Any) -> Optional[Callable[[], str]]:
    """Fine-tuning prints one greedy answer to the first validation prompt after each validation.

    Greedy decoding keeps every rank's step count equal, which a sharded model's forward needs.
    """
    if prompt_style is None or not getattr(spec.data, "validation_prompts", None):
        return None
    from llmtrain.generate import PromptTooLongError, generate_text

    prompt = spec.data.validation_prompts()[0]

    def example() -> str:
        try:
            answer = generate_text(model, tokenizer, prompt_style, prompt, max_new_tokens=min(64, spec.seq_len // 2))
        except PromptTooLongError:  # an example is a courtesy; it must never stop training
            return f"example | skipped: the first validation prompt is longer than --train.max_seq_length {spec.seq_len}"
        return f"example | {prompt[-1]['content']!r} -> {answer!r}"

    return example


def _build_checkpointer(spec: RunSpec, **arguments: Any) -> Checkpointer:
    return build_checkpointer(spec.fsdp.state_dict_type, async_save=spec.fsdp.async_save, lora=spec.lora is not None,
                              out_dir=spec.out_dir, model_config=spec.config, hyperparameters=spec.hyperparameters,
                              keep_last=spec.train.keep_last, **arguments)
