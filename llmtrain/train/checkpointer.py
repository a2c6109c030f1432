"""Saving and restoring training checkpoints (full format: rank 0 writes one model directory)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from llmtrain import checkpoint as layout
from llmtrain.distributed.runtime import Runtime
from llmtrain.train.loop import TrainState

LORA_FILE = "lora.safetensors"


class FullCheckpointer:
    """Gathers the full model and optimizer state on rank 0 and writes ``step-NNNNNNNN/`` there.

    Every rank must call :meth:`save`, :meth:`save_final` and :meth:`load` together: gathering a
    sharded model is a collective.
    """

    def __init__(self, *, runtime: Runtime, out_dir: Path, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, train_loader: Any, model_config: Any, tokenizer: Any,
                 hyperparameters: dict, scaler: Optional[torch.amp.GradScaler] = None,
                 write_extras: Optional[Callable[[Path], None]] = None, keep_last: Optional[int] = None) -> None:
        self.runtime = runtime
        self.write_extras = write_extras
        self.keep_last = keep_last
        self.out_dir = Path(out_dir)
        self.model = model
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.hyperparameters = hyperparameters
        self.scaler = scaler
        self.last_saved: Optional[Path] = None

    weights_file = layout.MODEL_FILE
    """The weights file of a step checkpoint."""
    trainable_only = False
    """Save only the parameters that train (adapters), not the frozen base."""

    def _gather(self) -> tuple[dict, dict]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.trainable_only)
        model_state = get_model_state_dict(self.model, options=options)
        optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return model_state, optimizer_state

    def save(self, state: TrainState) -> Path:
        target = self.out_dir / layout.step_dir_name(state.step)
        layout.check_finite_weights(self.model, self.runtime, target)
        model_state, optimizer_state = self._gather()
        rng_states = self.runtime.all_gather_object(layout.capture_rng_state())
        if self.runtime.is_main:
            layout.remove_leftovers(self.out_dir)
            training_state = {
                "train_state": state.state_dict(),
                "optimizer": optimizer_state,
                "data": self.train_loader.state_dict(),
                "rng": rng_states,
                "scaler": self.scaler.state_dict() if self.scaler else None,
                "world_size": self.runtime.world_size,
            }
            layout.write_model_dir(target, state_dict=model_state, model_config=self.model_config,
                                   hyperparameters=self.hyperparameters, tokenizer=self.tokenizer,
                                   extra_files={layout.STATE_FILE: training_state},
                                   marker={"kind": "training", "format": "full", "step": state.step,
                                           "tokens": state.tokens},
                                   weights_file=self.weights_file, write_extras=self.write_extras)
        self.runtime.barrier()
        self.last_saved = target
        if self.runtime.is_main:
            layout.prune_checkpoints(self.out_dir, self.keep_last, keep=target)
        return target

    def save_final(self, state: TrainState) -> Path:
        """``final/`` shares the model files of the last step checkpoint (hard links, no second copy)."""
        target = self.out_dir / "final"
        if self.last_saved != self.out_dir / layout.step_dir_name(state.step):
            self.save(state)
        if self.runtime.is_main:
            layout.remove_leftovers(self.out_dir)
            layout.link_model_dir(self.last_saved, target)
        self.runtime.barrier()
        return target

    def load(self, checkpoint_dir: Path, state: TrainState) -> None:
        """Restore model, optimizer, counters, data position and this rank's RNG from ``checkpoint_dir``.

        Under DDP or FSDP only rank 0 reads the weights and optimizer state; it broadcasts them and
        every rank keeps its own shard, so the checkpoint loads at any world size.
        """
        from llmtrain.distributed.checkpoint import restore_training_state

        training_state = layout.load_training_state(checkpoint_dir)
        self._load_weights(Path(checkpoint_dir))
        optimizer_state = training_state["optimizer"]
        options = None
        if self.runtime.is_distributed:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            optimizer_state = optimizer_state if self.runtime.is_main else {}
        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=options)
        restore_training_state(training_state, state, self.train_loader, self.scaler, self.runtime.rank,
                               optimizer=self.optimizer)
        self.last_saved = Path(checkpoint_dir)

    def _load_weights(self, checkpoint_dir: Path) -> None:
        from llmtrain.distributed.checkpoint import load_full_weights

        load_full_weights(self.model, checkpoint_dir, strict=False)


class LoRACheckpointer(FullCheckpointer):
    """Step checkpoints hold only the adapters (``lora.safetensors``) and their optimizer state;
    ``final/`` holds the merged model (``model.safetensors``) beside the adapters."""

    weights_file = LORA_FILE
    trainable_only = True

    def save_final(self, state: TrainState) -> Path:
        from llmtrain.distributed.checkpoint import gather_full_model_state
        from llmtrain.distributed.parallelize import unwrap
        from llmtrain.lora import merge_lora, merged_state_dict

        if self.last_saved != self.out_dir / layout.step_dir_name(state.step):
            self.save(state)
        target = self.out_dir / "final"
        layout.check_finite_weights(self.model, self.runtime, target)
        gpt = unwrap(self.model)
        if self.runtime.is_distributed:
            # Merge on rank 0 from the gathered full weights: no rank ever holds a second model.
            full = gather_full_model_state(self.model)
            merged = merged_state_dict(full, gpt) if self.runtime.is_main else {}
        else:
            # NOTE: in place (training is over); it also dequantizes QLoRA's 4-bit and int8 weights.
            merged = {k: v.detach().cpu() for k, v in merge_lora(gpt).state_dict().items()}
        if self.runtime.is_main:
            layout.remove_leftovers(self.out_dir)
            adapters = self.last_saved / LORA_FILE

            def extras(directory: Path) -> None:
                shutil.copy2(adapters, directory / LORA_FILE)
                if self.write_extras is not None:
                    self.write_extras(directory)

            layout.write_model_dir(target, state_dict=merged, model_config=self.model_config,
                                   hyperparameters=self.hyperparameters, tokenizer=self.tokenizer,
                                   marker={"kind": "final", "format": "full", "step": state.step,
                                           "tokens": state.tokens, "lora_merged": True},
                                   write_extras=extras)
        self.runtime.barrier()
        return target

    def _load_weights(self, checkpoint_dir: Path) -> None:
        from safetensors.torch import load_file

        from llmtrain.distributed.checkpoint import load_full_model_state

        path = checkpoint_dir / LORA_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: {checkpoint_dir} is not a LoRA checkpoint "
                                    "(was it written by finetune_full or pretrain?)")
        adapters = load_file(str(path)) if self.runtime.is_main else {}
        load_full_model_state(self.model, adapters, strict=False)
