"""``llmtrain pretrain``: train a model from scratch (or continue from weights) on a token stream."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal, Optional

import torch

from llmtrain.args import EvalArgs, TrainArgs, batch_plan
from llmtrain.config import Config
from llmtrain.data.base import DataModule
from llmtrain.distributed.parallelize import FSDPArgs
from llmtrain.recipes import common
from llmtrain.train.precision import Precision, PrecisionName


def setup(
    model_name: Optional[str] = None,
    model_config: Optional[Config] = None,
    out_dir: Path = Path("out/pretrain"),
    precision: PrecisionName = "32-true",
    initial_checkpoint_dir: Optional[Path] = None,
    resume: common.ResumeArg = False,
    data: Optional[DataModule] = None,
    train: TrainArgs = TrainArgs(),
    eval: EvalArgs = EvalArgs(),
    optimizer: common.OptimizerArg = "AdamW",
    devices: int = 1,
    num_nodes: int = 1,
    accelerator: Literal["auto", "cpu", "cuda"] = "auto",
    strategy: Literal["auto", "ddp", "fsdp"] = "auto",
    fsdp: FSDPArgs = FSDPArgs(),
    compile: bool = False,
    tokenizer_dir: Optional[Path] = None,
    logger_name: Literal["csv", "tensorboard"] = "csv",
    seed: int = 42,
) -> None:
    """Pretrain a model from the zoo (or a custom architecture) on a data module.

    Args:
        model_name: A name from the model zoo (`llmtrain pretrain list` prints them). Given as the first
            positional argument.
        model_config: A custom architecture instead of a zoo name: a YAML file or inline
            `--model_config.FIELD value` flags.
        out_dir: Where checkpoints (`step-NNNNNNNN/`, `final/`) and metrics.csv go.
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed or 16-true.
        initial_checkpoint_dir: Start a new run from the weights of this model directory.
        resume: Continue this run: `auto` (the newest complete checkpoint in out_dir, if any), `true`
            (it must exist) or a checkpoint path.
        data: The data module, e.g. `--data TextFiles --data.train_data_path DIR`. Default: the
            built-in corpus.
        train: Training length, batch sizes, schedule and clipping.
        eval: Validation settings.
        optimizer: A torch.optim class name (`AdamW`, torch defaults) or `--optimizer CLASS
            --optimizer.lr 3e-4 ...` with its arguments.
        devices: Processes (devices) per node.
        num_nodes: Number of nodes.
        accelerator: Where to train: auto (GPU if there is one), cpu or cuda.
        strategy: Data parallelism across processes: auto (FSDP when there is more than one process),
            ddp or fsdp.
        fsdp: FSDP settings: sharding strategy, activation checkpointing, CPU offload, checkpoint format.
        compile: Compile every transformer block with torch.compile (before FSDP wraps it).
        tokenizer_dir: Folder with tokenizer.json and tokenizer_config.json. Built-in data brings its own.
        logger_name: Metrics go to out_dir/metrics.csv always; `tensorboard` adds TensorBoard logs.
        seed: Seed for weight init, data order and dropout.
    """
    from llmtrain.data import BuiltinStories

    if model_name == "list":
        print_zoo()
        return
    data = data if data is not None else BuiltinStories()
    hyperparameters = {
        "model_name": model_name, "model_config": common.to_yaml(model_config) if model_config else None,
        "out_dir": str(out_dir), "precision": precision,
        "initial_checkpoint_dir": str(initial_checkpoint_dir) if initial_checkpoint_dir else None,
        "resume": str(resume) if isinstance(resume, Path) else resume, "data": common.data_spec(data),
        "train": common.to_yaml(train), "eval": common.to_yaml(eval), "optimizer": common.optimizer_spec(optimizer),
        "devices": devices, "num_nodes": num_nodes, "accelerator": accelerator, "strategy": strategy,
        "fsdp": common.to_yaml(fsdp), "compile": compile,
        "tokenizer_dir": str(tokenizer_dir) if tokenizer_dir else None, "logger_name": logger_name, "seed": seed,
    }
    # Everything cheap is checked before any process, tokenizer or model is created.
    config = common.resolve_model_config(model_name, model_config, initial_checkpoint_dir)
    Precision(precision)
    common.check_out_dir(out_dir)
    resume_from = common.resolve_resume(resume, out_dir, initial_checkpoint_dir)
    seq_len = train.max_seq_length or config.block_size
    if seq_len > config.block_size:
        raise ValueError(f"--train.max_seq_length {seq_len} exceeds the block_size {config.block_size} of "
                         f"{config.name or 'the model'}; lower it to at most {config.block_size}")
    data.validate()
    from llmtrain.distributed.launch import launch
    from llmtrain.distributed.parallelize import resolve_sharding_strategy

    resolve_sharding_strategy(strategy, fsdp, devices * num_nodes, num_nodes)  # contradictions fail here
    launch(main, kwargs=dict(
        config=config, out_dir=Path(out_dir), precision=Precision(precision), resume_from=resume_from,
        initial_checkpoint_dir=initial_checkpoint_dir, data=data, train=train, eval=eval, optimizer=optimizer,
        accelerator=accelerator, strategy=strategy, fsdp=fsdp, compile=compile, num_nodes=num_nodes,
        tokenizer_dir=tokenizer_dir, logger_name=logger_name, seed=seed, seq_len=seq_len,
        hyperparameters=hyperparameters), devices=devices, num_nodes=num_nodes)


def main(*, config: Config, out_dir: Path, precision: Precision, resume_from: Optional[Path],
         initial_checkpoint_dir: Optional[Path], data: DataModule, train: TrainArgs, eval: EvalArgs,
         optimizer, accelerator: str, strategy: str, fsdp: FSDPArgs, compile: bool, num_nodes: int,
         tokenizer_dir: Optional[Path], logger_name: str, seed: int, seq_len: int, hyperparameters: dict) -> None:
    """One rank's run: everything after launching. Every process of the job executes this."""
    from llmtrain.distributed.runtime import Runtime
    from llmtrain.flops import device_peak_flops, flops_per_token
    from llmtrain.distributed.checkpoint import build_checkpointer, load_checkpoint
    from llmtrain.distributed.parallelize import unwrap
    from llmtrain.train.loggers import build_loggers
    from llmtrain.train.loop import Fit, TrainState, fit, plan_horizon

    runtime = Runtime.from_env(accelerator)
    common.configure_process(runtime)
    plan = batch_plan(train, runtime.data_parallel_size)
    say = print if runtime.is_main else (lambda *a, **k: None)

    with runtime.main_process_first():
        tokenizer = common.resolve_tokenizer(tokenizer_dir, data, resume_from, initial_checkpoint_dir)
        common.check_vocab(tokenizer, config, str(tokenizer_dir or "the data module"))
        data.connect(tokenizer, plan.micro_batch_size, seq_len, seed)
        data.prepare_data()
    data.setup(runtime.data_parallel_rank, runtime.data_parallel_size)
    train_loader = data.train_dataloader()
    val_loader = data.val_dataloader()
    horizon = plan_horizon(train, plan.global_batch_size * seq_len, train_loader.samples_per_epoch)

    t0 = time.perf_counter()
    model, info = common.build_model(config, runtime=runtime, seed=seed, precision=precision, strategy=strategy,
                                     fsdp=fsdp, num_nodes=num_nodes, compile=compile,
                                     initial_checkpoint_dir=initial_checkpoint_dir)
    unwrap(model).max_seq_length = seq_len
    n_params = sum(p.numel() for p in unwrap(model).parameters())  # FSDP2 parameters report their full size
    torch.manual_seed(seed + runtime.rank)  # dropout and sampling differ per rank, reproducibly
    opt = common.build_optimizer(optimizer, model.parameters())
    scaler = precision.grad_scaler(runtime.device)
    state = TrainState()
    checkpoint_args = dict(runtime=runtime, out_dir=out_dir, model=model, optimizer=opt, train_loader=train_loader,
                           model_config=config, tokenizer=tokenizer, hyperparameters=hyperparameters, scaler=scaler)
    checkpointer = build_checkpointer(fsdp.state_dict_type, **checkpoint_args)
    if resume_from is not None:
        # A checkpoint is read in the format it was written in, whatever this run writes.
        load_checkpoint(checkpointer, resume_from, state)
        say(f"resumed from {resume_from} at step {state.step} ({state.tokens:,} tokens)")
    say(f"model {config.name or 'custom'}: {n_params / 1e6:.2f}M parameters, built in {time.perf_counter() - t0:.1f}s | "
        f"{info.describe()} | world {runtime.world_size}, micro batch {plan.micro_batch_size}, global batch "
        f"{plan.global_batch_size}, grad accumulation {plan.grad_accum_steps}, seq {seq_len}, "
        f"{horizon.total_steps} steps, precision {precision.name}, device {runtime.device}")

    job = Fit(runtime=runtime, model=model, optimizer=opt, train_loader=train_loader, val_loader=val_loader,
              train=train, eval=eval, plan=plan, horizon=horizon, precision=precision,
              save_checkpoint=checkpointer.save, save_final=checkpointer.save_final,
              loggers=build_loggers(logger_name, out_dir, state.step if resume_from else None) if runtime.is_main else [],
              flops_per_token=flops_per_token(config, seq_len),
              peak_flops_per_device=device_peak_flops(runtime.device, precision.compute_dtype),
              state=state, scaler=scaler, autocast_enabled=info.autocast_enabled)
    fit(job)
    say(f"done: {state.step} steps, {state.tokens:,} tokens in {state.elapsed_s:.0f}s; final model in {out_dir / 'final'}")


def print_zoo() -> None:
    """The zoo, one name per line with its size (computed from the config, no weights built)."""
    from llmtrain.flops import num_parameters

    for name in Config.names():
        config = Config.from_name(name)
        print(f"{name:<28} {num_parameters(config) / 1e6:>10.1f}M")
