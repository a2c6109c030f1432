"""A recipe's arguments as YAML that ``--config`` accepts back (``hyperparameters.yaml`` in every checkpoint)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from llmtrain.optim import OptimizerArg, build_optimizer


def arguments_of(function: Callable, local_vars: dict) -> dict:
    """The values of ``function``'s parameters among ``local_vars`` (a recipe's ``locals()``)."""
    return {name: local_vars[name] for name in inspect.signature(function).parameters if name in local_vars}


def to_yaml(value: Any) -> Any:
    """Plain YAML types for dataclasses, paths, tuples and tensors."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_yaml(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [to_yaml(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_yaml(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def hyperparameters(arguments: dict) -> dict:
    """A recipe's arguments as YAML that ``--config`` accepts back (call with the recipe's ``locals()`` first thing).

    The optimizer's entry stays None here: :func:`optimizer_spec` builds a probe optimizer, whose first
    construction imports torch._dynamo (1.6 s), so the caller fills it in once the cheaper checks have passed.
    """
    out = {}
    for name, value in arguments.items():
        if name == "optimizer":
            out[name] = None
        elif name == "data":
            out[name] = data_spec(value)
        else:
            out[name] = to_yaml(value)
    return out


def data_spec(data: Any) -> Optional[dict]:
    if data is None:
        return None
    return {"class_path": f"{type(data).__module__}.{type(data).__name__}", "init_args": to_yaml(data)}


def optimizer_spec(spec: OptimizerArg) -> dict:
    """A YAML-able description (class_path + init_args) that ``--optimizer`` accepts back."""
    try:
        probe = build_optimizer(spec, [torch.nn.Parameter(torch.zeros(1))])
    except ValueError as error:  # e.g. torch's "Invalid learning rate: -1.0"
        raise ValueError(error if str(error).startswith("--optimizer") else f"--optimizer: {error}") from None
    cls = type(probe)
    accepted = inspect.signature(cls.__init__).parameters
    # NOTE: some optimizers keep arguments outside `defaults` (bitsandbytes' min_8bit_size): the command line's
    # own arguments (jsonargparse's partial) come first, and `defaults` say what the optimizer made of them.
    given = spec.keywords if isinstance(spec, functools.partial) else {}
    init_args = {k: to_yaml(v) for k, v in {**given, **probe.defaults}.items() if k in accepted and k != "params"}
    for kernel in ("fused", "foreach"):  # build_optimizer's choice for this device, not the run's: left to it again
        if kernel in init_args:
            init_args[kernel] = to_yaml(given.get(kernel))
    return {"class_path": f"{cls.__module__}.{cls.__name__}", "init_args": init_args}
