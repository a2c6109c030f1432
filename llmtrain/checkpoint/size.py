"""How many bytes a run's checkpoints take on disk: the one estimate, for the dry run and the disk check; and what
a save that ran out of space says."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

from llmtrain.config import Config
from llmtrain.flops import num_parameters


def checkpoint_bytes(config: Config, precision: Any, trainable_parameters: Optional[int] = None,
                     separate_final: bool = False) -> dict[str, int]:
    """Bytes on disk of the model weights, of one resumable step checkpoint, and what a run needs free.

    A step checkpoint holds the weights and AdamW's two moments, stored in the parameter dtype as
    torch.optim keeps them; LoRA step checkpoints hold only the adapters and their moments, and a LoRA
    run's final/ holds the merged model too. ``trainable_parameters`` below the total means LoRA.
    ``separate_final``: final/ is a copy of the weights of its own (sharded and DeepSpeed step checkpoints are
    not the model file that final/ holds); otherwise it links the last full step's files.
    """
    total = num_parameters(config)
    trainable = total if trainable_parameters is None else trainable_parameters
    stored = precision.param_dtype.itemsize
    weights = total * stored
    if trainable < total:
        step = 3 * trainable * stored
        return {"weights": weights, "step": step, "needed": weights + step}
    step = weights + 2 * trainable * stored
    return {"weights": weights, "step": step, "needed": step + weights if separate_final else step}


def final_is_separate(state_dict_type: str, plan: Any) -> bool:
    """Whether ``final/`` is a copy of the weights of its own: sharded (DCP) and DeepSpeed step checkpoints are not
    the model file it holds; a full one's files are linked into it."""
    return state_dict_type == "sharded" or plan.zero is not None


def check_disk_space(out_dir: Path, config: Config, precision: Any, trainable_parameters: Optional[int] = None,
                     separate_final: bool = False) -> None:
    """Refuse to start when --out_dir's disk cannot hold one checkpoint (and a LoRA run's merged final/).

    Estimated from the model size, so the message comes before hours of training, not at the first save.
    """
    parent = Path(out_dir)
    while not parent.exists():
        parent = parent.parent
    needed = int(checkpoint_bytes(config, precision, trainable_parameters, separate_final)["needed"] * 1.05)
    free = shutil.disk_usage(parent).free
    if free < needed:
        raise OSError(f"--out_dir {out_dir}: {free / 2**30:.1f} GiB free on its disk, but one checkpoint of "
                      f"{config.name or 'this model'} ({num_parameters(config) / 1e6:.0f}M parameters) needs about "
                      f"{needed / 2**30:.1f} GiB; free space or choose an --out_dir on a larger disk")


def check_weights_hold(config: Config, config_file: Path, weight_files: list[Path]) -> None:
    """Refuse a config that describes more parameters than its weight files could hold at one byte each, before
    anything is listed or allocated per layer (``n_layer: 1000000000`` would be, until the process is killed).

    What conversion checks: it streams the weights a tensor at a time, so no device need hold the model.
    """
    stored = sum(path.stat().st_size for path in weight_files)
    parameters = num_parameters(config)
    if parameters > stored:
        raise ValueError(f"{config_file} describes a model of {parameters:,} parameters, but its weight files "
                         f"({stored / 2**30:,.2f} GiB) could not hold that many even at one byte each: it is not "
                         "these weights' config; check n_layer, n_embd, intermediate_size and vocab_size in it")


OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL_BYTES = 64 * 2**20
"""Free space below which a failed write is taken for a full disk where the writer hid the errno: torch.save's
``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``, safetensors' ``SafetensorError``."""


class DiskFullError(OSError):
    """A save ran out of space or quota; its temporary directory is gone. The machine's state, not the command line's:
    exit 1 (llmtrain.errors)."""

    exit_status = 1


@contextlib.contextmanager
def disk_full_said(tmp: Path) -> Iterator[None]:
    """Writes into the temporary directory ``tmp`` that run out of space end in :class:`DiskFullError`, one line naming
    the disk and its free space, after ``tmp`` is removed: left behind, it would keep the disk full."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as error:
        tmp = Path(tmp)
        if not _out_of_space(error, tmp.parent):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        usage = shutil.disk_usage(tmp.parent)
        raise DiskFullError(
            f"no space left on the disk of {tmp.parent} (the filesystem mounted at {_mount_point(tmp.parent)}: "
            f"{usage.free / 2**30:,.2f} GiB free of {usage.total / 2**30:,.1f} GiB, after removing the unfinished "
            f"{tmp.name}): free space there, or choose an --out_dir on a larger disk, then resume with --resume auto"
        ) from error


def _out_of_space(error: BaseException, directory: Path) -> bool:
    """The error, or one it was raised from, says ENOSPC or EDQUOT; else the disk is (nearly) full now."""
    cause: Optional[BaseException] = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in OUT_OF_SPACE:
            return True
        cause = cause.__cause__ or cause.__context__
    try:
        return shutil.disk_usage(directory).free < NEARLY_FULL_BYTES
    except OSError:
        return False


def _mount_point(path: Path) -> Path:
    path = Path(path).resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path
