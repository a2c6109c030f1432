"""Numerical precision: what ``--precision`` means for weights, compute and the loss scaler."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal, Optional

import torch

PrecisionName = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"]
PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")


@dataclass(frozen=True)
class Precision:
    """``*-mixed``: fp32 weights and optimizer, low-precision compute. ``*-true``: everything in that dtype."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"--precision {self.name!r} is not one of {', '.join(PRECISIONS)}")

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype weights are stored (and optimized) in."""
        return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(self.name, torch.float32)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matrix products run in."""
        if self.name.startswith("bf16"):
            return torch.bfloat16
        if self.name.startswith("16"):
            return torch.float16
        return torch.float32

    @property
    def is_mixed(self) -> bool:
        return self.name.endswith("-mixed")

    def autocast(self, device: torch.device, enabled: bool = True):
        """Autocast for mixed precision; a no-op otherwise or when the caller handles it (FSDP's policy)."""
        if not (self.is_mixed and enabled):
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def grad_scaler(self, device: torch.device) -> Optional[torch.amp.GradScaler]:
        """fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 does not."""
        if self.name == "16-mixed":
            return torch.amp.GradScaler(device.type)
        return None
