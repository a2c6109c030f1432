"""LoRA checkpoints: the adapter settings file, and the one merge of adapters into their layers.

A LoRA step checkpoint holds ``lora.safetensors`` (the adapters) and ``lora.yaml`` (the ``--lora_*``
settings, the base model directory and the quantization they were trained with). Merging folds each
adapter into its layer, layer by layer onto the CPU (:func:`merged_state_dict`), which is what ``final/``
of a LoRA run, ``llmtrain merge_lora`` and ``convert to_hf`` all use; building the base model from its
directory first, for the last two, is :func:`llmtrain.model_dir.merged_lora_weights`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator, Optional

import torch
import yaml

from llmtrain.checkpoint import layout
from llmtrain.distributed.parallelize import unwrap
from llmtrain.yaml_file import read_yaml
from llmtrain.lora import LoRAArgs, LoRAExperts, LoRALinear, fold_lora, lora_modules
from llmtrain.moe import EXPERT_PROJECTIONS
from llmtrain.quantize import QuantizedExperts, compute_dtype_of, dequantize_weight, is_quantized_linear


# -------------------------------------------------------------------------------------- settings
def write_lora_settings(directory: Path, lora: LoRAArgs, base_checkpoint_dir: Path,
                        quantize: Optional[str]) -> None:
    settings = {**dataclasses.asdict(lora), "base_checkpoint_dir": str(Path(base_checkpoint_dir).resolve()),
                "quantize": quantize}
    (Path(directory) / layout.LORA_SETTINGS_FILE).write_text(yaml.safe_dump(settings, sort_keys=False))


def read_lora_settings(checkpoint_dir: Path) -> tuple[LoRAArgs, Path, Optional[str]]:
    """The adapters' settings, their base model directory and its quantization, from the ``lora.yaml`` of a
    checkpoint whose adapters can be merged (it holds them in ``lora.safetensors``)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(_missing_checkpoint(checkpoint_dir))
    for name in (layout.LORA_FILE, layout.LORA_SETTINGS_FILE, layout.CONFIG_FILE):
        if not (checkpoint_dir / name).is_file():
            raise FileNotFoundError(f"{checkpoint_dir} has no {name}: it is not a finetune_lora checkpoint, so there "
                                    "are no adapters to merge")
    return lora_settings(checkpoint_dir / layout.LORA_SETTINGS_FILE)


def _missing_checkpoint(checkpoint_dir: Path) -> str:
    """A checkpoint folder that does not exist, with the checkpoints its parent holds (a run that ended earlier than
    the step asked for)."""
    where = "" if checkpoint_dir.is_absolute() else f" (relative to {Path.cwd()})"
    parent = checkpoint_dir.parent
    if not parent.is_dir():
        return f"{checkpoint_dir} does not exist{where}, nor does {parent}: pass a finetune_lora checkpoint folder"
    held = sorted(child.name for child in parent.iterdir()
                  if child.is_dir() and (layout.STEP_DIR.match(child.name) or child.name == layout.FINAL_DIR))
    listed = f"{parent} holds {', '.join(held)}" if held else f"{parent} holds no step-* or final checkpoint"
    return f"{checkpoint_dir} does not exist{where}; {listed}"


def lora_settings(path: Path) -> tuple[LoRAArgs, Path, Optional[str]]:
    """The settings, base model directory and quantization in the ``lora.yaml`` at ``path``, whatever holds the
    adapters beside it (``lora.safetensors``, or DeepSpeed's files in a step checkpoint of a DeepSpeed run)."""
    settings = read_yaml(path)
    if not isinstance(settings, dict) or "base_checkpoint_dir" not in settings:
        raise ValueError(f"{path} must name the base model (base_checkpoint_dir); it was written by finetune_lora")
    base_dir = Path(settings.pop("base_checkpoint_dir"))
    quantize = settings.pop("quantize", None)
    try:
        lora = LoRAArgs(**settings)
    except TypeError as error:
        raise ValueError(f"{path}: {error}; it holds the --lora_* settings finetune_lora wrote") from error
    return lora, base_dir, quantize


# ----------------------------------------------------------------------------------------- merge
@torch.no_grad()
def merged_state_dict(model: torch.nn.Module,
                      full_state: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """A plain GPT's weights, on the CPU, from a LoRA (or QLoRA) model: each adapter folded into its layer.

    Layer by layer: each merged tensor moves to the CPU as soon as it is computed, so the merged model
    never sits on the training device next to the LoRA one. Quantized layers come out dequantized,
    in their compute dtype. ``full_state``: a sharded model's full state dict (gathered to the CPU on
    rank 0), merged in place of the model's own tensors.
    """
    if full_state is not None:
        return _merged_from_state(unwrap(model), full_state)
    return dict(iter_merged_weights(model))


@torch.no_grad()
def iter_merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`merged_state_dict`'s (name, tensor) pairs, one at a time, in the model's order: a writer that takes
    them as they come (``files.write_model_dir``) never holds more than one merged layer.

    Each merged tensor moves to the CPU before the next layer is merged. A tied weight comes under both its
    names, as the same tensor.
    """
    model = unwrap(model)
    on_cpu: dict[int, torch.Tensor] = {}  # id(tensor) -> its CPU copy: tied weights stay one tensor

    def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in on_cpu:
            on_cpu[id(tensor)] = tensor.detach().cpu()
        return on_cpu[id(tensor)]

    merged_layers: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{layer}.") for layer in merged_layers):
            continue  # the base layer inside an adapter, already merged
        prefix = f"{name}." if name else ""
        if isinstance(module, (LoRAExperts, QuantizedExperts)):
            merged_layers.append(name)
            if isinstance(module, LoRAExperts):
                weights = module.merged_weights()
            else:
                weights = {projection: module.dequantized_weight(projection).to(module.compute_dtype)
                           for projection in EXPERT_PROJECTIONS}
            for projection in EXPERT_PROJECTIONS:
                yield prefix + projection, weights.pop(projection).cpu()
            continue
        if isinstance(module, LoRALinear) or is_quantized_linear(module):
            merged_layers.append(name)
            weight, bias = _merged_linear(module)
            weight = weight.cpu()  # before the next layer is merged: one at a time on the device
            yield f"{prefix}weight", weight
            if bias is not None:
                yield f"{prefix}bias", bias.detach().to(weight.dtype).cpu()
            continue
        for param_name, param in module.named_parameters(recurse=False):
            yield prefix + param_name, to_cpu(param)
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer_name not in module._non_persistent_buffers_set:
                yield prefix + buffer_name, to_cpu(buffer)


def _merged_linear(module: torch.nn.Module) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The plain weight and bias of an adapted or quantized linear layer, on its device (a quantized one dequantized)."""
    if isinstance(module, LoRALinear):
        return module.merged_weight(), module.base.bias
    return dequantize_weight(module).to(compute_dtype_of(module)), module.bias


def _merged_from_state(model: torch.nn.Module, full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(full_state)
    for name, module in lora_modules(model).items():
        if isinstance(module, LoRAExperts):
            for projection in EXPERT_PROJECTIONS:
                weight = out.pop(f"{name}.base.{projection}")
                out[f"{name}.{projection}"] = fold_lora(weight, out.pop(f"{name}.{projection}.lora_A"),
                                                        out.pop(f"{name}.{projection}.lora_B"),
                                                        module.scaling).to(weight.dtype)
            continue
        weight = out.pop(f"{name}.base.weight")
        out[f"{name}.weight"] = fold_lora(weight, out.pop(f"{name}.lora_A"), out.pop(f"{name}.lora_B"),
                                          module.scaling).to(weight.dtype)
        if f"{name}.base.bias" in out:
            out[f"{name}.bias"] = out.pop(f"{name}.base.bias")
    return out
