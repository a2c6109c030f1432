"""The checkpoint contract: one place that knows the layout of a model directory.

A *model directory* (``out_dir/final/``, or any ``step-NNNNNNNN/``) holds::

    model.safetensors        the full weights (tied weights stored once)
    model_config.yaml        the architecture (llmtrain.config.Config)
    hyperparameters.yaml     the resolved command-line config of the run that wrote it
    tokenizer.json, tokenizer_config.json
    checkpoint.json          written last; its presence marks the directory complete

A *training checkpoint* (``step-NNNNNNNN/``) adds ``training_state.pt``: optimizer, step counters,
data position and RNG state, so ``--resume`` continues exactly.

Every directory is written under a temporary name and renamed into place, so a crash leaves
either a complete checkpoint or none.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import yaml

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "model_config.yaml"
HPARAMS_FILE = "hyperparameters.yaml"
STATE_FILE = "training_state.pt"
MARKER_FILE = "checkpoint.json"
STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def is_complete(path: Path) -> bool:
    """A checkpoint counts only when its marker, written last, is there."""
    return (Path(path) / MARKER_FILE).is_file()


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """Complete ``step-*`` checkpoints in ``out_dir``, oldest first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = []
    for child in out_dir.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child) and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(out_dir: Path) -> Optional[Path]:
    checkpoints = list_checkpoints(out_dir)
    return checkpoints[-1][1] if checkpoints else None


# --------------------------------------------------------------------------------------- writing
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for file in path.iterdir():
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(path)


def model_weights_for_saving(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the second name of tied tensors (safetensors stores each storage once) and make contiguous."""
    seen: dict[tuple[int, int], str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if tensor.numel() and key in seen:
            continue
        seen[key] = name
        out[name] = tensor.detach().contiguous()
    return out


def write_model_dir(target: Path, *, state_dict: dict[str, torch.Tensor], model_config: Any,
                    hyperparameters: Optional[dict], tokenizer: Any, extra_files: Optional[dict[str, Any]] = None,
                    marker: Optional[dict] = None, weights_file: str = MODEL_FILE,
                    write_extras: Optional[Callable[[Path], None]] = None) -> Path:
    """Write a complete model directory atomically at ``target`` (replacing nothing that exists).

    ``extra_files`` maps file names to objects saved with ``torch.save`` (the training state);
    ``write_extras(directory)`` adds any other files (the prompt style, LoRA settings) before the marker.
    """
    from safetensors.torch import save_file

    target = Path(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(model_weights_for_saving(state_dict), str(tmp / weights_file), metadata={"format": "pt"})
    model_config.save(tmp / CONFIG_FILE)
    if hyperparameters is not None:
        (tmp / HPARAMS_FILE).write_text(yaml.safe_dump(hyperparameters, sort_keys=False))
    if tokenizer is not None:
        tokenizer.save(tmp)
    for name, obj in (extra_files or {}).items():
        torch.save(obj, tmp / name)
    if write_extras is not None:
        write_extras(tmp)
    meta = {"format_version": FORMAT_VERSION, "written_at": time.time(),
            "files": sorted(p.name for p in tmp.iterdir()), **(marker or {})}
    (tmp / MARKER_FILE).write_text(json.dumps(meta, indent=2))
    _fsync_tree(tmp)
    if target.exists():
        # NOTE: only reached when a run rewrites the same step (e.g. final/ after a resume);
        # the old copy goes away only once the new one is complete on disk.
        trash = target.parent / f".{target.name}.old-{os.getpid()}"
        os.replace(target, trash)
        os.replace(tmp, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, target)
    _fsync_dir(target.parent)
    return target


def link_model_dir(source: Path, target: Path) -> Path:
    """Make ``target`` a model directory with the same model files as ``source`` (hard links where possible)."""
    source, target = Path(source), Path(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        if not file.is_file() or file.name in (STATE_FILE, MARKER_FILE):
            continue
        try:
            os.link(file, tmp / file.name)
        except OSError:
            shutil.copy2(file, tmp / file.name)
    meta = json.loads((source / MARKER_FILE).read_text())
    meta["files"] = sorted(p.name for p in tmp.iterdir())
    meta["source"] = source.name
    meta["kind"] = "model"
    (tmp / MARKER_FILE).write_text(json.dumps(meta, indent=2))
    _fsync_tree(tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    _fsync_dir(target.parent)
    return target


# --------------------------------------------------------------------------------------- reading
def load_model_weights(model: torch.nn.Module, checkpoint_dir: Path) -> None:
    """Load ``model.safetensors`` into ``model`` (a plain, unsharded module), checking every key."""
    from safetensors.torch import load_file

    path = Path(checkpoint_dir) / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a model directory needs {MODEL_FILE}")
    state_dict = load_file(str(path))
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    # Tied weights are stored once: a missing key is fine when it shares storage with a loaded one.
    tied = _tied_names(model)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"{path} does not match the model: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    for name, tensor in state_dict.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, the model config expects "
                             f"{tuple(expected[name].shape)}")
    model.load_state_dict(state_dict, strict=False)


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Names that refer to a parameter already registered under another name."""
    seen: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        else:
            seen[id(param)] = name
    return tied


def load_training_state(checkpoint_dir: Path) -> dict:
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {checkpoint_dir} is a model directory, not a "
                                "training checkpoint that --resume can continue from")
    return torch.load(path, map_location="cpu", weights_only=True)


def read_hyperparameters(checkpoint_dir: Path) -> dict:
    path = Path(checkpoint_dir) / HPARAMS_FILE
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


# ------------------------------------------------------------------------------------------ RNG
def capture_rng_state() -> dict[str, Any]:
    """Every RNG a run draws from, in forms that ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]) + [random.getstate()[0], random.getstate()[2]],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python[-2], tuple(python[:-2]), python[-1]))
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
