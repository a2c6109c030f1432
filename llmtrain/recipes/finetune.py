"""``llmtrain finetune_full``, ``finetune_lora`` and ``merge_lora``: adapt a model directory to new data.

Both recipes end in the same ``run()`` (and so the same ``fit()``) as pretraining; they differ only
in where the weights come from and which of them train.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from llmtrain.args import EvalArgs, TrainArgs
from llmtrain.checkpoint import layout
from llmtrain.checkpoint.lora import merge_lora_checkpoint
from llmtrain.checkpoint.model_dir import check_model_dir
from llmtrain.config import Config
from llmtrain.convert.hf import ensure_model_dir
from llmtrain.data.base import DataModule
from llmtrain.distributed.parallelize import FSDPArgs
from llmtrain.plan import DryRunArgs, lora_trainable_parameters
from llmtrain.recipes import common
from llmtrain.train.precision import Precision, PrecisionName

QuantizeName = Literal["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8-training"]

FINETUNE_TRAIN = TrainArgs(global_batch_size=16, micro_batch_size=1, epochs=1.0, lr_warmup_steps=100,
                           save_interval=1000, log_interval=1, min_lr=6e-5)
FINETUNE_EVAL = EvalArgs(interval=100, max_iters=100)


def setup_full(
    checkpoint_dir: Path,
    out_dir: Path = Path("out/finetune/full"),
    precision: PrecisionName = "32-true",
    resume: common.ResumeArg = False,
    data: Optional[DataModule] = None,
    train: TrainArgs = FINETUNE_TRAIN,
    eval: EvalArgs = FINETUNE_EVAL,
    optimizer: common.OptimizerArg = "torch.optim.AdamW",
    devices: int = 1,
    num_nodes: int = 1,
    accelerator: Literal["auto", "cpu", "cuda"] = "auto",
    strategy: Literal["auto", "ddp", "fsdp"] = "auto",
    fsdp: FSDPArgs = FSDPArgs(),
    compile: bool = False,
    prompt_style: Optional[str] = None,
    logger_name: Literal["csv", "tensorboard", "wandb"] = "csv",
    seed: int = 1337,
    dry_run: DryRunArgs = DryRunArgs(),
) -> None:
    """Fine-tune every weight of a model directory on instruction data.

    Args:
        checkpoint_dir: The model to start from: a llmtrain model directory (`final/`, `step-*/`) or a
            transformers folder (config.json + safetensors), which is converted on the fly.
        out_dir: Where checkpoints (`step-NNNNNNNN/`, `final/`) and metrics.csv go.
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed or 16-true.
        resume: Continue this run: `auto` (the newest complete checkpoint in out_dir, if any), `true` or a path.
        data: Instruction data, e.g. `--data JSON --data.json_path data.json`. Default: the built-in set.
        train: Training length, batch sizes, schedule and clipping.
        eval: Validation settings.
        optimizer: A torch.optim class name (`AdamW`) or `--optimizer CLASS --optimizer.lr 2e-5 ...`.
        devices: Processes (devices) per node.
        num_nodes: Number of nodes.
        accelerator: Where to train: auto (GPU if there is one), cpu or cuda.
        strategy: Data parallelism across processes: auto (FSDP when there is more than one process), ddp or fsdp.
        fsdp: FSDP settings: sharding strategy, activation checkpointing, CPU offload, checkpoint format.
        compile: Compile every transformer block with torch.compile (before FSDP wraps it).
        prompt_style: How prompts are formatted (alpaca, chatml, llama3, ...). Default: the checkpoint's own
            prompt_style.yaml, else the model family's.
        logger_name: Metrics go to out_dir/metrics.csv always; `tensorboard` adds TensorBoard logs, `wandb`
            a Weights & Biases run in out_dir/wandb (offline unless WANDB_MODE=online).
        seed: Seed for data order and dropout.
        dry_run: `--dry_run` prints the plan (layout, batches, memory, checkpoint size, time) and exits.
    """
    arguments = common.arguments_of(setup_full, locals())
    _finetune("finetune_full", arguments, lora=None, quantize=None)


def setup_lora(
    checkpoint_dir: Path,
    out_dir: Path = Path("out/finetune/lora"),
    precision: PrecisionName = "32-true",
    quantize: Optional[QuantizeName] = None,
    resume: common.ResumeArg = False,
    data: Optional[DataModule] = None,
    train: TrainArgs = FINETUNE_TRAIN,
    eval: EvalArgs = FINETUNE_EVAL,
    optimizer: common.OptimizerArg = "torch.optim.AdamW",
    lora_r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.05,
    lora_query: bool = True,
    lora_key: bool = False,
    lora_value: bool = True,
    lora_projection: bool = False,
    lora_mlp: bool = False,
    lora_head: bool = False,
    devices: int = 1,
    num_nodes: int = 1,
    accelerator: Literal["auto", "cpu", "cuda"] = "auto",
    strategy: Literal["auto", "ddp", "fsdp"] = "auto",
    fsdp: FSDPArgs = FSDPArgs(),
    compile: bool = False,
    prompt_style: Optional[str] = None,
    logger_name: Literal["csv", "tensorboard", "wandb"] = "csv",
    seed: int = 1337,
    dry_run: DryRunArgs = DryRunArgs(),
) -> None:
    """Fine-tune low-rank adapters on a frozen model directory (LoRA; QLoRA with --quantize).

    Args:
        checkpoint_dir: The model to start from: a llmtrain model directory (`final/`, `step-*/`) or a
            transformers folder (config.json + safetensors), which is converted on the fly.
        out_dir: Where adapter checkpoints, `final/` (the merged model and the adapters) and metrics.csv go.
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed or 16-true. With --quantize: a `-true` one.
        quantize: QLoRA: keep the frozen base weights in bitsandbytes layers (bnb.nf4, bnb.nf4-dq, bnb.fp4,
            bnb.fp4-dq, bnb.int8-training); adapters train in the precision's dtype. One device only.
        resume: Continue this run: `auto` (the newest complete checkpoint in out_dir, if any), `true` or a path.
        data: Instruction data, e.g. `--data JSON --data.json_path data.json`. Default: the built-in set.
        train: Training length, batch sizes, schedule and clipping.
        eval: Validation settings.
        optimizer: A torch.optim class name (`AdamW`) or `--optimizer CLASS --optimizer.lr 2e-4 ...`.
        lora_r: Rank of the adapters.
        lora_alpha: Scale: the update is multiplied by lora_alpha / lora_r.
        lora_dropout: Dropout on the adapters' input.
        lora_query: Adapt the query projections.
        lora_key: Adapt the key projections.
        lora_value: Adapt the value projections.
        lora_projection: Adapt the attention output projections.
        lora_mlp: Adapt every linear layer of the MLPs.
        lora_head: Adapt the output layer (not with tied embeddings).
        devices: Processes (devices) per node.
        num_nodes: Number of nodes.
        accelerator: Where to train: auto (GPU if there is one), cpu or cuda.
        strategy: Data parallelism across processes: auto (FSDP when there is more than one process), ddp or fsdp.
        fsdp: FSDP settings: sharding strategy, activation checkpointing, CPU offload. Adapter checkpoints
            are small and always written in full.
        compile: Compile every transformer block with torch.compile (before FSDP wraps it).
        prompt_style: How prompts are formatted (alpaca, chatml, llama3, ...). Default: the checkpoint's own
            prompt_style.yaml, else the model family's.
        logger_name: Metrics go to out_dir/metrics.csv always; `tensorboard` adds TensorBoard logs, `wandb`
            a Weights & Biases run in out_dir/wandb (offline unless WANDB_MODE=online).
        seed: Seed for adapter init, data order and dropout.
        dry_run: `--dry_run` prints the plan (layout, batches, memory, checkpoint size, time) and exits.
    """
    from llmtrain.lora import LoRAArgs

    arguments = common.arguments_of(setup_lora, locals())
    lora = LoRAArgs(lora_r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, lora_query=lora_query,
                    lora_key=lora_key, lora_value=lora_value, lora_projection=lora_projection, lora_mlp=lora_mlp,
                    lora_head=lora_head)
    if quantize is not None:
        if devices * num_nodes > 1:
            raise ValueError(f"--quantize {quantize} runs on one device: bitsandbytes' quantized weights cannot be "
                             f"sharded by FSDP. Use --devices 1, or LoRA without --quantize on {devices * num_nodes} "
                             "devices")
        if Precision(precision).is_mixed:
            raise ValueError(f"--quantize {quantize} with --precision {precision}: quantized layers compute in one "
                             "dtype; use --precision bf16-true (or 32-true)")
    if fsdp.state_dict_type == "sharded":
        raise ValueError("finetune_lora writes only the adapters, which are small, so its checkpoints are always "
                         "full; drop --fsdp.state_dict_type sharded")
    _finetune("finetune_lora", arguments, lora=lora, quantize=quantize)


def _finetune(recipe: str, arguments: dict, lora, quantize: Optional[str]) -> None:
    """The checks and the launch both fine-tuning recipes share."""
    from llmtrain.data import BuiltinInstruct
    from llmtrain.recipes.run import RunSpec, run

    if arguments["data"] is None:
        arguments["data"] = BuiltinInstruct()
    hyperparameters = common.hyperparameters(arguments)
    # A transformers folder (config.json + weights) is converted once, on the fly, and cached.
    checkpoint_dir = check_model_dir(ensure_model_dir(Path(arguments["checkpoint_dir"])))
    config = Config.from_file(checkpoint_dir / layout.CONFIG_FILE)
    common.check_out_dir(arguments["out_dir"])
    common.check_logger(arguments["logger_name"])
    dry = arguments["dry_run"]
    if dry.requested:
        from llmtrain.plan import dry_run

        common.check_seq_len(arguments["train"], config)
        dry_run(recipe=recipe, config=config, precision=Precision(arguments["precision"]), train=arguments["train"],
                devices=arguments["devices"], num_nodes=arguments["num_nodes"], strategy=arguments["strategy"],
                fsdp=arguments["fsdp"], dry=dry, out_dir=arguments["out_dir"], quantize=quantize,
                trainable_parameters=None if lora is None else lora_trainable_parameters(config, lora))
        return
    common.check_disk_space(arguments["out_dir"], config, Precision(arguments["precision"]),
                            trainable_parameters=None if lora is None else lora_trainable_parameters(config, lora))
    resume_from = common.resolve_resume(arguments["resume"], arguments["out_dir"], None)
    train = arguments["train"]
    seq_len = common.check_seq_len(train, config)
    arguments["data"].validate()
    spec = RunSpec(recipe=recipe, config=config, out_dir=Path(arguments["out_dir"]),
                   precision=Precision(arguments["precision"]), data=arguments["data"], train=train,
                   eval=arguments["eval"], optimizer=arguments["optimizer"], seq_len=seq_len,
                   hyperparameters=hyperparameters, seed=arguments["seed"], accelerator=arguments["accelerator"],
                   strategy=arguments["strategy"], fsdp=arguments["fsdp"], compile=arguments["compile"],
                   num_nodes=arguments["num_nodes"], logger_name=arguments["logger_name"], resume_from=resume_from,
                   initial_checkpoint_dir=checkpoint_dir, lora=lora, quantize=quantize,
                   prompt_style=arguments["prompt_style"])
    common.launch_run(run, spec, devices=arguments["devices"], num_nodes=arguments["num_nodes"])


def merge_lora(checkpoint_dir: Path, out_dir: Optional[Path] = None) -> None:
    """Merge a LoRA checkpoint's adapters into its base model and write a full model directory.

    Args:
        checkpoint_dir: A finetune_lora checkpoint (`step-NNNNNNNN/` or `final/`) with lora.safetensors and lora.yaml.
        out_dir: Where the merged model directory goes. Default: CHECKPOINT_DIR with `-merged` appended.
    """
    written = merge_lora_checkpoint(checkpoint_dir, out_dir)
    print(f"merged {checkpoint_dir} into {written}")
