"""The model of a ZeRO stage 3 run, built partitioned: no rank ever holds all of it.

Stages 1 and 2 keep every parameter whole on every rank, so they build as a single process does. Stage 3 would
otherwise build the whole model on every rank and only then let the engine split it: a 70B model in fp32 is
280 GB of host memory per process at start. Here the model is constructed under ``deepspeed.zero.Init``, which
partitions each module's parameters as soon as that module exists, so a rank holds its 1/world of the model plus
one module whole for a moment.

The weights are the same as under every other strategy for the same seed: each initialiser of
:func:`llmtrain.model.init_gpt_weights` (and LoRA's) runs on a full-size fp32 tensor, exactly as in one process,
and the rank keeps its partition (:class:`_PartitionedInit`). Weights from a model directory are read by each
rank for its own partitions only (:func:`load_partitioned_weights`).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from llmtrain.checkpoint import layout
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.distributed.parallelize import (_OVERWRITING_METHODS, _draw_dtype, _is_public_initializer,
                                              parallelize, unwrap)
from llmtrain.distributed.runtime import Runtime
from llmtrain.lora import LoRAArgs, apply_lora, is_lora_parameter, lora_modules, mark_only_lora_trainable, \
    reset_lora_parameters
from llmtrain.model import GPT


def build_partitioned_model(config: Config, *, plan: ParallelPlan, runtime: Runtime, seed: int,
                            deepspeed_config: dict, compile: bool = False,
                            initial_checkpoint_dir: Optional[Path] = None,
                            lora: Optional[LoRAArgs] = None) -> nn.Module:
    """The model of a stage 3 run (``plan.zero.stage == 3``), partitioned over the ranks from its first module on.

    What :func:`llmtrain.recipes.build.build_model` gives for the other strategies, but under
    ``deepspeed.zero.Init(config_dict_or_path=deepspeed_config)``: the same weights for the same ``seed``,
    activation checkpointing and compile applied, LoRA's adapters added and only they trainable. The engine
    (:func:`llmtrain_deepspeed.engine.initialize`) takes the partitioned parameters as they are.
    """
    from llmtrain_deepspeed.engine import connect

    deepspeed = connect(runtime)
    # NOTE: the initialisers that modules run in their constructors (nn.Linear's kaiming draw) are skipped: the
    # weights are drawn below, and a 70B model's every constructor draw would cost each rank minutes for nothing.
    with deepspeed.zero.Init(config_dict_or_path=deepspeed_config), _SkipInitializers():
        model = GPT(config)
        if lora is not None:
            apply_lora(model, lora)
    if lora is not None:
        mark_only_lora_trainable(model)
    model = parallelize(model, plan, device=runtime.device, compile=compile)  # checkpointing and compile only
    initialize_partitioned(model, seed, after_init=reset_lora_parameters if lora is not None else None)
    if initial_checkpoint_dir is not None:
        load_partitioned_weights(model, initial_checkpoint_dir)
    return model


def initialize_partitioned(model: nn.Module, seed: int,
                           after_init: Optional[Callable[[nn.Module], None]] = None) -> None:
    """``init_weights()`` under ``seed`` (then ``after_init``) on a model whose parameters ZeRO partitioned, with the
    values :func:`llmtrain.distributed.parallelize.materialize` gives an unpartitioned one."""
    gpt = unwrap(model)
    with torch.random.fork_rng(devices=[]), torch.no_grad(), _PartitionedInit():
        torch.manual_seed(seed)
        gpt.init_weights()
        if after_init is not None:
            after_init(gpt)


def _is_partitioned(tensor) -> bool:
    return isinstance(tensor, nn.Parameter) and hasattr(tensor, "ds_id")


def _overwrites(func) -> bool:
    return func in _OVERWRITING_METHODS or _is_public_initializer(func)


class _SkipInitializers(TorchFunctionMode):
    """Initialisers on parameters that ZeRO has not partitioned yet do nothing (a constructor's own draws)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if _overwrites(func) and isinstance(target, nn.Parameter) and not hasattr(target, "ds_id"):
            return target
        return func(*args, **kwargs)


class _PartitionedInit(TorchFunctionMode):
    """Run each initialiser of a partitioned parameter on a full-size tensor, drawn in fp32, and keep the partition.

    Every rank draws the same full tensor (same seed, same calls, as in one process) and copies out the elements
    its partition holds: no communication. Only one full parameter exists at a time.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if not (_overwrites(func) and _is_partitioned(target)):
            return func(*args, **kwargs)
        full = torch.empty(target.ds_shape, dtype=_draw_dtype(target.dtype), device=target.device)
        if args:
            func(full, *args[1:], **kwargs)
        else:
            func(**{**kwargs, "tensor": full})
        flat = full.view(-1)
        _set_partition(target, lambda start, stop: flat[start:stop])
        return target


def _set_partition(param: nn.Parameter, elements: Callable[[int, int], torch.Tensor]) -> None:
    """Write this rank's partition of a ZeRO-3 parameter; ``elements(start, stop)``: the flattened parameter's
    elements ``[start, stop)`` (every rank asks only for its own).

    NOTE: ZeRO-3 pads a parameter's ``ds_numel`` elements to a multiple of the partition group's size and gives
    rank r the r-th equal run of them in ``param.ds_tensor`` (DeepSpeed's ``_partition_param``; its
    zero_to_fp32 and ds_to_universal read the files by the same rule). A partition swapped out to NVMe is not
    in memory: there DeepSpeed's own ``GatheredParameters`` writes the whole parameter, through every rank.
    """
    import deepspeed

    local = param.ds_tensor
    if getattr(local, "final_location", None) == "nvme":  # OffloadDeviceEnum.nvme is a str
        full = elements(0, param.ds_numel).view(param.ds_shape)
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.data.copy_(full)
        return
    rank = deepspeed.comm.get_rank(group=param.ds_process_group)
    start = min(local.ds_numel * rank, param.ds_numel)
    stop = min(start + local.ds_numel, param.ds_numel)
    with torch.no_grad():
        local.narrow(0, 0, stop - start).copy_(elements(start, stop))
        local.narrow(0, stop - start, local.ds_numel - (stop - start)).zero_()  # the padding


def partitioned_numel(model: nn.Module) -> tuple[int, int]:
    """(elements this rank holds of ``model``'s parameters, elements of the whole model): ZeRO's partitions count
    their own size, anything else its full size. A tied weight counts once."""
    held = whole = 0
    for param in unwrap(model).parameters():
        if _is_partitioned(param):
            held += param.ds_tensor.numel() + param.numel()  # param.numel(): 0 unless gathered
            whole += param.ds_numel
        else:
            held += param.numel()
            whole += param.numel()
    return held, whole


def load_partitioned_weights(model: nn.Module, checkpoint_dir: Path) -> None:
    """A model directory's ``model.safetensors`` into a partitioned model: each rank reads only the bytes of its own
    partitions.

    The same checks as :func:`llmtrain.checkpoint.weights.load_weights` (every non-adapter weight present with its
    shape), on every rank from the file's header. No collective and no rank 0: the file is memory-mapped and a
    rank's partition of a parameter is one contiguous run of its rows, so N ranks read the file once between them
    and none waits for another's disk.
    """
    from safetensors import safe_open

    path = Path(checkpoint_dir) / layout.MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a model directory needs {layout.MODEL_FILE}")
    gpt = unwrap(model)
    in_file = _file_names(gpt)  # the model's name -> the file's (q_proj.base.weight -> q_proj.weight)
    with safe_open(str(path), framework="pt", device="cpu") as weights:
        stored = set(weights.keys())
        wanted = {name: param for name, param in gpt.named_parameters() if not is_lora_parameter(name)}
        missing = [name for name in wanted if in_file.get(name, name) not in stored]
        unexpected = sorted(stored - {in_file.get(name, name) for name in wanted})
        if missing or unexpected:
            raise ValueError(f"{path} does not match the model config: missing keys {missing[:5]}, "
                             f"unexpected keys {unexpected[:5]}")
        for name, param in wanted.items():
            stored_slice = weights.get_slice(in_file.get(name, name))
            shape = tuple(getattr(param, "ds_shape", param.shape))
            if tuple(stored_slice.get_shape()) != shape:
                raise ValueError(f"{path}: {name} has shape {tuple(stored_slice.get_shape())}, the model config "
                                 f"expects {shape}")
            if _is_partitioned(param):
                _set_partition(param, functools.partial(_read_elements, stored_slice, shape))
            else:
                with torch.no_grad():
                    param.copy_(stored_slice[:])


def _read_elements(stored_slice, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of a stored tensor, flattened, reading only the rows that hold them."""
    if len(shape) < 2:
        return stored_slice[start:stop].reshape(-1)
    row = math.prod(shape[1:])
    first, last = start // row, -(-stop // row)
    return stored_slice[first:last].reshape(-1)[start - first * row:stop - first * row]


def _file_names(gpt: nn.Module) -> dict[str, str]:
    """Where a LoRA model's base weights sit in a plain model's file."""
    names = {}
    for module_name in lora_modules(gpt):
        for key in ("weight", "bias"):
            names[f"{module_name}.base.{key}"] = f"{module_name}.{key}"
    return names
