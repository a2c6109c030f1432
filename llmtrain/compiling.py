"""``--compile auto`` (the default): compile the Blocks when the run is long enough to repay the compilation.

Compiling each Block fuses the elementwise passes around RMSNorm, RoPE, SwiGLU and the residual adds. Measured
(BENCHMARKS.md): 1.33-1.35x a step on an H200 at 2,048-token sequences, 1.13x (fp32) and 1.20x (bf16) on a 2-core
Xeon, 1.05-1.08x on a 2-core EPYC. It costs 10-30 s of compilation at start and a second graph for validation,
which a run of a few minutes never repays.

The rule needs no guess at the step time: the run's FLOPs (6 x weights + attention per token, ``llmtrain.flops``)
over the device's peak matmul rate is a floor under its length, whatever the efficiency. ``auto`` compiles when
that floor is at least :data:`AUTO_MIN_SECONDS`. The peak is the GPU's datasheet rate where ``llmtrain.flops``
knows it, else measured on the spot (one 2,048 x 2,048 product, about 0.1 s on a CPU; not at all where the run is
short even at :data:`CPU_CORE_FLOPS_BOUND` per core). A resumed run counts the
steps it has left. Every rank takes the same decision: a rank compiles only if all would.

``auto`` stays off where it has not been measured to pay, or could not work: the fine-tuning recipes (batches of
varying width recompile; ``--compile true`` pads them to multiples of 64), tensor and pipeline parallelism,
DeepSpeed, quantized models, and a machine without the compiler torch needs (a C++ compiler on the CPU, Triton
on a GPU). ``--compile true`` or ``false`` decides outright.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

import torch

CompileSetting = Union[bool, Literal["auto"]]

AUTO_MIN_SECONDS = 600.0
"""``auto`` compiles when the run's FLOPs need at least this long at the device's peak matmul rate: the eager run
then lasts longer still (efficiency is below 1), and a 5-35% faster step repays 10-30 s of compilation several
times over. A shorter floor would compile the README's first command (2.4 minutes at a 2-core CPU's fp32 peak),
which compiling makes no faster on the CPUs measured."""


CPU_CORE_FLOPS_BOUND = 8e12
"""FLOP/s no CPU core exceeds in any dtype (AMX: 2,048 bf16 FLOP a cycle at under 4 GHz). A run whose FLOPs need
less than AUTO_MIN_SECONDS even at this rate is decided without measuring the CPU."""


@dataclass(frozen=True)
class CompileChoice:
    enabled: bool
    reason: str
    """Why, for the start-up log: the rule's numbers, or the flag that decided."""
    local: bool = False
    """Decided from what this rank found (its compiler, its measured rate), which another rank may not share."""


def compiler_missing(device_type: str) -> Optional[str]:
    """What torch.compile's backend lacks on this machine for ``device_type``, or None when it has it."""
    if device_type == "cuda":
        return None if importlib.util.find_spec("triton") else "Triton is not installed"
    if device_type == "cpu":
        candidates = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
        return None if any(name and shutil.which(name) for name in candidates) else "no C++ compiler on PATH"
    return f"torch.compile is not checked on {device_type}"


def measured_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of one 2,048 x 2,048 matmul in ``dtype`` on ``device`` (after one untimed product)."""
    from llmtrain.flops import measure_matmul_peak

    return measure_matmul_peak(dtype, sizes=(2048,), repeats=1, device=device.type)[0]


def choose(setting: CompileSetting, *, recipe: str, config: Any, plan: Any, seq_len: int, total_steps: int,
           max_time: Optional[float], device: torch.device, quantize: Optional[str] = None,
           peak: Optional[Callable[[torch.device, torch.dtype], float]] = None,
           check_compiler: bool = True) -> CompileChoice:
    """Whether to compile each Block: ``setting`` itself, or ``auto``'s decision for this run on this rank.

    ``peak`` gives the device's matmul FLOP/s (default: the datasheet's for a known GPU, else measured).
    ``check_compiler`` False skips looking for this machine's compiler (a dry run plans for other machines).
    """
    if setting is True or setting is False:
        return CompileChoice(setting, f"--compile {str(setting).lower()}")
    off = "--compile auto: not compiled"
    if recipe != "pretrain":
        return CompileChoice(False, f"{off} (fine-tuning batches vary in width; --compile true pads them to "
                                    "multiples of 64 and compiles)")
    if plan.tp > 1 or plan.pp > 1 or plan.wrapper == "deepspeed" or quantize:
        layout = ("tensor parallelism" if plan.tp > 1 else "pipeline parallelism" if plan.pp > 1
                  else "DeepSpeed" if plan.wrapper == "deepspeed" else f"--quantize {quantize}")
        return CompileChoice(False, f"{off} (auto compiles plain data-parallel pretraining only, not {layout}; "
                                    "--compile true compiles this run)")
    missing = compiler_missing(device.type) if check_compiler else None
    if missing:
        return CompileChoice(False, f"{off} ({missing})", local=True)
    from llmtrain.flops import flops_per_token

    dtype = plan.precision.compute_dtype
    tokens = total_steps * plan.batch.global_batch_size * seq_len / plan.data_parallel_size
    flops = tokens * flops_per_token(config, seq_len)

    def floor_at(rate: float) -> float:
        return flops / rate if max_time is None else min(flops / rate, max_time)

    rate, even, what = None, "", ""
    if peak is None and device.type == "cpu":  # a run too short even at any CPU's rate needs no measurement
        cores = os.cpu_count() or 1
        if floor_at(CPU_CORE_FLOPS_BOUND * cores) < AUTO_MIN_SECONDS:
            rate, even, what = CPU_CORE_FLOPS_BOUND * cores, "even ", f", more than any {cores}-core CPU reaches"
    if rate is None:
        rate = (peak or _default_peak)(device, dtype)
    floor = floor_at(rate)
    enabled = floor >= AUTO_MIN_SECONDS
    numbers = (f"{total_steps:,} steps need at least {_minutes(floor)} {even}at {rate / 1e12:.3g} TFLOP/s{what}, "
               f"{'at or over' if enabled else 'under'} the {_minutes(AUTO_MIN_SECONDS)} that repay compiling")
    if enabled:
        return CompileChoice(True, f"--compile auto: compiled blocks ({numbers}; --compile false to skip)", local=True)
    return CompileChoice(False, f"{off} ({numbers}; --compile true to compile anyway)", local=True)


def _default_peak(device: torch.device, dtype: torch.dtype) -> float:
    from llmtrain.flops import device_peak_flops

    return device_peak_flops(device, dtype) or measured_peak_flops(device, dtype)


def agree(choice: CompileChoice, runtime: Any) -> CompileChoice:
    """The choice every rank takes: compiled only if every rank chose to compile (one all-reduce where the choice
    was this rank's own; a flag or the layout decides alike everywhere)."""
    if not runtime.is_distributed or not choice.local:
        return choice
    vote = torch.tensor([1.0 if choice.enabled else 0.0], device=runtime.device)
    runtime.all_reduce(vote, op="min")
    if bool(vote.item()) == choice.enabled:
        return choice
    return CompileChoice(False, "--compile auto: not compiled (another rank found no compiler or measured a run too "
                                "short to repay it)", local=True)


def _minutes(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 2 * 86400 else f"{seconds / 86400:.1f} days"
