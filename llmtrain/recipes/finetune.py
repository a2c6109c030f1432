"""``llmtrain finetune_full``, ``finetune_lora`` and ``merge_lora``: adapt a model directory to new data.

Both recipes end in the same ``run()`` (and so the same ``fit()``) as pretraining; they differ only
in where the weights come from and which of them train.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, Optional

from llmtrain.args import BatchDefaults, EvalArgs, TrainArgs
from llmtrain.checkpoint import layout
from llmtrain.config import Config
from llmtrain.convert.hf import ensure_model_dir, hf_folder_config
from llmtrain.data import BuiltinInstruct
from llmtrain.lora import LoRAArgs
from llmtrain.model_dir import check_model_dir, merge_lora_checkpoint
from llmtrain.plan.memory import lora_trainable_parameters
from llmtrain.recipes import checks, hparams
from llmtrain.recipes.flags import shared_flags, with_defaults
from llmtrain.recipes.hub import with_default_length
from llmtrain.recipes.prepare import prepare
from llmtrain.distributed.parallel_plan import resolve_device_type
from llmtrain.precision import Precision, resolve_precision

QuantizeName = Literal["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8-training"]

FINETUNE_BATCH = BatchDefaults(global_batch_size=16, micro_batch_size=1, source="fine-tuning's defaults")
# No length here: one epoch is the default only of a run whose flags give none (_finetune), so that an explicit
# --train.max_steps is not capped by it.
FINETUNE_TRAIN = TrainArgs(lr_warmup_steps=100,
                           save_interval=1000, log_interval=1, min_lr=6e-5)
FINETUNE_EVAL = EvalArgs(interval=100, max_iters=100)
FINETUNE_DEFAULTS = {"train": FINETUNE_TRAIN, "eval": FINETUNE_EVAL, "seed": 1337}
FINETUNE_DOCS = {
    "data": "Instruction data, e.g. `--data JSON --data.json_path data.json`. Default: the built-in set.",
    "optimizer": "A torch.optim class name (`AdamW`) or `--optimizer CLASS --optimizer.lr 2e-5 ...` (a rate below "
                 "fine-tuning's --train.min_lr of 6e-5 needs a lower --train.min_lr too).",
}


@shared_flags(defaults={**FINETUNE_DEFAULTS, "out_dir": Path("out/finetune/full")},
              docs={**FINETUNE_DOCS, "seed": "Seed for data order and dropout."})
def setup_full(checkpoint_dir: Path, prompt_style: Optional[str] = None, **flags: Any) -> Optional[Path]:
    """Fine-tune every weight of a model directory on instruction data.

    Args:
        checkpoint_dir: The model to start from: a llmtrain model directory (`final/`, `step-*/`) or a
            transformers folder (config.json + safetensors), which is converted on the fly.
        prompt_style: How prompts are formatted (alpaca, chatml, llama3, ...). Default: the checkpoint's own
            prompt_style.yaml, else its chat template (as transformers would use it), else the model family's.
    """
    flags = with_defaults(setup_full, flags)
    return _finetune("finetune_full", checkpoint_dir, prompt_style, flags, lora=None, quantize=None)


@shared_flags(defaults={**FINETUNE_DEFAULTS, "out_dir": Path("out/finetune/lora")},
              docs={**FINETUNE_DOCS, "seed": "Seed for adapter init, data order and dropout.",
                    "out_dir": "Where adapter checkpoints, `final/` (the merged model and the adapters) and "
                               "metrics.csv go.",
                    "precision": "auto, 32-true, bf16-mixed, bf16-true, 16-mixed or 16-true. With --quantize: a `-true` one "
                                 "(auto: bf16-true on a GPU with bf16, 16-true on an older one, 32-true on a CPU).",
                    "fsdp": "FSDP settings: sharding strategy, activation checkpointing, CPU offload. Adapter "
                            "checkpoints are small and always written in full."})
def setup_lora(
    checkpoint_dir: Path,
    prompt_style: Optional[str] = None,
    quantize: Optional[QuantizeName] = None,
    lora_r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.05,
    lora_query: bool = True,
    lora_key: bool = False,
    lora_value: bool = True,
    lora_projection: bool = False,
    lora_mlp: bool = False,
    lora_head: bool = False,
    **flags: Any,
) -> Optional[Path]:
    """Fine-tune low-rank adapters on a frozen model directory (LoRA; QLoRA with --quantize).

    Args:
        checkpoint_dir: The model to start from: a llmtrain model directory (`final/`, `step-*/`) or a
            transformers folder (config.json + safetensors), which is converted on the fly.
        prompt_style: How prompts are formatted (alpaca, chatml, llama3, ...). Default: the checkpoint's own
            prompt_style.yaml, else its chat template (as transformers would use it), else the model family's.
        quantize: QLoRA: keep the frozen base weights in bitsandbytes layers (bnb.nf4, bnb.nf4-dq, bnb.fp4,
            bnb.fp4-dq, bnb.int8-training); adapters train in the precision's dtype. One device only (--devices
            auto means one). A mixture of experts' routed experts are quantized one expert at a time; its router
            stays in the precision's dtype.
        lora_r: Rank of the adapters.
        lora_alpha: Scale: the update is multiplied by lora_alpha / lora_r.
        lora_dropout: Dropout on the adapters' input.
        lora_query: Adapt the query projections.
        lora_key: Adapt the key projections.
        lora_value: Adapt the value projections.
        lora_projection: Adapt the attention output projections.
        lora_mlp: Adapt every linear layer of the MLPs; in a mixture of experts, every routed expert's projections
            and the shared experts (the router stays frozen).
        lora_head: Adapt the output layer (not with tied embeddings).
    """
    flags = with_defaults(setup_lora, flags)
    lora = LoRAArgs(lora_r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, lora_query=lora_query,
                    lora_key=lora_key, lora_value=lora_value, lora_projection=lora_projection, lora_mlp=lora_mlp,
                    lora_head=lora_head)
    if quantize is not None:
        _check_qlora(quantize, flags)
    if flags["fsdp"].state_dict_type == "sharded":
        raise ValueError("finetune_lora writes only the adapters, which are small, so its checkpoints are always "
                         "full; drop --fsdp.state_dict_type sharded")
    return _finetune("finetune_lora", checkpoint_dir, prompt_style, flags, lora=lora, quantize=quantize)


def _check_qlora(quantize: str, flags: dict[str, Any]) -> None:
    """QLoRA's flags: one device (auto means that one) and no data-parallel wrapper, in one dtype (auto: the ``-true``
    of auto's choice); ``flags`` get those defaults."""
    if flags["devices"] in ("auto", -1):  # a quantized base runs on one device; auto means that one
        flags["devices"] = 1
    if flags["precision"] == "auto":  # quantized layers compute in one dtype: the -true of auto's choice
        flags["precision"] = resolve_precision("auto", resolve_device_type(flags["accelerator"])).unmixed().name
    world = flags["devices"] * flags["num_nodes"]
    if flags["strategy"].startswith("deepspeed"):
        raise ValueError(f"--quantize {quantize} cannot train under --strategy {flags['strategy']}: DeepSpeed's "
                         "ZeRO partitions and casts every weight, which bitsandbytes' quantized layers do not "
                         "allow. Use --devices 1 and no --strategy for QLoRA, or LoRA without --quantize under "
                         f"--strategy {flags['strategy']}")
    if world > 1 or flags["strategy"] != "auto":
        split = [f"--{name} {flags[name]}" for name in ("tp_size", "pp_size") if flags[name] > 1]
        raise ValueError(f"--quantize {quantize} runs on one device without a data-parallel wrapper: "
                         "bitsandbytes' quantized weights cannot be sharded by FSDP"
                         + (f" nor split by {' or '.join(split)}" if split else "") + ". Use --devices 1 and "
                         f"no --strategy, or LoRA without --quantize on {world} devices")
    if Precision(flags["precision"]).is_mixed:
        raise ValueError(f"--quantize {quantize} with --precision {flags['precision']}: quantized layers compute "
                         "in one dtype; use --precision bf16-true (or 32-true)")


def _check_lora_on_moe(config: Config, lora: LoRAArgs, flags: dict[str, Any]) -> None:
    """Adapters on a mixture of experts' routed experts (``--lora_mlp``) train under torch's FSDP or on one device;
    expert parallelism (``--ep_size``, once the flags have it) places only the experts' own weights, and DeepSpeed's
    engine merges and loads only adapted linear layers."""
    if config.is_moe and lora.lora_mlp and (flags.get("ep_size") or 1) > 1:
        raise ValueError(f"--lora_mlp on {config.name!r} cannot train under --ep_size {flags['ep_size']}: expert "
                         "parallelism places the experts' weights, not their adapters. Use --ep_size 1 (FSDP shards "
                         "experts and adapters alike), or drop --lora_mlp to adapt the attention only")
    if config.is_moe and lora.lora_mlp and flags["strategy"].startswith("deepspeed"):
        raise ValueError(f"--lora_mlp on {config.name!r}, a mixture of experts, cannot train under --strategy "
                         f"{flags['strategy']}: DeepSpeed's engine adapts linear layers only, not the experts' 3-D "
                         "weights. Drop --strategy (torch's FSDP trains them), or drop --lora_mlp to adapt the "
                         "attention only")


def _finetune(recipe: str, checkpoint_dir: Path, prompt_style: Optional[str], flags: dict[str, Any],
              lora: Optional[LoRAArgs], quantize: Optional[str]) -> Optional[Path]:
    """The checks and the launch both fine-tuning recipes share; returns the run's final/ (None for a dry run)."""
    if flags["data"] is None:
        flags["data"] = BuiltinInstruct()
    if flags["train"].max_tokens is not None:
        raise ValueError(f"--train.max_tokens counts the tokens of full-width batches, as pretraining's are; "
                         f"{recipe}'s batches are as wide as their longest sample, so a token budget would neither "
                         "plan the schedule nor stop where it says. Use --train.max_steps or --train.epochs")
    data_style = getattr(flags["data"], "prompt_style", None)
    if None not in (prompt_style, data_style) and prompt_style != data_style:
        raise ValueError(f"--prompt_style {prompt_style} and --data.prompt_style {data_style} disagree: give one of "
                         "them (--data.prompt_style wins over the model's own style, which --prompt_style sets)")
    arguments = {"checkpoint_dir": checkpoint_dir, "prompt_style": prompt_style, **flags}
    if lora is not None:
        arguments.update(quantize=quantize, **dataclasses.asdict(lora))  # the fields are the lora_* flags
    hyperparameters = hparams.hyperparameters(arguments)
    flags["train"] = with_default_length(flags["train"], model_name=None)  # one epoch, where the flags set no length
    checkpoint_dir = Path(checkpoint_dir)
    config = hf_folder_config(checkpoint_dir) if flags["dry_run"].requested else None
    if config is None:
        # A transformers folder (config.json + weights) is converted once, on the fly, and cached; a dry run of
        # one reads its config.json alone.
        checkpoint_dir = check_model_dir(ensure_model_dir(checkpoint_dir), adapters=False)
        config = Config.from_file(checkpoint_dir / layout.CONFIG_FILE)
    if lora is not None:
        _check_lora_on_moe(config, lora, flags)
    checks.check_out_dir(flags["out_dir"])
    checks.check_logger(flags["logger_name"])
    resume_from = checks.resume_checkpoint(flags, None)
    return prepare(recipe, flags, config=config, resume_from=resume_from, initial_checkpoint_dir=checkpoint_dir,
                   lora=lora, quantize=quantize, prompt_style=prompt_style, hyperparameters=hyperparameters,
                   batch_defaults=FINETUNE_BATCH,
                   trainable_parameters=None if lora is None else lora_trainable_parameters(config, lora))


def merge_lora(checkpoint_dir: Path, out_dir: Optional[Path] = None) -> Path:
    """Merge a LoRA checkpoint's adapters into its base model and write a full model directory.

    Args:
        checkpoint_dir: A finetune_lora checkpoint (`step-NNNNNNNN/` or `final/`) with lora.safetensors and lora.yaml.
        out_dir: Where the merged model directory goes. Default: CHECKPOINT_DIR with `-merged` appended.
    """
    written = merge_lora_checkpoint(checkpoint_dir, out_dir)
    print(f"merged {checkpoint_dir} into {written}")
    return written
