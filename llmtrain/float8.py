"""Float8 training of the blocks' linear layers (``--float8 tensorwise|rowwise``), through torchao.

A flag of its own rather than a ``--precision`` value: float8 applies to the matrix products of the blocks' linear
layers only, with a scaling recipe of its own, on top of a bf16 precision that still decides the dtype of the
weights, the norms, attention, the head and the optimizer. As ``--precision`` names it would multiply
(bf16-mixed-float8-rowwise, bf16-true-float8-tensorwise, ...) and hide that it needs bf16 underneath.

What torchao converts: every ``nn.Linear`` inside a transformer block whose in and out features are multiples of
16 (float8 GEMMs need them), not the output head, the embedding or an MoE's router (kept in bf16, as torchtitan
does: the head's logits are the loss's input, the router's pick the experts). An MoE's routed experts (3-D weights,
not linear layers) stay in bf16 too. Under FSDP with tensorwise scaling, the weights are all-gathered in float8 (half the
bytes of bf16) and their scales computed once per step for all of them (:func:`precompute_scales`).

Float8 GEMMs need float8 tensor cores: compute capability 8.9 or more (H100, H200, L40S, L4, RTX 4090). Elsewhere
:func:`float8_problem` refuses the flag before anything is built; torchao's emulation (``emulate``) is for tests.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal, Optional

import torch.nn as nn

from llmtrain.flops import _match

Float8Recipe = Literal["tensorwise", "rowwise"]
FLOAT8_RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)
# GPUs by name, for a dry run that plans for one it does not have: True with float8 tensor cores (Ada, Hopper,
# Blackwell), False without. Order matters as in flops.PEAK_FLOPS (the first whole-word match wins).
FLOAT8_BY_GPU = {"B200": True, "GH200": True, "H200": True, "H100": True, "H800": True, "H20": True, "L40S": True,
                 "L4": True, "RTX 4090": True, "A100": False, "A800": False, "A10": False, "RTX 3090": False,
                 "V100": False}
INSTALL = "pip install 'llmtrain[float8]' (torchao)"


def float8_problem(recipe: str, *, device_type: str, precision: str,
                   capability: Optional[tuple[int, int]] = None, gpu: Optional[str] = None) -> Optional[str]:
    """Why ``--float8 recipe`` cannot run on this device and precision, as one line naming the fix; None if it can.

    ``capability``: the CUDA device's (major, minor) when known (None: a dry run planning for a GPU by name)."""
    if recipe not in FLOAT8_RECIPES:
        return f"--float8 {recipe!r} is not one of {', '.join(FLOAT8_RECIPES)}"
    if device_type != "cuda":
        return (f"--float8 {recipe} needs a GPU with float8 tensor cores (compute capability 8.9+: H100, H200, L40S, "
                f"L4, RTX 4090); this run is on the {device_type}. Drop --float8")
    lacking = (capability is not None and tuple(capability) < MIN_CAPABILITY) or (
        capability is None and gpu is not None and _match(gpu, FLOAT8_BY_GPU)[1] is False)
    if lacking:
        which = f"the {gpu}" if gpu else "this GPU"
        has = f" (compute capability {capability[0]}.{capability[1]})" if capability is not None else ""
        return (f"--float8 {recipe} needs float8 tensor cores (compute capability 8.9+: H100, H200, L40S, L4, "
                f"RTX 4090); {which}{has} has none. Drop --float8, or run on such a GPU")
    if not precision.startswith("bf16"):
        return (f"--float8 {recipe} runs on top of bf16: pass --precision bf16-mixed or bf16-true (got "
                f"--precision {precision})")
    return None


def float8_linear_filter(module: nn.Module, name: str) -> bool:
    """Whether ``module`` (called ``name`` in the model) is converted: a linear layer inside a block with both
    dimensions multiples of 16."""
    if not isinstance(module, nn.Linear) or not name.startswith("blocks."):
        return False
    if name.rsplit(".", 1)[-1] == "router":  # an MoE's expert choice stays in bf16, as torchtitan keeps it
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_float8(model: nn.Module, recipe: str, *, fsdp_float8_all_gather: bool = False,
                      emulate: bool = False) -> int:
    """Swap the block linears of ``model`` (a GPT or a pipeline stage, on any device, meta included) for torchao's
    ``Float8Linear`` with ``recipe``'s scaling, in place; returns how many were converted.

    ``fsdp_float8_all_gather`` (tensorwise only): FSDP gathers the weights in float8; then call
    :func:`precompute_scales` after each optimizer step. ``emulate``: run the float8 products in higher precision
    (tests on a CPU)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as error:
        raise ImportError(f"--float8 needs torchao: {INSTALL}") from error
    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulate)
    else:
        if fsdp_float8_all_gather:
            raise ValueError("float8 all-gather under FSDP is torchao's for tensorwise scaling only")
        config = replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    names = [name for name, module in model.named_modules() if float8_linear_filter(module, name)]
    convert_to_float8_training(model, config=config, module_filter_fn=float8_linear_filter)
    return len(names)


def precompute_scales(model: nn.Module) -> None:
    """After the optimizer step of an FSDP model with float8 all-gather: compute every float8 weight's scale in
    one all-reduce, instead of one per weight at its next all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
