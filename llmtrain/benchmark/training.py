"""The run a benchmark times: a real recipe (pretrain, or fine-tuning from a model directory of random weights) on
the built-in corpus, with the training loader timed, a log row per step and no validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, Optional

import torch

from llmtrain.args import EvalArgs, FSDPArgs, TrainArgs
from llmtrain.benchmark.data_timing import TimedData
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.lora import LoRAArgs

RecipeName = Literal["pretrain", "finetune_lora", "finetune_full"]


def _train_args(micro_batch_size: int, global_batch_size: int, seq_len: int, total_steps: int,
                save_interval: Optional[int]) -> TrainArgs:
    """A log row per step, checkpoints only as --save_interval says."""
    return TrainArgs(micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                     max_seq_length=seq_len, max_steps=total_steps, log_interval=1, lr_warmup_steps=1,
                     save_interval=save_interval)


def _train(run_dir: Path, *, model: str, plan: ParallelPlan, fsdp: FSDPArgs, train: TrainArgs,
           compile: bool, strategy: str = "auto", recipe: RecipeName = "pretrain",
           lora: Optional[LoRAArgs] = None, quantize: Optional[str] = None, **extra: Any) -> None:
    """The recipe on the built-in corpus with the plan's layout, no validation; fine-tuning from random weights.
    ``quantize`` (finetune_lora only) makes it QLoRA. ``extra`` goes to the recipe's setup as it is (``profile=ProfileArgs(...)`` for bench/ab/profile_step.py)."""
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
        finetune.setup_lora(base, **dataclasses.asdict(lora), quantize=quantize, **flags)


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
