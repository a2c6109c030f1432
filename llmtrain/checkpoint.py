"""The checkpoint contract: one place that knows the layout of a model directory.

A *model directory* (``out_dir/final/``, or any ``step-NNNNNNNN/``) holds::

    model.safetensors        the full weights (tied weights stored once)
    model_config.yaml        the architecture (llmtrain.config.Config)
    hyperparameters.yaml     the resolved command-line config of the run that wrote it
    tokenizer.json, tokenizer_config.json
    checkpoint.json          written last; its presence marks the directory complete

A *training checkpoint* (``step-NNNNNNNN/``) adds ``training_state.pt``: optimizer, step counters,
data position and RNG state, so ``--resume`` continues exactly.

Every directory is written under a temporary name (``.step-NNNNNNNN.tmp*``), fsynced and renamed
into place, so a crash leaves either a complete checkpoint or none. Resume looks only at complete
``step-*`` directories; the next save deletes what a killed save left behind. Weights that hold NaN
or inf are never written (:func:`check_finite_weights`), and ``--train.keep_last N`` deletes older
step checkpoints only once a newer one is complete (:func:`prune_checkpoints`).

Test hook: ``LLMTRAIN_TEST_SLOW_SAVE=SECONDS`` makes every save sleep after its weights are written
and before its marker, so that a test can kill the run in the middle of a save.
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
# What an interrupted save leaves: its temporary directory, or the old copy it was about to delete.
LEFTOVER_DIR = re.compile(r"^\.(step-\d{8}|final)\.(tmp|old)")
SLOW_SAVE_ENV = "LLMTRAIN_TEST_SLOW_SAVE"


class NonFiniteWeightsError(RuntimeError):
    """The weights hold NaN or inf; no checkpoint was written."""


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


# ----------------------------------------------------------------------------------- housekeeping
def remove_leftovers(out_dir: Path) -> list[Path]:
    """Delete the temporary directories of saves that were killed (never a complete checkpoint).

    Call on one rank, before a save starts, while no other save writes into ``out_dir``.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    removed = [child for child in out_dir.iterdir() if LEFTOVER_DIR.match(child.name) and child.is_dir()]
    for child in removed:
        shutil.rmtree(child, ignore_errors=True)
    return removed


def prune_checkpoints(out_dir: Path, keep_last: Optional[int], keep: Optional[Path] = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete step checkpoints (never ``keep``, the one just written).

    Each goes in two moves: a rename to a leftover name (atomic), then the deletion, so a crash in
    between never leaves a half-deleted directory that still looks complete.
    """
    if keep_last is None:
        return []
    checkpoints = [path for _, path in list_checkpoints(out_dir)]
    doomed = [path for path in checkpoints[:-keep_last] if keep is None or path.resolve() != Path(keep).resolve()]
    for path in doomed:
        trash = path.parent / f".{path.name}.old-{os.getpid()}"
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def check_finite_weights(model: torch.nn.Module, runtime: Any, target: Path) -> None:
    """Refuse to write ``target`` when any weight holds NaN or inf. Every rank calls it (a collective).

    Each rank checks its own shards; one all-reduce of the count makes the verdict the same everywhere,
    so all ranks raise together instead of leaving the others waiting in the save.
    """
    from torch.distributed.tensor import DTensor

    named = [(name, param.to_local() if isinstance(param, DTensor) else param)
             for name, param in model.named_parameters()]
    if not named:
        return
    finite = torch.stack([torch.isfinite(tensor.detach()).all().to(runtime.device) for _, tensor in named])
    bad_count = (~finite).sum().double().reshape(1)
    if runtime.all_reduce(bad_count).item() == 0:
        return
    local_bad = [name for (name, _), ok in zip(named, finite.tolist()) if not ok]
    names = sorted({name for names in runtime.all_gather_object(local_bad) for name in names})
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise NonFiniteWeightsError(
        f"refusing to write {target}: {len(names)} weight tensor(s) hold NaN or inf ({shown}). The run has "
        "diverged; resume from an earlier checkpoint (--resume PATH) with a lower learning rate, a longer "
        "warmup or stronger clipping (--train.max_norm)")


def pause_during_save() -> None:
    """Test hook: sleep ``$LLMTRAIN_TEST_SLOW_SAVE`` seconds in the middle of a save (see the module doc)."""
    seconds = os.environ.get(SLOW_SAVE_ENV)
    if seconds:
        time.sleep(float(seconds))


# --------------------------------------------------------------------------------------- writing
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file and directory under ``path`` to disk (before the rename that publishes it)."""
    for file in sorted(path.rglob("*")):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
        elif file.is_dir():
            fsync_dir(file)
    fsync_dir(path)


def install_dir(tmp: Path, target: Path) -> None:
    """Rename the complete, fsynced directory ``tmp`` to ``target``, replacing an older ``target``.

    NOTE: a directory cannot replace a non-empty one in one rename. The old copy first moves to a
    leftover name and is deleted only once the new one is in place; a crash in between leaves no
    ``target`` and a leftover that the next save deletes (the step checkpoints are still there).
    """
    if target.exists():
        trash = target.parent / f".{target.name}.old-{os.getpid()}"
        os.replace(target, trash)
        os.replace(tmp, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, target)
    fsync_dir(target.parent)


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
    pause_during_save()
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
    fsync_tree(tmp)
    install_dir(tmp, target)
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
    fsync_tree(tmp)
    install_dir(tmp, target)
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
