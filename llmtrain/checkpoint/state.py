"""The training-state schema: what ``training_state.pt`` holds, built in one function and restored in one.

::

    train_state             step and token counters (``TrainState.state_dict()``)
    data                    the train loader's exact position (a streaming loader's: {"per_rank": [every rank's]})
    rng                     every rank's RNG states, a list indexed by rank
    scaler                  the fp16 loss scaler, or None
    world_size              the world size that wrote it
    optimizer_param_groups  lr, betas, the schedule's initial_lr ... of each group, without the params
    optimizer               full format only: the whole optimizer state (sharded keeps it in dcp/)

Everything in it loads with ``torch.load(weights_only=True)``: tensors, numbers, strings, lists and
dicts, never a pickled object that could run code.
"""

from __future__ import annotations

import pickle
import random
import re
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch

from llmtrain.checkpoint import layout


class Stateful(Protocol):
    """What a checkpoint saves and restores: the counters, the train loader, the loss scaler."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class DamagedCheckpointError(ValueError):
    """A checkpoint file is damaged or holds something llmtrain will not load; the message names the file."""


def data_state(train_loader: Stateful, all_gather_object: Callable[[Any], list]) -> dict:
    """The train loader's position, for ``training_state.pt``. Every rank calls it: a loader whose position
    differs per rank (``state_per_rank``, a streaming one) has every rank's gathered, and finds its own again
    in ``load_state_dict``."""
    if getattr(train_loader, "state_per_rank", False):
        return {"per_rank": all_gather_object(train_loader.state_dict())}
    return train_loader.state_dict()


def build_training_state(*, state: Stateful, data: dict, scaler: Optional[Stateful],
                         rng_states: list[dict], world_size: int, optimizer_state: dict,
                         include_optimizer: bool) -> dict:
    """The dict ``training_state.pt`` holds (see the module doc). ``data`` is :func:`data_state`'s.
    ``optimizer_state`` is a full optimizer state dict for the full format, or this rank's (only its param groups
    are kept) for the sharded one."""
    training_state = {
        "train_state": state.state_dict(),
        "data": data,
        "rng": rng_states,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "world_size": world_size,
        "optimizer_param_groups": param_group_settings(optimizer_state),
    }
    if include_optimizer:
        training_state["optimizer"] = optimizer_state
    return training_state


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """What this run's flags set in each param group (lr, betas, weight_decay, ...: the optimizer's arguments), to
    capture before a checkpoint's optimizer state overwrites them and to hand to :func:`restore_training_state`."""
    return [{key: group[key] for key in optimizer.defaults if key in group} for group in optimizer.param_groups]


def restore_training_state(training_state: dict, *, state: Stateful, train_loader: Stateful,
                           scaler: Optional[Stateful], rank: int, optimizer: Optional[torch.optim.Optimizer],
                           device: torch.device, settings: Optional[list[dict]] = None) -> None:
    """Counters, data position, loss scaler, param-group settings and this rank's RNG from ``training_state``.

    ``settings``: :func:`optimizer_settings` of this run, taken before the optimizer state was loaded. They win
    over the checkpoint's, so a run resumed with another ``--optimizer.lr`` (as a diverged run is told to) trains
    with it; the same flags give the saved values back.

    NOTE: loading an optimizer through a template state dict (DCP, or a broadcast from rank 0) keeps
    only the keys the fresh optimizer already has, so group entries added later, such as the LR
    schedule's ``initial_lr``, would be lost (or restored on rank 0 only). Every rank sets them here.
    """
    if optimizer is not None:
        saved_groups = training_state.get("optimizer_param_groups")
        if saved_groups is None and "optimizer" in training_state:
            saved_groups = param_group_settings(training_state["optimizer"])
        if saved_groups is not None:
            if len(saved_groups) != len(optimizer.param_groups):
                raise ValueError(f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this run's "
                                 f"has {len(optimizer.param_groups)}; resume with the same optimizer setup")
            for group, saved, own in zip(optimizer.param_groups, saved_groups, settings or [{}] * len(saved_groups)):
                group.update(saved)
                group.update(own)
                if "lr" in own and "initial_lr" in group:  # the schedule's base rate is this run's lr
                    group["initial_lr"] = own["lr"]
    state.load_state_dict(training_state["train_state"])
    train_loader.load_state_dict(training_state["data"])
    if scaler is not None and training_state.get("scaler"):
        scaler.load_state_dict(training_state["scaler"])
    rng_states = training_state["rng"]
    # NOTE: at a larger world size than saved, the new ranks take rank 0's RNG state.
    restore_rng_state(rng_states[rank] if rank < len(rng_states) else rng_states[0], device)


def param_group_settings(optimizer_state: dict) -> list[dict]:
    """The hyperparameters of each param group (lr, betas, the schedule's initial_lr, ...), without the params."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer_state["param_groups"]]


def load_training_state(checkpoint_dir: Path, mmap: bool = False) -> dict:
    """``training_state.pt`` of a step checkpoint, loaded with ``weights_only=True`` (it never runs code).

    A missing, truncated or refused file raises an error that names it, never a torch traceback.
    ``mmap``: map the tensors instead of reading them (to check a file without loading the optimizer).
    """
    path = Path(checkpoint_dir) / layout.STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {checkpoint_dir} is a model directory, not a "
                                "training checkpoint that --resume can continue from")
    try:
        training_state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        refused = refused_global(error)
        if refused:  # a pickled object that could run code when loaded
            raise DamagedCheckpointError(
                f"{path} holds objects that torch.load(weights_only=True) refuses ({refused}), so llmtrain "
                "will not load it: it could run code. Resume from a checkpoint llmtrain wrote (--resume PATH), or "
                "delete this one") from None
        raise DamagedCheckpointError(f"{path} cannot be read: it is not a file torch.save wrote, or it is damaged. "
                                     "Resume from an earlier checkpoint (--resume PATH), or delete this one") from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise DamagedCheckpointError(
            f"{path} cannot be read ({_first_line(error)}): the file is damaged or truncated. Resume from an "
            "earlier checkpoint (--resume PATH), or delete this one") from None
    if not isinstance(training_state, dict) or "train_state" not in training_state:
        raise DamagedCheckpointError(f"{path} is not an llmtrain training state (no train_state entry); resume "
                                        "from a checkpoint llmtrain wrote")
    return training_state


def refused_global(error: pickle.UnpicklingError) -> Optional[str]:
    """The name (``posix.system``) that ``torch.load(weights_only=True)`` refused to look up, or None when the
    file was refused for another reason (it is no pickle at all)."""
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    return refused.group(1) if refused else None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


# ------------------------------------------------------------------------------------------ RNG
def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """Every RNG a run on ``device`` draws from, in forms that ``torch.load(weights_only=True)`` accepts.

    NOTE: the CUDA generator is saved only for a run on a GPU. Asking whether CUDA is available instead
    would make a ``--accelerator cpu`` run on a GPU node create a CUDA context on every rank.
    """
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]) + [random.getstate()[0], random.getstate()[2]],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python[-2], tuple(python[:-2]), python[-1]))
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
