"""How many bytes a run's checkpoints take on disk: the one estimate, for the dry run and the disk check."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

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
