"""Checks a recipe runs before any process, tokenizer or model exists: each names the flag and the fix."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Optional

from llmtrain.checkpoint import layout
from llmtrain.checkpoint.resume import resolve_resume
from llmtrain.config import Config


def resolve_model_config(model_name: Optional[str], model_config: Optional[Config],
                         initial_checkpoint_dir: Optional[Path] = None) -> Config:
    """Exactly one source of the architecture: a zoo name, an explicit config, or a model directory."""
    if model_name is not None and model_config is not None:
        raise ValueError("give either a model name from the zoo or --model_config, not both "
                         "(to change a zoo model, copy its model_config.yaml and edit it)")
    if model_config is not None:
        return model_config
    if model_name is not None:
        return Config.from_name(model_name)
    if initial_checkpoint_dir is not None:
        path = Path(initial_checkpoint_dir) / layout.CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"--initial_checkpoint_dir {initial_checkpoint_dir} has no {layout.CONFIG_FILE}")
        return Config.from_file(path)
    raise ValueError("no model given: pass a zoo name (`llmtrain pretrain list` shows them) or --model_config FILE")


def check_out_dir(out_dir: Path) -> None:
    """Fail now, not after hours of training, if checkpoints could not be written."""
    out_dir = Path(out_dir)
    parent = out_dir
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"--out_dir {out_dir}: {parent} is a file, not a directory; choose another --out_dir")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"--out_dir {out_dir}: {parent} is not writable; choose a directory you can write to")
    if out_dir.exists():
        try:
            with tempfile.NamedTemporaryFile(dir=out_dir):
                pass
        except OSError as error:
            raise PermissionError(f"--out_dir {out_dir} is not writable ({error})") from error


def check_logger(logger_name: str) -> None:
    """A logger whose package is missing fails now, not after the model is built."""
    import importlib.util

    package = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(logger_name)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(f"--logger_name {logger_name} needs the {package} package: pip install {package}, "
                         "or use --logger_name csv")


def check_seq_len(train: Any, config: Config) -> int:
    """The sample length: --train.max_seq_length, else the model's block size, never beyond it."""
    seq_len = train.max_seq_length or config.block_size
    if seq_len > config.block_size:
        raise ValueError(f"--train.max_seq_length {seq_len} exceeds the block_size {config.block_size} of "
                         f"{config.name or 'the model'}; lower it to at most {config.block_size}")
    return seq_len


def resume_checkpoint(flags: dict[str, Any], initial_checkpoint_dir: Optional[Path]) -> Optional[Path]:
    """The checkpoint ``--resume`` continues from (``checkpoint.resume.resolve_resume``), or None. A dry run checks
    the one it names as a run would, and plans whatever ``--out_dir`` holds when it resumes nothing."""
    if flags["dry_run"].requested and flags["resume"] in (False, None):
        return None
    return resolve_resume(flags["resume"], flags["out_dir"], initial_checkpoint_dir)
