"""Numerical precision: what ``--precision`` means for weights, compute and the loss scaler."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Literal, Optional

import torch

PrecisionName = Literal["auto", "32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"]
PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")


@dataclass(frozen=True)
class Precision:
    """``*-mixed``: fp32 weights and optimizer, low-precision compute. ``*-true``: everything in that dtype."""

    name: str
    chosen_because: str = field(default="", compare=False)
    """Why ``--precision auto`` chose this one (empty when the flag named it)."""

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"--precision {self.name!r} is not one of auto, {', '.join(PRECISIONS)}")

    def unmixed(self) -> "Precision":
        """The same compute dtype for everything: bf16-mixed → bf16-true, 16-mixed → 16-true."""
        return replace(self, name=self.name.replace("-mixed", "-true"))

    def describe(self) -> str:
        """ "bf16-mixed (auto: the GPU computes in bf16)" """
        return f"{self.name} (auto: {self.chosen_because})" if self.chosen_because else self.name

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

    def uses_tf32(self, device_type: str) -> bool:
        """Whether float32 matmuls run on TF32 tensor cores: on CUDA, for 32-true and the mixed precisions.

        32-true computes everything in fp32, and under mixed precision what autocast leaves in fp32 (the
        loss head's softmax, the optimizer's math) still multiplies matrices; TF32 keeps fp32's range with
        a 10-bit mantissa, as bf16 compute does with 7. ``-true`` low-precision runs have no fp32 matmuls
        worth it. Never on a CPU, which has no TF32.
        """
        return device_type == "cuda" and (self.name == "32-true" or self.is_mixed)

    def grad_scaler(self, device: torch.device) -> Optional[torch.amp.GradScaler]:
        """fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 does not."""
        if self.name == "16-mixed":
            return torch.amp.GradScaler(device.type)
        return None


def resolve_precision(name: str, device_type: str, gpu: Optional[str] = None) -> Precision:
    """``auto``: bf16-mixed on a GPU with bf16, 16-mixed on an older GPU, 32-true on a CPU.

    ``gpu`` names a GPU that this machine need not have (the dry run plans for it); otherwise the GPU here is
    asked. A GPU this machine neither has nor knows by name is assumed to compute in bf16, as every data-centre
    GPU since the A100 does.
    """
    if name != "auto":
        return Precision(name)
    if device_type != "cuda":
        return Precision("32-true", chosen_because="CPU: low-precision autocast there is slower than fp32")
    if gpu is not None:
        from llmtrain.flops import gpu_has_bf16

        bf16 = gpu_has_bf16(gpu)
        where = f"the {gpu}"
    elif torch.cuda.is_available():
        # NOTE: without including_emulation=False, torch says yes on a V100 or T4, which can hold bf16 tensors but
        # has no bf16 tensor cores (a dry run for the same GPU reads gpu_has_bf16: no).
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        where = torch.cuda.get_device_name()
    else:
        bf16, where = None, "an unknown GPU"
    if bf16 is False:
        return Precision("16-mixed", chosen_because=f"{where} has no bf16, so fp16 with loss scaling")
    return Precision("bf16-mixed", chosen_because=f"{where} computes in bf16" if bf16 else
                     f"{where}, assumed to compute in bf16")
