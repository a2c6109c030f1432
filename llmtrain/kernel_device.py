"""Which device's kernels the model picks: the tensors' own, or the device a simulated rank stands in for.

The model chooses some kernels by device type (block attention and fused projections on the CPU, SDPA's layouts on
CUDA), and with them what autograd keeps for the backward. ``--dry_run.simulate`` (:mod:`llmtrain.recipes.simulate`)
runs a GPU plan's ranks on this CPU under fake tensors; inside :func:`simulated_device_type` the model makes the
choices of the plan's device, so the memory it measures is that of the run it stands for.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

_SIMULATED: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("llmtrain_simulated_device_type",
                                                                           default=None)


def kernel_device_type(device_type: str) -> str:
    """The device type whose kernels to pick for tensors on ``device_type``."""
    return _SIMULATED.get() or device_type


@contextlib.contextmanager
def simulated_device_type(device_type: str) -> Iterator[None]:
    """Pick ``device_type``'s kernels, whatever device the tensors are on (a simulation's fake tensors)."""
    token = _SIMULATED.set(device_type)
    try:
        yield
    finally:
        _SIMULATED.reset(token)
