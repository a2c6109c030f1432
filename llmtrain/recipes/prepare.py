"""What every recipe runs in the launching process: ``prepare()``, which ends in ``run(spec)`` on every rank.

A recipe's ``setup()`` resolves its model and weights, then calls :func:`prepare`, which checks every flag
cheaply (out_dir, logger, the parallel plan, the launcher's environment, sequence length, disk space, the
data module's files), prints the dry run when one was asked for, and otherwise fills a
:class:`~llmtrain.recipes.run.RunSpec` (plain, picklable data, so spawned workers can receive it) and launches
:func:`llmtrain.recipes.run.run` on every rank.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

from llmtrain.args import BatchDefaults, DryRunArgs, ProfileArgs, TrainArgs
from llmtrain.checkpoint import lock as out_dir_lock
from llmtrain.checkpoint.layout import CONFIG_FILE, FINAL_DIR
from llmtrain.checkpoint.resume import (check_deepspeed_resume, check_resume_lora, check_resume_model,
                                        check_resume_optimizer, resume_fallbacks)
from llmtrain.checkpoint.size import check_disk_space, final_is_separate
from llmtrain.checkpoint.state import load_training_state
from llmtrain.config import Config
from llmtrain.data.streaming import check_stream_resume
from llmtrain.distributed.launch import invocation, is_first_process, launch, plan_launch, resolve_devices
from llmtrain.distributed.parallel_plan import ParallelPlan, resolve_device_type
from llmtrain.lora import LoRAArgs
from llmtrain.plan.report import dry_run
from llmtrain.plan.search import check_state_fits
from llmtrain.recipes import checks, hparams
from llmtrain.recipes.engine import engine
from llmtrain.recipes.run import RunSpec, run
from llmtrain.tokenizer import Tokenizer
from llmtrain.train.horizon import step_limits
from llmtrain.train.schedule import check_min_lr


def prepare(recipe: str, flags: dict[str, Any], *, config: Config, resume_from: Optional[Path],
            initial_checkpoint_dir: Optional[Path] = None, tokenizer_dir: Optional[Path] = None,
            lora: Optional[LoRAArgs] = None, quantize: Optional[str] = None, prompt_style: Optional[str] = None,
            trainable_parameters: Optional[int] = None, hyperparameters: dict,
            batch_defaults: BatchDefaults = BatchDefaults()) -> Optional[Path]:
    """Check everything cheap, then print the dry run or launch ``run`` on every rank; returns the run's final/
    (None for a dry run).

    ``flags`` are the shared recipe flags (llmtrain.recipes.flags); ``batch_defaults`` fill the batch sizes
    they leave unset. Every bad combination raises
    ``ValueError`` here, before any worker, tokenizer or model exists; under torchrun or srun every rank
    raises the same one before the process group is created.
    """
    dry = flags["dry_run"]
    if flags["dist_timeout"] <= 0:
        raise ValueError(f"--dist_timeout {flags['dist_timeout']:g} must be a positive number of seconds (default 600)")
    seq_len = checks.check_seq_len(flags["train"], config)
    plan = _resolve_plan(flags, dry, batch_defaults)
    _check_model_split(plan, config, seq_len, lora=lora, quantize=quantize)
    if not dry.requested:
        check_state_fits(config, plan, dry, source=_weights_source(config, initial_checkpoint_dir),
                                  trainable_parameters=trainable_parameters, quantize=quantize)
    train = _with_batch(flags["train"], plan)
    optimizer = _check_schedule(flags, train, seq_len)
    flags["data"].validate()  # its files, and the tokenizer's: a dry run checks them too, as cheap as they are
    if tokenizer_dir is not None:  # a prepared folder's tokenizer is checked here, not after launch on every rank
        flags["data"].validate_tokenizer(Tokenizer(tokenizer_dir))
    if dry.requested:
        _dry_run(recipe, flags, config=config, plan=plan, train=train, seq_len=seq_len, lora=lora, quantize=quantize,
                 trainable_parameters=trainable_parameters)
        return None
    hyperparameters["optimizer"] = optimizer
    if isinstance(hyperparameters.get("train"), dict):  # the checkpoint records the batch this run used
        hyperparameters["train"].update(global_batch_size=train.global_batch_size,
                                        micro_batch_size=train.micro_batch_size)
    deepspeed_config = engine(plan.wrapper == "deepspeed").config(plan, train, flags, resume_from)
    if resume_from is not None:  # here, not in the workers: one message, before any of them starts
        _check_resume(resume_from, flags, config=config, plan=plan, deepspeed=deepspeed_config is not None,
                      lora=lora, quantize=quantize, optimizer=optimizer)
    check_disk_space(flags["out_dir"], config, plan.precision, trainable_parameters=trainable_parameters,
                     separate_final=final_is_separate(flags["fsdp"].state_dict_type, plan))
    spec = RunSpec(recipe=recipe, config=config, out_dir=Path(flags["out_dir"]), plan=plan, data=flags["data"],
                   train=train, eval=flags["eval"], optimizer=flags["optimizer"], seq_len=seq_len,
                   hyperparameters=hyperparameters, fsdp=flags["fsdp"], seed=flags["seed"], compile=flags["compile"],
                   logger_name=flags["logger_name"], resume_from=resume_from,
                   resume_fallbacks=resume_fallbacks(flags["resume"], resume_from),
                   initial_checkpoint_dir=initial_checkpoint_dir, tokenizer_dir=tokenizer_dir, lora=lora,
                   quantize=quantize, prompt_style=prompt_style, profile=_profile(flags),
                   dist_timeout=flags["dist_timeout"], deepspeed_config=deepspeed_config, command=invocation())
    _launch(spec)
    return spec.out_dir / FINAL_DIR


def _resolve_plan(flags: dict[str, Any], dry: DryRunArgs, batch_defaults: BatchDefaults) -> ParallelPlan:
    """The layout, batch plan and precision, from the flags. A dry run plans for the machine it names (a GPU this
    one may not have) and records a batch that does not divide; a run first checks the launcher's environment."""
    devices = _devices(flags, dry)
    layout = dict(devices=devices, num_nodes=flags["num_nodes"], train=flags["train"], precision=flags["precision"],
                  strategy=flags["strategy"], fsdp=flags["fsdp"], batch_defaults=batch_defaults, tp=flags["tp_size"],
                  pp=flags["pp_size"], sequence_parallel=flags["tp_sequence_parallel"],
                  pp_schedule=flags["pp_schedule"], pp_virtual_stages=flags["pp_virtual_stages"], ep=flags["ep_size"],
                  zero=engine(flags["deepspeed"].config is not None).zero_settings(flags),
                  accelerator=flags["accelerator"], float8=flags["float8"])
    if dry.requested:
        return ParallelPlan.resolve(**layout, device_type=dry.device_type or
                                    resolve_device_type(flags["accelerator"], here=False), gpu=dry.gpu,
                                    strict_batch=False)
    plan_launch(devices, flags["num_nodes"])  # the launcher's environment agrees with the flags
    return ParallelPlan.resolve(**layout)


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


def _weights_source(config: Config, initial_checkpoint_dir: Optional[Path]) -> str:
    """Where the model's shape comes from, for a message that says it does not fit."""
    if initial_checkpoint_dir is not None:
        return str(Path(initial_checkpoint_dir) / CONFIG_FILE)
    return f"model {config.name}" if config.name in Config.names() else "--model_config"


def _check_model_split(plan: ParallelPlan, config: Config, seq_len: int, *, lora: Optional[LoRAArgs],
                       quantize: Optional[str]) -> None:
    """Tensor and pipeline parallelism against the model and the recipe, before anything is built."""
    plan.check_model(config, seq_len)
    if quantize is not None and plan.splits_model:
        raise ValueError(f"--quantize {quantize} (QLoRA) keeps each 4-bit or int8 weight whole on one device, so it "
                         "cannot be split by --tp_size or --pp_size: drop --quantize (plain LoRA), or use data "
                         "parallelism alone")
    if config.is_moe and plan.wrapper == "deepspeed" and plan.precision.name.startswith("16") and (
            config.router_aux_loss_coef or config.router_z_loss_coef):
        raise ValueError(f"--precision {plan.precision.name} with DeepSpeed on a mixture of experts: DeepSpeed scales "
                         "the loss inside its backward, where the balancing losses' gradients (added in the MoE "
                         "blocks) miss its scale; use --precision bf16-mixed, or --strategy fsdp")
    if lora is not None and plan.float8:
        raise ValueError(f"--float8 {plan.float8} converts trained linear layers; finetune_lora's are frozen and "
                         "carry adapters: drop --float8 (or use finetune_full)")
    if lora is not None and plan.ep > 1:
        raise ValueError(f"finetune_lora with --ep_size {plan.ep}: LoRA's adapters are not split over expert-parallel "
                         "ranks; drop --ep_size (FSDP shards the frozen experts with the rest), or use finetune_full")
    if lora is not None and plan.splits_model:
        raise ValueError("finetune_lora trains with data parallelism only: drop --tp_size and --pp_size (the "
                         "frozen base model can be sharded with --strategy fsdp instead), or use finetune_full")


def _with_batch(train: TrainArgs, plan: ParallelPlan) -> TrainArgs:
    """``train`` with the batch sizes the plan chose where the flags left them unset."""
    return replace(train, global_batch_size=plan.batch.global_batch_size, micro_batch_size=plan.batch.micro_batch_size)


def _profile(flags: dict[str, Any]) -> Optional[ProfileArgs]:
    """--profile's settings when profiling was asked for, else None."""
    return flags["profile"] if flags["profile"].requested else None


def _check_schedule(flags: dict[str, Any], train: TrainArgs, seq_len: int) -> dict:
    """The profiling window and the optimizer against the run's length and schedule (a dry run checks them too);
    returns the optimizer's spec (hparams.optimizer_spec, which checks its arguments)."""
    profile = _profile(flags)
    if profile is not None:
        _check_profile_window(profile, train, seq_len)
    optimizer = hparams.optimizer_spec(flags["optimizer"])
    _check_optimizer(optimizer, train)
    return optimizer


def _check_optimizer(spec: dict, train: TrainArgs) -> None:
    """The schedule against the optimizer's rate (``--train.min_lr`` at most ``--optimizer.lr``), before any worker
    loads a model only for the schedule to refuse it."""
    lr = spec["init_args"].get("lr")
    if isinstance(lr, (int, float)):
        check_min_lr(train.min_lr, lr, train.lr_decay)


def _check_profile_window(profile: ProfileArgs, train: TrainArgs, seq_len: int) -> None:
    """The window against the run's length where the flags give it; a run that --train.epochs sizes learns
    its length once the data is set up, and ``run`` checks it then, before the model is built."""
    limits = step_limits(train, train.global_batch_size * seq_len, samples_per_epoch=None)
    if limits:
        set_by, last_step = min(limits.items(), key=lambda limit: limit[1])
        profile.check_within(last_step, set_by)


def _dry_run(recipe: str, flags: dict[str, Any], *, config: Config, plan: ParallelPlan, train: TrainArgs,
             seq_len: int, lora: Optional[LoRAArgs], quantize: Optional[str],
             trainable_parameters: Optional[int]) -> None:
    """Print the plan and the memory it needs (llmtrain.plan.dry_run); with --dry_run.simulate, also run a step
    on fake tensors."""
    dry = flags["dry_run"]
    dry_run(recipe=recipe, config=config, plan=plan, train=train, seq_len=seq_len, dry=dry,
                     fsdp=flags["fsdp"], out_dir=flags["out_dir"], quantize=quantize,
                     trainable_parameters=trainable_parameters, compile=flags["compile"])
    if dry.simulate:
        from llmtrain.recipes.simulate import run_simulation  # NOTE: imports torch's fake tensors, only when asked

        run_simulation(config, plan, seq_len=seq_len, train=train, optimizer=flags["optimizer"], lora=lora,
                       quantize=quantize, seed=flags["seed"])


def _check_resume(resume_from: Path, flags: dict[str, Any], *, config: Config, plan: ParallelPlan, deepspeed: bool,
                  lora: Optional[LoRAArgs], quantize: Optional[str], optimizer: dict) -> None:
    """The checkpoint ``--resume`` picked against this run: its engine, model, adapters, optimizer and data."""
    check_deepspeed_resume(resume_from, deepspeed=deepspeed, zero_stage=plan.zero.stage if plan.zero else None,
                           bf16=plan.precision.name == "bf16-mixed")
    check_resume_model(resume_from, config)
    check_resume_lora(resume_from, lora, quantize)
    check_resume_optimizer(resume_from, optimizer)
    check_stream_resume(load_training_state(resume_from, mmap=True)["data"],
                        streaming=getattr(flags["data"], "streaming", False),
                        data_parallel_size=plan.data_parallel_size, checkpoint=f"--resume {resume_from}")


def _launch(spec: RunSpec) -> None:
    """``run(spec)`` on every rank, with out_dir held for the whole run."""
    if spec.lora is not None and spec.fsdp.async_save:
        raise ValueError("--fsdp.async_save is for sharded checkpoints; LoRA checkpoints hold only the "
                         "adapters and are written by rank 0: drop --fsdp.async_save")
    # One writer per out_dir, for the whole run: the launching process (rank 0 under torchrun or srun) holds the lock.
    with out_dir_lock.hold(spec.out_dir) if is_first_process() else contextlib.nullcontext():
        launch(run, args=(spec,), devices=spec.plan.devices, num_nodes=spec.plan.num_nodes)
