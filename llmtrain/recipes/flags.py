"""The flags every training recipe shares, defined once.

``pretrain``, ``finetune_full`` and ``finetune_lora`` take the same flags (where to write, precision, resume,
data, batch and schedule, optimizer, the process layout (data, tensor and pipeline parallel) and its timeout,
logging, seed, dry run, profiling). Each recipe's function declares only its own arguments and ``**flags``; :func:`shared_flags` adds the
shared ones to its signature and docstring, which is what jsonargparse reads, so ``--help`` lists every flag with
its type, default and one line of documentation, and a recipe may change a default or a line of doc.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

from llmtrain.args import DeepSpeedArgs, DryRunArgs, EvalArgs, FSDPArgs, ProfileArgs, TrainArgs
from llmtrain.data.base import DataModule
from llmtrain.distributed.parallel_plan import PipelineSchedule, StrategyName
from llmtrain.optim import OptimizerArg
from llmtrain.compiling import CompileSetting
from llmtrain.float8 import Float8Recipe
from llmtrain.precision import PrecisionName

ResumeArg = Union[bool, Literal["auto"], Path]
Accelerator = Literal["auto", "cpu", "cuda", "gpu"]
LoggerName = Literal["csv", "tensorboard", "wandb"]


@dataclass(frozen=True)
class Flag:
    name: str
    annotation: Any
    default: Any
    doc: str


SHARED_FLAGS = (
    Flag("out_dir", Path, Path("out"), "Where checkpoints (`step-NNNNNNNN/`, `final/`) and metrics.csv go."),
    Flag("precision", PrecisionName, "auto", "auto (bf16-mixed on a GPU with bf16, 16-mixed on an older GPU, 32-true "
         "on a CPU; the run prints its choice), 32-true, bf16-mixed, bf16-true, 16-mixed or 16-true."),
    Flag("resume", ResumeArg, False, "Continue this run: `auto` (the newest intact checkpoint in out_dir, if "
         "any), `true` (one must exist) or a checkpoint path."),
    Flag("data", Optional[DataModule], None, "The data module, e.g. `--data TextFiles --data.train_data_path DIR`."),
    Flag("train", TrainArgs, TrainArgs(), "Training length, batch sizes, schedule and clipping. Batch sizes left "
         "unset come from the zoo model's config_hub recipe (else global 64, micro 4; fine-tuning 16 and 1), the "
         "global one rounded up to a multiple of data-parallel size × micro batch, so that it always divides."),
    Flag("eval", EvalArgs, EvalArgs(), "Validation settings."),
    Flag("optimizer", OptimizerArg, "torch.optim.AdamW", "A torch.optim class name (`AdamW`, torch defaults) or "
         "`--optimizer CLASS --optimizer.lr 3e-4 ...` with its arguments."),
    Flag("devices", Union[int, Literal["auto"]], "auto", "Processes (devices) per node: a number, or auto / -1: "
         "every GPU of the node (one process on a CPU); under torchrun or srun, the processes it starts per node."),
    Flag("num_nodes", int, 1, "Number of nodes."),
    Flag("accelerator", Accelerator, "auto", "Where to train: auto (a GPU if there is one), cpu, cuda or gpu."),
    Flag("strategy", StrategyName, "auto", "Data parallelism: auto (FSDP when there is more than one process, "
         "nothing with one), ddp, fsdp (also on one device, e.g. for --fsdp.cpu_offload on a GPU), or DeepSpeed "
         "ZeRO (pip install 'llmtrain[deepspeed]'): deepspeed_stage_1, deepspeed_stage_2, deepspeed_stage_2_offload, "
         "deepspeed_stage_3, deepspeed_stage_3_offload, or deepspeed with --deepspeed.config."),
    Flag("fsdp", FSDPArgs, FSDPArgs(), "FSDP settings: sharding strategy, activation checkpointing, CPU offload, "
         "checkpoint format."),
    Flag("deepspeed", DeepSpeedArgs, DeepSpeedArgs(), "DeepSpeed settings: `--deepspeed.config FILE`, a DeepSpeed "
         "config (JSON) to take ZeRO, offload and communication settings from."),
    Flag("tp_size", int, 1, "Tensor parallelism: split every block's attention heads and MLP (and the embedding "
         "and head over the vocabulary) across this many processes of one node. Heads and query groups must "
         "divide by it."),
    Flag("tp_sequence_parallel", Optional[bool], None, "With --tp_size > 1, split the norms and the residual "
         "stream over the sequence between the tensor-parallel ranks (less activation memory). Default: on."),
    Flag("pp_size", int, 1, "Pipeline parallelism: split the blocks into this many stages, one group of "
         "processes each; the gradient-accumulation micro-batches become the pipeline's micro-batches."),
    Flag("pp_schedule", Optional[PipelineSchedule], None, "With --pp_size > 1: gpipe, 1f1b (the default; gpipe "
         "when a step has fewer micro-batches than --pp_size) or interleaved_1f1b (several stages per process, see "
         "--pp_virtual_stages)."),
    Flag("pp_virtual_stages", Optional[int], None, "With --pp_schedule interleaved_1f1b: stages per pipeline "
         "process (default 2)."),
    Flag("ep_size", int, 1, "Expert parallelism for a mixture-of-experts model: split each MoE block's routed "
         "experts over this many processes, taken from the FSDP shard (it must divide the shard and n_expert); "
         "tokens reach their experts' process by an all-to-all."),
    Flag("dist_timeout", float, 600.0, "Seconds a collective may wait for the other ranks before the run counts "
         "as hung and stops. Waits for work one rank does alone (tokenizing the data, reading or writing a "
         "checkpoint) go around the GPU and allow the larger of this and two hours."),
    Flag("compile", CompileSetting, "auto", "Compile every transformer block with torch.compile (before FSDP "
         "wraps it): 10 to 30 s of compilation at start, then faster steps (1.33x on an H200, 1.05-1.20x on 2-core "
         "CPUs, BENCHMARKS.md). auto (the default) compiles a pretraining run whose FLOPs need at least 10 "
         "minutes at the device's peak matmul rate, and says why at start; true or false decides outright."),
    Flag("float8", Optional[Float8Recipe], None, "Float8 training of the blocks' linear layers with torchao (pip "
         "install 'llmtrain[float8]'): tensorwise or rowwise scaling, on top of --precision bf16-mixed or bf16-true. "
         "Needs float8 tensor cores (H100, H200, L40S, L4, RTX 4090); under FSDP, tensorwise gathers the weights in "
         "float8."),
    Flag("logger_name", LoggerName, "csv", "Metrics go to out_dir/metrics.csv always; `tensorboard` adds "
         "TensorBoard logs, `wandb` a Weights & Biases run in out_dir/wandb (offline unless WANDB_MODE=online)."),
    Flag("seed", int, 42, "Seed for weight init, data order and dropout."),
    Flag("dry_run", DryRunArgs, DryRunArgs(), "`--dry_run` prints the plan (layout, batches, memory, checkpoint "
         "size, time) and exits."),
    Flag("profile", ProfileArgs, ProfileArgs(), "`--profile` records three steps with torch.profiler (or "
         "`--profile.start_step N --profile.end_step M`) into out_dir/profile/: a trace per rank, the top "
         "operators, a CUDA memory snapshot."),
)
SHARED_FLAG_NAMES = tuple(flag.name for flag in SHARED_FLAGS)


def shared_flags(*, defaults: Optional[dict[str, Any]] = None,
                 docs: Optional[dict[str, str]] = None) -> Callable[[Callable], Callable]:
    """Give a recipe ``fn(own arguments..., **flags)`` the shared flags, with these defaults and docs changed."""
    defaults, docs = defaults or {}, docs or {}
    unknown = (set(defaults) | set(docs)) - set(SHARED_FLAG_NAMES)
    if unknown:
        raise TypeError(f"not shared flags: {sorted(unknown)}")

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        added = [inspect.Parameter(flag.name, inspect.Parameter.KEYWORD_ONLY, annotation=flag.annotation,
                                   default=defaults.get(flag.name, flag.default)) for flag in SHARED_FLAGS]
        fn.__signature__ = signature.replace(parameters=[*own, *added])
        lines = [f"        {flag.name}: {docs.get(flag.name, flag.doc)}" for flag in SHARED_FLAGS]
        fn.__doc__ = (fn.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "\n"
        return fn

    return decorate


def with_defaults(fn: Callable, flags: dict[str, Any]) -> dict[str, Any]:
    """``flags`` completed with ``fn``'s defaults, for a recipe called from Python with only some flags."""
    unknown = set(flags) - set(SHARED_FLAG_NAMES)
    if unknown:
        raise TypeError(f"{fn.__name__}() got unexpected arguments {sorted(unknown)}")
    return {name: flags.get(name, parameter.default) for name, parameter in inspect.signature(fn).parameters.items()
            if name in SHARED_FLAG_NAMES}
