"""DeepSpeed's own checkpoints inside llmtrain's step directories.

A step directory is written as every other (temporary directory, then the marker with every file's size, then
the rename; keep_last; the same signal handling), but its tensors are DeepSpeed's: ``mp_rank_00_model_states.pt``
and one ``*zero_pp_rank_N*_optim_states.pt`` per rank, written by ``engine.save_checkpoint`` into the temporary
directory, beside llmtrain's ``training_state.pt`` (counters, data position, RNG; no optimizer) and metadata.
The marker's format is ``deepspeed``.

ZeRO's files hold each rank's partition; a resume on another number of processes goes through DeepSpeed's
universal checkpoint (:meth:`DeepSpeedCheckpointer._load_universal`). ``final/`` is a standard
model directory (LoRA: merged, with the adapters beside them), so ``llmtrain convert to_hf`` and every other
command open it. It is streamed: each tensor is gathered whole from the ranks' fp32 master partitions in turn and
rank 0 writes it into the safetensors file before the next, so rank 0's host holds one tensor of the model at a
time, not the model (DeepSpeed's zero-to-fp32 path read every rank's files and built the whole fp32 model there).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch

from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.checkpointer import Checkpointer
from llmtrain.checkpoint.resume import check_deepspeed_resume
from llmtrain.checkpoint.state import (DamagedCheckpointError, load_training_state, optimizer_settings,
                                      refused_global, restore_training_state)
from llmtrain.distributed.parallelize import unwrap
from llmtrain.lora import LoRALinear, fold_lora

RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
"""Scripts DeepSpeed copies into the folder above each checkpoint; llmtrain writes final/ itself instead."""


class DeepSpeedCheckpointer(Checkpointer):
    """:class:`~llmtrain.checkpoint.checkpointer.Checkpointer` with DeepSpeed's engine writing the tensors.

    ``model`` is the engine; ``lora``: the run trains adapters (final/ merges them); ``base_dir``: the model
    directory LoRA's frozen base was loaded from.
    """

    def __init__(self, *, lora: bool = False, base_dir: Optional[Path] = None, **arguments: Any) -> None:
        super().__init__(**arguments, format="deepspeed")
        self.lora = lora
        self.base_dir = base_dir

    def _write_tensors(self, directory: Path, checksums: Optional[dict[str, str]] = None) -> tuple[Any, dict]:
        """DeepSpeed's own files (each rank's hashed by that rank once written, Checkpointer.wait: ``checksums``
        gets none here)."""
        directory = Path(directory)
        from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                    UNIVERSAL_CHECKPOINT_VERSION_VALUE)

        # The note that lets ds_to_universal convert the files (a resume at another world size, load below).
        universal = {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
        self.model.save_checkpoint(str(directory.parent), tag=directory.name, save_latest=False,
                                   client_state=universal)
        if self.runtime.is_main:
            for script in RECOVERY_SCRIPTS:
                (directory.parent / script).unlink(missing_ok=True)
        return None, {"param_groups": self.optimizer.param_groups}

    def load(self, checkpoint_dir: Path, state: Any, checked: bool = False) -> None:
        checkpoint_dir = Path(checkpoint_dir)
        self.check(checkpoint_dir, checked)
        check_deepspeed_resume(checkpoint_dir, deepspeed=True, zero_stage=self.model.zero_optimization_stage(),
                               bf16=self.model.bfloat16_enabled())
        training_state = load_training_state(checkpoint_dir, mmap=True)
        settings = optimizer_settings(self.optimizer)  # from this run's flags, before the load overwrites them
        if self.model.load_universal_checkpoint():  # written by another number of processes (config.resume_config)
            self._load_universal(checkpoint_dir)
        else:
            with weights_only_loads(checkpoint_dir):  # DeepSpeed's files run no pickle
                self.model.load_checkpoint(str(checkpoint_dir.parent), tag=checkpoint_dir.name,
                                           load_optimizer_states=True, load_lr_scheduler_states=False)
        restore_training_state(training_state, state=state, train_loader=self.train_loader, scaler=None,
                               rank=self.runtime.rank, optimizer=self.optimizer, device=self.runtime.device,
                               settings=settings)
        self.last_saved = checkpoint_dir

    def _load_universal(self, checkpoint_dir: Path) -> None:
        """Load a checkpoint of another world size through DeepSpeed's universal checkpoint.

        Rank 0 converts the ranks' files with ``ds_to_universal`` (one folder per parameter: its fp32 weight and
        optimizer moments, whole) into a hidden folder of out_dir while the others wait on the host, then every
        rank takes its new partition from it, and the folder goes. The checkpoint itself is left as it was.

        NOTE: the conversion runs in this process, one saved rank's file at a time (DeepSpeed's worker pools are
        not started inside a training process); it reads and writes the whole optimizer state once, so a large
        model's resume at a new size takes minutes before the first step. A killed conversion leaves a folder
        that the next save removes as a leftover (layout.LEFTOVER_DIR).
        """
        root = self.out_dir / f".{checkpoint_dir.name}.tmp-universal"  # a leftover's name (layout.LEFTOVER_DIR)
        with weights_only_loads(checkpoint_dir):  # the conversion and the load run no pickle
            if self.runtime.is_main:
                _convert_to_universal(checkpoint_dir, root / checkpoint_dir.name)
            self.runtime.barrier()
            self.model.load_checkpoint(str(root), tag=checkpoint_dir.name, load_optimizer_states=True,
                                       load_lr_scheduler_states=False)
        self.runtime.barrier()
        if self.runtime.is_main:
            shutil.rmtree(root, ignore_errors=True)

    def _final_weights(self) -> Union[dict, Iterator[tuple[str, torch.Tensor]]]:
        """The fp32 weights, one tensor at a time (LoRA: merged layer by layer): rank 0 writes each into final/'s
        safetensors file as it comes (:func:`llmtrain.checkpoint.files.write_model_dir`); {} on the other ranks.

        Each tensor is gathered whole from the ranks' partitions of the optimizer's fp32 master weights (one
        collective per tensor, which every rank joins in the same order), so rank 0 never holds more than the
        tensor it is writing (a LoRA layer: its base weight and the merged one) and no rank reads another's files.
        """
        tensors = self._final_tensors()
        if self.runtime.is_main:
            return tensors
        for _ in tensors:  # the other ranks' part of each tensor's gather, in rank 0's order
            pass
        return {}

    def _final_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, fp32 tensor on the CPU) in the model's order on rank 0; (name, None) on the others."""
        gpt = unwrap(self.model)
        base = self._open_base()
        self._adapters = {}
        seen: set[int] = set()  # a tied weight is stored once, under its first name
        with base if base is not None else contextlib.nullcontext():
            for module_name, module in gpt.named_modules():
                prefix = f"{module_name}." if module_name else ""
                if isinstance(module, LoRALinear):
                    yield from self._merged_layer(prefix, module, base)
                    continue
                if any(isinstance(parent, LoRALinear) for parent in _parents(gpt, module_name)):
                    continue  # the base layer of an adapter: merged above
                for name, param in module.named_parameters(recurse=False):
                    if id(param) not in seen:
                        seen.add(id(param))
                        yield prefix + name, self._whole(param, prefix + name, base)
                for name, buffer in module.named_buffers(recurse=False):
                    if name not in module._non_persistent_buffers_set:
                        yield prefix + name, buffer.detach().float().cpu() if self.runtime.is_main else None

    def _merged_layer(self, prefix: str, module: LoRALinear, base: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """A LoRA layer's merged weight (and bias), its adapters kept on rank 0 for lora.safetensors."""
        weight = self._whole(module.base.weight, f"{prefix}base.weight", base)
        lora_a = self._whole(module.lora_A, f"{prefix}lora_A", base)
        lora_b = self._whole(module.lora_B, f"{prefix}lora_B", base)
        bias = self._whole(module.base.bias, f"{prefix}base.bias", base) if module.base.bias is not None else None
        if not self.runtime.is_main:
            yield f"{prefix}weight", None
            return
        self._adapters.update({f"{prefix}lora_A": lora_a, f"{prefix}lora_B": lora_b})
        yield f"{prefix}weight", fold_lora(weight, lora_a, lora_b, module.scaling).to(weight.dtype)
        if bias is not None:
            yield f"{prefix}bias", bias

    def _whole(self, param: torch.nn.Parameter, name: str, base: Any) -> Optional[torch.Tensor]:
        """``param`` whole in fp32 on rank 0's CPU (None elsewhere); every rank calls it for every parameter.

        A trained parameter's fp32 master copy (DeepSpeed's safe_get_full_fp32_param: a collective over the
        partitions). A frozen one (LoRA's base) has none: from the base model's file where the run has one
        (the engine holds the base in bf16 under bf16-mixed), else the parameter itself, gathered under stage 3.
        """
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        if param.requires_grad:
            full = safe_get_full_fp32_param(param)
            return full.detach().float().cpu() if self.runtime.is_main else None
        stored = _plain_name(name)
        if base is not None and stored in base.keys():  # the same answer on every rank: no collective either way
            return base.get_tensor(stored).float() if self.runtime.is_main else None
        gathered = deepspeed.zero.GatheredParameters([param]) if hasattr(param, "ds_id") \
            else contextlib.nullcontext()
        with gathered:
            return param.detach().float().cpu().clone() if self.runtime.is_main else None

    def _open_base(self) -> Any:
        """The LoRA base model's safetensors file, opened (tensors are read one at a time), or None."""
        if not (self.lora and self.base_dir is not None):
            return None
        from safetensors import safe_open

        return safe_open(str(Path(self.base_dir) / layout.MODEL_FILE), framework="pt", device="cpu")

    def _final_extras(self, directory: Path) -> None:
        if self.lora:  # the adapters stay usable on their own beside the merged model
            files.save_weights(self._adapters, directory / layout.LORA_FILE)
        if self.write_extras is not None:
            self.write_extras(directory)


_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
"""torch's switch that makes every ``torch.load`` call ``weights_only=True``, whatever the call says."""
_FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # torch refuses both switches set at once


def deepspeed_globals() -> list[type]:
    """What DeepSpeed's checkpoint files hold besides tensors, containers and numbers: the loss scaler, the ZeRO
    stage and the fragment mappings of the optimizer state (read from the files of stages 1 to 3, in fp32 and bf16,
    and from their universal conversion)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def weights_only_loads(checkpoint_dir: Path) -> Iterator[None]:
    """Every ``torch.load`` in the block is ``weights_only=True`` and knows :func:`deepspeed_globals` besides torch's
    own; a file that names anything else (a pickle that could run code) raises a DamagedCheckpointError naming
    ``checkpoint_dir`` and the name.

    NOTE: DeepSpeed reads its files with ``torch.load(weights_only=False)``: in its checkpoint engine
    (``TorchCheckpointEngine.load``, through which ``engine.load_checkpoint`` reads), and directly in
    ``ds_to_universal`` and the universal load (``load_hp_checkpoint_state``). A checkpoint engine of our own
    (``engine.checkpoint_engine``, DeepSpeed's extension point for its reads) would cover the first alone; torch's
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, read at each call, covers them all.
    """
    saved = {name: os.environ.pop(name, None) for name in (_FORCE_WEIGHTS_ONLY, _FORCE_NO_WEIGHTS_ONLY)}
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(deepspeed_globals()):
            yield
    except pickle.UnpicklingError as error:
        raise DamagedCheckpointError(
            f"{checkpoint_dir}: a DeepSpeed file in it holds a pickled {refused_global(error) or 'object'} besides "
            "the training state, so llmtrain will not load it: it could run code. Resume from a checkpoint llmtrain "
            "wrote (--resume PATH), or delete this one") from None
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def _plain_name(name: str) -> str:
    """A LoRA model's base weight under a plain model's name (``q_proj.base.weight`` -> ``q_proj.weight``)."""
    return name.replace(".base.", ".")


def _parents(model: torch.nn.Module, name: str) -> list[torch.nn.Module]:
    """The modules above ``name`` (``blocks.0.attn`` -> the model, ``blocks``, ``blocks.0``)."""
    parts = name.split(".") if name else []
    return [model.get_submodule(".".join(parts[:index])) for index in range(len(parts))]


def _convert_to_universal(checkpoint_dir: Path, output: Path) -> None:
    """``deepspeed.checkpoint.ds_to_universal`` of ``checkpoint_dir`` into ``output`` (replaced if there), quietly."""
    from types import SimpleNamespace

    from deepspeed.checkpoint import ds_to_universal

    if output.parent.exists():
        shutil.rmtree(output.parent)
    output.parent.mkdir(parents=True)
    # inject_missing_state: checkpoints written before llmtrain saved the universal note convert as well.
    arguments = SimpleNamespace(input_folder=str(checkpoint_dir), output_folder=str(output), num_extract_workers=1,
                                num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress bars
        ds_to_universal.main(arguments)
