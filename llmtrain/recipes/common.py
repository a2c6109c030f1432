"""Checkpoint-facing pieces every recipe shares: the disk-space check, which checkpoint to resume, base weights.

(The rest of the former grab-bag lives in recipes/checks.py, recipes/build.py, recipes/hparams.py and
llmtrain/optim.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch

from llmtrain import checkpoint as layout
from llmtrain.config import Config

ResumeArg = Union[bool, Literal["auto"], Path]


def check_disk_space(out_dir: Path, config: Config, precision: Any, trainable_fraction: float = 1.0) -> None:
    """Refuse to start when --out_dir's disk cannot hold one checkpoint (weights + AdamW's two moments).

    Estimated from the model size, so the message comes before hours of training, not at the first save.
    """
    import shutil

    from llmtrain.flops import num_parameters

    parent = Path(out_dir)
    while not parent.exists():
        parent = parent.parent
    params = num_parameters(config)
    weight_bytes = params * torch.finfo(precision.param_dtype).bits // 8
    optimizer_bytes = 2 * 4 * params * trainable_fraction  # fp32 first and second moments
    needed = int((weight_bytes + optimizer_bytes) * 1.05)
    free = shutil.disk_usage(parent).free
    if free < needed:
        raise OSError(f"--out_dir {out_dir}: {free / 2**30:.1f} GiB free on its disk, but one checkpoint of "
                      f"{config.name or 'this model'} ({params / 1e6:.0f}M parameters) needs about "
                      f"{needed / 2**30:.1f} GiB; free space or choose an --out_dir on a larger disk")


def resolve_resume(resume: ResumeArg, out_dir: Path, initial_checkpoint_dir: Optional[Path]) -> Optional[Path]:
    """Which checkpoint to continue from, or None for a fresh run."""
    if resume not in (False, None) and initial_checkpoint_dir is not None:
        raise ValueError("--resume and --initial_checkpoint_dir contradict each other: resume continues this run's "
                         "own checkpoint, initial_checkpoint_dir starts a new run from weights; pass only one")
    latest = layout.latest_checkpoint(out_dir)
    if resume is False or resume is None:
        if latest is not None:
            raise ValueError(f"--out_dir {out_dir} already holds checkpoints of a run (newest: {latest.name}); "
                             "pass --resume auto to continue it, or choose another --out_dir")
        return None
    if resume == "auto":
        return latest
    if resume is True:
        if latest is None:
            raise FileNotFoundError(f"--resume true: no complete checkpoint in --out_dir {out_dir}; "
                                    "use --resume auto to start fresh when there is none")
        return latest
    path = Path(resume)
    if not layout.is_complete(path) or not (path / layout.STATE_FILE).is_file():
        raise FileNotFoundError(f"--resume {path} is not a complete training checkpoint "
                                f"(it needs {layout.STATE_FILE} and {layout.MARKER_FILE})")
    return path


def load_base_weights(model: torch.nn.Module, checkpoint_dir: Path) -> None:
    """Load a model directory's full weights into a plain, LoRA, DDP or FSDP model; rank 0 reads the file.

    Every weight of the model except LoRA adapters must be in the file, with the right shape.
    """
    from safetensors.torch import load_file

    from llmtrain.distributed.checkpoint import load_full_model_state
    from llmtrain.distributed.parallelize import unwrap
    from llmtrain.lora import is_lora_parameter, plain_to_lora_keys

    path = Path(checkpoint_dir) / layout.MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a model directory needs {layout.MODEL_FILE}")
    gpt = unwrap(model)
    is_main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    weights: dict = {}
    if is_main:
        weights = plain_to_lora_keys(load_file(str(path)), gpt)
        expected = {name: tuple(t.shape) for name, t in gpt.state_dict().items() if not is_lora_parameter(name)}
        tied = layout._tied_names(gpt)
        missing = [k for k in expected if k not in weights and k not in tied]
        unexpected = [k for k in weights if k not in expected]
        if missing or unexpected:
            raise ValueError(f"{path} does not match the model config: missing keys {missing[:5]}, "
                             f"unexpected keys {unexpected[:5]}")
        for name, tensor in weights.items():
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, the model config expects "
                                 f"{expected[name]}")
    load_full_model_state(model, weights, strict=False)
