"""The DeepSpeed config of a run: llmtrain's flags, completed by the user's ``--deepspeed.config`` file.

Pure Python (no deepspeed import), so the launching process checks everything before a worker starts. llmtrain's
flags own the batch sizes, the accumulation, the precision, clipping, the optimizer and the learning-rate
schedule; a file may leave each of those out or write ``"auto"`` (the convention of transformers' and
Accelerate's configs), and a value that contradicts the flag is an error naming both. Everything else in the
file (ZeRO's bucket sizes, overlap_comm, offload devices, communication settings) goes to DeepSpeed as written.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any, Optional

from llmtrain.args import TrainArgs
from llmtrain.distributed.parallel_plan import ParallelPlan, ZeroSettings

INSTALL_COMMAND = "pip install -c constraints.txt -e '.[deepspeed]'"
"""In a checkout (the constraints file pins torch, so pip does not fetch a CUDA build); from PyPI,
``pip install 'llmtrain[deepspeed]'``. ``./scripts/install.sh`` does the first."""

_OWNED_SECTIONS = {
    "optimizer": "--optimizer (e.g. --optimizer AdamW --optimizer.lr 3e-4)",
    "scheduler": "--train.lr_warmup_steps, --train.lr_decay and --train.min_lr",
    # NOTE: DeepSpeed's own checkpointing acts only through its deepspeed.checkpointing API, which llmtrain's
    # model does not call: the section would do nothing. torch's checkpointing runs under every strategy.
    "activation_checkpointing": "--fsdp.activation_checkpointing (full, selective:N or op; it applies under "
                                "DeepSpeed too)",
}


def require_deepspeed(strategy: str) -> None:
    """A ``ValueError`` with the command to run when the ``deepspeed`` package is not installed."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ValueError(f"--strategy {strategy} needs the deepspeed package, which is not installed: run "
                         f"{INSTALL_COMMAND} in the llmtrain checkout (./scripts/install.sh does it), "
                         "or pip install 'llmtrain[deepspeed]'")


def read_config(path: Path) -> dict:
    """The user's DeepSpeed config file as a dict; a missing or malformed file is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--deepspeed.config {path}: no such file")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--deepspeed.config {path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--deepspeed.config {path} must hold a JSON object (a DeepSpeed config)")
    for section, flag in _OWNED_SECTIONS.items():
        if section in config:
            raise ValueError(f"--deepspeed.config {path} has an {section!r} section, but llmtrain builds the "
                             f"{section} from its own flags: remove the section and use {flag}")
    return config


def zero_settings(config: dict, path: Path, named: Optional[ZeroSettings] = None) -> ZeroSettings:
    """What the file's ``zero_optimization`` section shards and offloads. What the file leaves out comes from the
    strategy named on the command line (``named``, for ``--strategy deepspeed_stage_N``), so a file of tuning
    alone works with any stage."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", named.stage if named else None)
    if stage is None:
        raise ValueError(f"--deepspeed.config {path} sets no zero_optimization.stage: add one (1, 2 or 3), or name the "
                         "stage with --strategy deepspeed_stage_1|2|3")
    if stage not in (1, 2, 3):
        raise ValueError(f"--deepspeed.config {path} sets zero_optimization.stage {stage}; llmtrain runs ZeRO stages "
                         "1, 2 and 3 (for plain data parallelism use --strategy ddp)")

    def offloaded(section: str, default: bool) -> bool:
        if section not in zero:
            return default
        return (zero[section] or {}).get("device", "none") not in ("none", None)

    offload_optimizer = offloaded("offload_optimizer", bool(named and named.offload_optimizer))
    offload_parameters = offloaded("offload_param", bool(named and named.offload_parameters))
    if offload_parameters and stage != 3:
        raise ValueError(f"--deepspeed.config {path}: zero_optimization.offload_param needs stage 3 (stage {stage} "
                         "keeps every parameter on each device)")
    return ZeroSettings(stage, offload_optimizer=offload_optimizer, offload_parameters=offload_parameters)


def build_config(plan: ParallelPlan, train: TrainArgs, user: Optional[dict] = None,
                 source: Optional[Path] = None) -> dict:
    """The DeepSpeed config of ``plan`` (``plan.zero`` set) and the batch-complete ``train``, over ``user``'s file."""
    config = copy.deepcopy(user or {})
    where = f"--deepspeed.config {source}"
    owned = {
        "train_batch_size": (plan.batch.global_batch_size, "--train.global_batch_size"),
        "train_micro_batch_size_per_gpu": (plan.batch.micro_batch_size, "--train.micro_batch_size"),
        "gradient_accumulation_steps": (plan.batch.grad_accum_steps, "the accumulation steps (global batch / "
                                                                     "(processes × micro batch))"),
        "gradient_clipping": (train.max_norm or 0.0, "--train.max_norm"),
    }
    for key, (ours, flag) in owned.items():
        theirs = config.get(key, "auto")
        if theirs != "auto" and theirs != ours:
            raise ValueError(f"{where} sets {key} {theirs}, but {flag} makes it {ours}: write \"auto\" (or {ours}) "
                             "in the file, or change the flag")
        config[key] = ours
    precision = plan.precision.name
    wanted = {"bf16": precision == "bf16-mixed", "fp16": precision == "16-mixed"}
    for key, on in wanted.items():
        section = config.get(key) or {}
        theirs = section.get("enabled", "auto")
        if theirs != "auto" and bool(theirs) != on:
            raise ValueError(f"{where} sets {key}.enabled {str(theirs).lower()}, but --precision {precision} "
                             f"{'needs it' if on else 'does not use it'}: write \"auto\" in the file, or change "
                             "--precision")
        config[key] = {**section, "enabled": on}
    if wanted["fp16"]:
        config["fp16"].setdefault("loss_scale", 0)  # dynamic loss scaling, as torch's GradScaler
    if wanted["bf16"]:
        _reduce_in_fp32(config)
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = plan.zero.stage
    pin = plan.device_type == "cuda"  # pinned host memory needs a GPU
    for key, on in (("offload_optimizer", plan.zero.offload_optimizer), ("offload_param", plan.zero.offload_parameters)):
        if on:
            zero[key] = {"device": "cpu", "pin_memory": pin, **(zero.get(key) or {})}
            if not pin:
                zero[key]["pin_memory"] = False
        else:
            zero.pop(key, None)
    config["zero_optimization"] = zero
    # llmtrain passes a torch optimizer (DeepSpeed's own CPU Adam needs a compiler at run time).
    config["zero_allow_untested_optimizer"] = True
    config["zero_force_ds_cpu_optimizer"] = False
    config.setdefault("steps_per_print", 2**31 - 1)  # llmtrain logs the steps itself
    config.setdefault("wall_clock_breakdown", False)
    return config


def _reduce_in_fp32(config: dict) -> None:
    """Under bf16, accumulate the micro-batches' gradients and reduce them between ranks in fp32, as FSDP's
    ``reduce_dtype`` does; a file that names either dtype keeps its choice.

    NOTE: DeepSpeed's default under ``bf16.enabled`` is bf16 for both: each micro-batch's gradient is added to a
    bf16 sum and the ranks' sums are added in bf16, so a gradient loses bits with every accumulation step and
    every rank (about 3 significant digits are left after the first addition). ``data_types.grad_accum_dtype``
    fp32 keeps the accumulation in fp32 (ZeRO 2 and 3 in their fp32 gradient partitions; ZeRO 1 through
    DeepSpeed's BF16_Optimizer, which partitions the fp32 master weights and optimizer state just the same), and
    ``communication_data_type`` fp32 casts each bucket to fp32 before the reduce. The traffic of the gradient
    reduction doubles, as it does under FSDP with its fp32 ``reduce_dtype``.
    """
    config["data_types"] = {**(config.get("data_types") or {})}
    config["data_types"].setdefault("grad_accum_dtype", "fp32")
    config.setdefault("communication_data_type", "fp32")


def resume_config(config: dict, checkpoint_dir: Path, world_size: int) -> dict:
    """``config`` for a run that resumes ``checkpoint_dir`` (a DeepSpeed checkpoint) on ``world_size`` processes.

    ZeRO's files hold each saving rank's partition. On another number of processes the engine must load them as
    DeepSpeed's universal checkpoint (``checkpoint.load_universal``, which it reads once, as it starts); the
    checkpointer converts the files to it (:meth:`llmtrain_deepspeed.checkpoint.DeepSpeedCheckpointer.load`).
    """
    from llmtrain.checkpoint import files

    if files.read_marker(Path(checkpoint_dir)).get("world_size") == world_size:
        return config
    return {**config, "checkpoint": {**(config.get("checkpoint") or {}), "load_universal": True}}
