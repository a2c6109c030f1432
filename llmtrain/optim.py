"""The optimizer from ``--optimizer``: a torch.optim class name, a dotted path, or a class with its arguments."""

from __future__ import annotations

import inspect
from typing import Callable, Iterable, Union

import torch

from llmtrain.errors import close_matches

OptimizerArg = Union[str, Callable[[Iterable], torch.optim.Optimizer]]


def build_optimizer(spec: OptimizerArg, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``"AdamW"`` (a torch.optim class name or dotted path, torch defaults) or a callable from the CLI.

    Adam and AdamW run their fused kernels unless ``--optimizer.foreach`` or ``--optimizer.fused`` says
    otherwise: one kernel over all parameters instead of a loop over them (3x faster steps on CPU, see
    BENCHMARKS.md), with the same arithmetic.
    """
    params = list(params)
    optimizer = spec(params) if callable(spec) else optimizer_class(spec)(params)
    defaults = optimizer.defaults
    if (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and defaults.get("fused") is None
            and defaults.get("foreach") is None and _fused_capable(params)):
        accepted = inspect.signature(type(optimizer).__init__).parameters
        settings = {key: value for key, value in defaults.items() if key in accepted}
        optimizer = type(optimizer)(params, **{**settings, "fused": True, "foreach": None})
    return optimizer


def _fused_capable(params: list[torch.nn.Parameter]) -> bool:
    return bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16,
                                                                               torch.float16) for p in params)


def optimizer_class(name: str) -> type:
    if "." in name:
        module_name, _, class_name = name.rpartition(".")
        module = __import__(module_name, fromlist=[class_name])
        cls = getattr(module, class_name, None)
    else:
        cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        choices = sorted(n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                         and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer")
        close = close_matches(name.rpartition(".")[2], choices)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ValueError(f"--optimizer {name!r} is not a torch.optim optimizer; {hint}choose one of "
                         f"{', '.join(choices)}")
    return cls
