"""Model weights in and out of a plain, LoRA, DDP or FSDP model: gather them whole, load them from a file.

Under FSDP only rank 0 reads or holds the full weights; it broadcasts them and every rank keeps
its shard, so a model directory loads at any world size. A pipeline rank reads only its own stages'
tensors from the file (:func:`load_stage_weights`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmtrain.checkpoint import layout
from llmtrain.distributed.parallelize import unwrap
from llmtrain.distributed.pipeline import PipelineParts
from llmtrain.distributed.runtime import host_barrier
from llmtrain.lora import is_lora_parameter, plain_to_lora_keys


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_main_process() -> bool:
    return not is_distributed() or torch.distributed.get_rank() == 0


def gather_full_model_state(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on CPU on rank 0, an empty dict elsewhere. A collective under FSDP.

    ``trainable_only``: only the parameters that train (LoRA's adapters), not the frozen base.
    """
    # NOTE: torch.distributed.checkpoint takes 2 s to import; `generate --help` should not wait for it.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if isinstance(model, PipelineParts):
        return model.full_state_dict()
    if not is_distributed():
        return {name: tensor.detach().cpu() for name, tensor in get_model_state_dict(
            model, options=StateDictOptions(ignore_frozen_params=trainable_only)).items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)


def load_full_model_state(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load full weights into a plain, DDP or FSDP model. Distributed, only rank 0's ``state_dict`` is read.

    Tied weights stored once (``lm_head.weight`` is ``wte.weight``) are filled in from their twin.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # NOTE: slow, as above

    state_dict = _with_tied_names(model, state_dict)
    if not is_distributed():
        set_model_state_dict(model, state_dict, options=StateDictOptions(strict=strict))
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(model, state_dict if is_main_process() else {}, options=options)


def load_weights(model: torch.nn.Module, checkpoint_dir: Path) -> None:
    """Load a model directory's ``model.safetensors`` into a plain, LoRA, DDP or FSDP model; rank 0 reads it.

    Every weight of the model except LoRA adapters must be in the file, with the right shape; a
    plain model's names (``q_proj.weight``) find the base layers of a LoRA model (``q_proj.base.weight``).
    """
    from safetensors.torch import load_file  # NOTE: lazy: most CLI paths never load weights

    path = Path(checkpoint_dir) / layout.MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a model directory needs {layout.MODEL_FILE}")
    if isinstance(model, PipelineParts):
        load_stage_weights(model, path)
        return
    gpt = unwrap(model)
    weights: dict = {}
    if is_main_process():
        weights = plain_to_lora_keys(load_file(str(path)), gpt)
        check_weights_match(weights, gpt, path)
    host_barrier()  # the others wait for rank 0's read here, not in the broadcast (bound by the collective timeout)
    load_full_model_state(model, weights, strict=False)


def load_stage_weights(parts: PipelineParts, path: Path) -> None:
    """A pipeline rank's stages from the safetensors file ``path``: each rank reads its own stages' tensors by name,
    one at a time, and keeps its shard of each.

    NOTE: not rank 0 reading the file and broadcasting it, as for a whole model: that sends every tensor of the model
    to every rank, which keeps only its stage's. Here nothing crosses the network, and each rank reads 1/pp of the
    file. Every rank checks the file's names and shapes (its header) against the whole model, and so says the same.
    """
    from safetensors import safe_open  # NOTE: lazy, as load_file in load_weights

    with torch.no_grad(), safe_open(str(path), framework="pt", device="cpu") as file:
        shapes = {name: torch.empty(file.get_slice(name).get_shape(), device="meta") for name in file.keys()}
        check_weights_match(shapes, parts, path)
        for name, target in parts.state_dict().items():
            _copy_whole_into(target, file.get_tensor(name))
    host_barrier()  # the next collective must not wait for the slowest rank's reads (bound by the collective timeout)


def _copy_whole_into(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy the whole tensor ``whole`` into ``target``: into its shard if it is a DTensor (each rank cuts out its
    own, ``src_data_rank=None``: no scatter from the mesh's first rank)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        whole = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target = target.to_local()
    target.copy_(whole)


def check_weights_match(weights: dict[str, torch.Tensor], model: torch.nn.Module, path: Path) -> None:
    """Every non-adapter weight of ``model`` is in ``weights`` with its shape, and nothing else is (of the whole
    model, for a pipeline rank's stages)."""
    if isinstance(model, PipelineParts):
        model = model.whole_model()
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items() if not is_lora_parameter(name)}
    tied = tied_names(model)
    missing = [k for k in expected if k not in weights and k not in tied]
    unexpected = [k for k in weights if k not in expected]
    if missing or unexpected:
        raise ValueError(f"{path} does not match the model config: missing keys {missing[:5]}, "
                         f"unexpected keys {unexpected[:5]}")
    for name, tensor in weights.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, the model config expects "
                             f"{expected[name]}")


def tied_names(model: torch.nn.Module) -> set[str]:
    """Names that refer to a parameter already registered under another name."""
    return set(tied_twins(model))


def tied_twins(model: torch.nn.Module) -> dict[str, str]:
    """Each name of a parameter already registered under another name -> that first name (``lm_head.weight`` ->
    ``wte.weight`` for tied embeddings)."""
    first_name: dict[int, str] = {}
    twins = {}
    for name, param in unwrap(model).named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            twins[name] = first_name[id(param)]
        else:
            first_name[id(param)] = name
    return twins


def _with_tied_names(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the second name of each tied parameter (safetensors stores it once)."""
    if not state_dict:
        return state_dict
    out = dict(state_dict)
    for name, twin in tied_twins(model).items():
        if name not in out and twin in out:
            out[name] = out[twin]
    return out
