"""``llmtrain pretrain``: train a model from scratch (or continue from weights) on a token stream."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import torch

from llmtrain.args import EvalArgs, TrainArgs
from llmtrain.config import Config
from llmtrain.data.base import DataModule
from llmtrain.distributed.parallelize import FSDPArgs
from llmtrain.plan import DryRunArgs
from llmtrain.plan import dry_run as dry_run_plan
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
    optimizer: common.OptimizerArg = "torch.optim.AdamW",
    devices: int = 1,
    num_nodes: int = 1,
    accelerator: Literal["auto", "cpu", "cuda"] = "auto",
    strategy: Literal["auto", "ddp", "fsdp"] = "auto",
    fsdp: FSDPArgs = FSDPArgs(),
    compile: bool = False,
    tokenizer_dir: Optional[Path] = None,
    logger_name: Literal["csv", "tensorboard", "wandb"] = "csv",
    seed: int = 42,
    dry_run: DryRunArgs = DryRunArgs(),
) -> None:
    """Pretrain a model from the zoo (or a custom architecture) on a data module.

    Args:
        model_name: A name from the model zoo (`llmtrain pretrain list` prints them). Given as the first
            positional argument.
        model_config: A custom architecture instead of a zoo name: a YAML file or inline
            `--model_config.FIELD value` flags.
        out_dir: Where checkpoints (`step-NNNNNNNN/`, `final/`) and metrics.csv go.
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed or 16-true.
        initial_checkpoint_dir: Start a new run from the weights of this model directory (or transformers
            folder, converted on the fly).
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
        logger_name: Metrics go to out_dir/metrics.csv always; `tensorboard` adds TensorBoard logs, `wandb`
            a Weights & Biases run in out_dir/wandb (offline unless WANDB_MODE=online).
        seed: Seed for weight init, data order and dropout.
        dry_run: `--dry_run` prints the plan (layout, batches, memory, checkpoint size, time) and exits.
    """
    from llmtrain.data import BuiltinStories
    from llmtrain.recipes.run import RunSpec, run

    if model_name == "list":
        print_zoo()
        return
    data = data if data is not None else BuiltinStories()
    hyperparameters = common.hyperparameters(common.arguments_of(setup, locals()))
    # Everything cheap is checked before any process, tokenizer or model is created.
    common.check_out_dir(out_dir)
    common.check_logger(logger_name)
    resume_from = common.resolve_resume(resume, out_dir, initial_checkpoint_dir)
    if initial_checkpoint_dir is not None:
        from llmtrain.convert.hf import ensure_model_dir

        initial_checkpoint_dir = ensure_model_dir(Path(initial_checkpoint_dir))  # a transformers folder works too
    config = common.resolve_model_config(model_name, model_config, initial_checkpoint_dir)
    if dry_run.requested:
        common.check_seq_len(train, config)
        dry_run_plan(recipe="pretrain", config=config, precision=Precision(precision), train=train, devices=devices,
                     num_nodes=num_nodes, strategy=strategy, fsdp=fsdp, dry=dry_run, out_dir=out_dir)
        return
    common.check_disk_space(out_dir, config, Precision(precision))
    seq_len = common.check_seq_len(train, config)
    data.validate()
    spec = RunSpec(recipe="pretrain", config=config, out_dir=Path(out_dir), precision=Precision(precision), data=data,
                   train=train, eval=eval, optimizer=optimizer, seq_len=seq_len, hyperparameters=hyperparameters,
                   seed=seed, accelerator=accelerator, strategy=strategy, fsdp=fsdp, compile=compile,
                   num_nodes=num_nodes, logger_name=logger_name, resume_from=resume_from,
                   initial_checkpoint_dir=initial_checkpoint_dir, tokenizer_dir=tokenizer_dir)
    common.launch_run(run, spec, devices=devices, num_nodes=num_nodes)


def print_zoo() -> None:
    """The zoo, one name per line with its size (computed from the config, no weights built)."""
    from llmtrain.flops import num_parameters

    for name in Config.names():
        config = Config.from_name(name)
        print(f"{name:<28} {num_parameters(config) / 1e6:>10.1f}M")
