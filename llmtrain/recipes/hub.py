"""Recipes in ``config_hub/`` as a source of defaults: a zoo model's own recipe sets its batch sizes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import yaml

from llmtrain.args import BatchDefaults, TrainArgs
from llmtrain.config import resolve_name

CONFIG_HUB = Path(__file__).resolve().parents[2] / "config_hub"
"""The recipes of the source tree llmtrain runs from (absent from an installed wheel: then no recipe applies)."""


def pretrain_recipe(model_name: str, hub: Path = CONFIG_HUB) -> Optional[Path]:
    """The ``config_hub/pretrain`` recipe that trains zoo model ``model_name``, if there is one."""
    for path in sorted((hub / "pretrain").glob("*.yaml")):
        recipe = yaml.safe_load(path.read_text()) or {}
        name = recipe.get("model_name")
        if isinstance(name, str) and resolve_name(name) == model_name:
            return path
    return None


LENGTH_FIELDS = ("max_steps", "max_tokens", "epochs")


def pretrain_batch_defaults(model_name: Optional[str], hub: Path = CONFIG_HUB) -> BatchDefaults:
    """The batch sizes of the model's pretraining recipe, else llmtrain's defaults (global 64, micro 4)."""
    path = pretrain_recipe(model_name, hub) if model_name else None
    if path is None:
        return BatchDefaults()
    train = _train_section(path)
    fallback = BatchDefaults()
    return BatchDefaults(global_batch_size=train.get("global_batch_size") or fallback.global_batch_size,
                         micro_batch_size=train.get("micro_batch_size") or fallback.micro_batch_size,
                         source=_shown(path))


def with_default_length(train: TrainArgs, model_name: Optional[str], hub: Path = CONFIG_HUB) -> TrainArgs:
    """``train`` with a training length when the flags give none: the model's pretraining recipe's (TinyLlama:
    3T tokens), else one pass over the data (``epochs 1``). ``max_time`` alone still needs one to size the schedule."""
    if any(getattr(train, name) is not None for name in LENGTH_FIELDS):
        return train
    path = pretrain_recipe(model_name, hub) if model_name else None
    section = _train_section(path) if path is not None else {}
    length = {name: section[name] for name in LENGTH_FIELDS if section.get(name) is not None}
    return replace(train, **(length or {"epochs": 1.0}))


def _train_section(path: Path) -> dict:
    return (yaml.safe_load(path.read_text()) or {}).get("train") or {}


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(CONFIG_HUB.parent))
    except ValueError:
        return str(path)
