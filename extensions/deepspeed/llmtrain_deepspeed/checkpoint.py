"""DeepSpeed's own checkpoints inside llmtrain's step directories.

A step directory is written as every other (temporary directory, then the marker with every file's size, then
the rename; keep_last; the same signal handling), but its tensors are DeepSpeed's: ``mp_rank_00_model_states.pt``
and one ``*zero_pp_rank_N*_optim_states.pt`` per rank, written by ``engine.save_checkpoint`` into the temporary
directory, beside llmtrain's ``training_state.pt`` (counters, data position, RNG; no optimizer) and metadata.
The marker's format is ``deepspeed``.

Resume needs the same number of processes: ZeRO's files hold each rank's partition. ``final/`` is a standard
model directory: rank 0 gathers the fp32 weights from the last step's files with DeepSpeed's zero-to-fp32 path
(LoRA: merged, with the adapters beside them), so ``llmtrain convert to_hf`` and every other command open it.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any, Optional

import torch

from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.checkpointer import Checkpointer
from llmtrain.checkpoint.lora import merged_state_dict
from llmtrain.checkpoint.resume import check_deepspeed_resume, verify_checkpoint
from llmtrain.checkpoint.state import load_training_state, optimizer_settings, restore_training_state
from llmtrain.checkpoint.weights import tied_twins
from llmtrain.distributed.parallelize import unwrap
from llmtrain.lora import plain_to_lora_keys

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

    def _write_tensors(self, directory: Path) -> tuple[Any, dict]:
        directory = Path(directory)
        self.model.save_checkpoint(str(directory.parent), tag=directory.name, save_latest=False)
        if self.runtime.is_main:
            for script in RECOVERY_SCRIPTS:
                (directory.parent / script).unlink(missing_ok=True)
        return None, {"param_groups": self.optimizer.param_groups}

    def load(self, checkpoint_dir: Path, state: Any) -> None:
        checkpoint_dir = Path(checkpoint_dir)
        verify_checkpoint(checkpoint_dir, load_state=False)
        check_deepspeed_resume(checkpoint_dir, deepspeed=True, world_size=self.runtime.world_size,
                               zero_stage=self.model.zero_optimization_stage(), bf16=self.model.bfloat16_enabled())
        training_state = load_training_state(checkpoint_dir, mmap=True)
        settings = optimizer_settings(self.optimizer)  # from this run's flags, before the load overwrites them
        self.model.load_checkpoint(str(checkpoint_dir.parent), tag=checkpoint_dir.name, load_optimizer_states=True,
                                   load_lr_scheduler_states=False)
        restore_training_state(training_state, state=state, train_loader=self.train_loader, scaler=None,
                               rank=self.runtime.rank, optimizer=self.optimizer, device=self.runtime.device,
                               settings=settings)
        self.last_saved = checkpoint_dir

    def _final_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 weights of the last step checkpoint, gathered on rank 0 (LoRA: merged); {} on other ranks."""
        if not self.runtime.is_main:
            return {}
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress
            full = get_fp32_state_dict_from_zero_checkpoint(str(self.last_saved.parent), tag=self.last_saved.name)
        full = {name: tensor.contiguous() for name, tensor in full.items()}
        # Stage 1 files leave frozen weights out (LoRA's base); every rank holds them whole, so take them from here.
        for name, tensor in unwrap(self.model).state_dict().items():
            if name not in full and tensor.numel():
                full[name] = tensor.detach().float().cpu()
        self._adapters = {name: tensor for name, tensor in full.items() if "lora_" in name} if self.lora else {}
        if self.lora and self.base_dir is not None:
            full.update(self._frozen_base_weights())
        return merged_state_dict(self.model, full) if self.lora else full

    def _frozen_base_weights(self) -> dict[str, torch.Tensor]:
        """LoRA's frozen weights as the base model's file holds them, in fp32.

        NOTE: under bf16 or fp16 the engine casts the whole module, frozen base included, and only the trained
        parameters have fp32 master copies; the base in the engine (or in a stage 3 file) is rounded.
        """
        from safetensors.torch import load_file

        gpt = unwrap(self.model)
        base = {name: tensor.float() for name, tensor in
                plain_to_lora_keys(load_file(str(Path(self.base_dir) / layout.MODEL_FILE)), gpt).items()}
        for name, twin in tied_twins(gpt).items():  # a tied weight is stored once, and stays one tensor
            if twin in base:
                base[name] = base[twin]
        return {name: base[name] for name, param in gpt.named_parameters(remove_duplicate=False)
                if not param.requires_grad and name in base}

    def _final_extras(self, directory: Path) -> None:
        if self.lora:  # the adapters stay usable on their own beside the merged model
            files.save_weights(self._adapters, directory / layout.LORA_FILE)
        if self.write_extras is not None:
            self.write_extras(directory)
