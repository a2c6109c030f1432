"""Saving and restoring training checkpoints (full format: rank 0 writes one model directory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

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


class FullCheckpointer:
    """Gathers the full model and optimizer state on rank 0 and writes ``step-NNNNNNNN/`` there.

    Every rank must call :meth:`save`, :meth:`save_final` and :meth:`load` together: gathering a
    sharded model is a collective.
    """

    def __init__(self, *, runtime: Runtime, out_dir: Path, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, train_loader: Any, model_config: Any, tokenizer: Any,
                 hyperparameters: dict, scaler: Optional[torch.amp.GradScaler] = None) -> None:
        self.runtime = runtime
        self.out_dir = Path(out_dir)
        self.model = model
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.hyperparameters = hyperparameters
        self.scaler = scaler
        self.last_saved: Optional[Path] = None

    def _gather(self) -> tuple[dict, dict]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.model, options=options)
        optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return model_state, optimizer_state

    def save(self, state: TrainState) -> Path:
        model_state, optimizer_state = self._gather()
        rng_states = self.runtime.all_gather_object(layout.capture_rng_state())
        target = self.out_dir / layout.step_dir_name(state.step)
        if self.runtime.is_main:
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
                                   marker={"kind": "training", "step": state.step, "tokens": state.tokens})
        self.runtime.barrier()
        self.last_saved = target
        return target

    def save_final(self, state: TrainState) -> Path:
        """``final/`` shares the model files of the last step checkpoint (hard links, no second copy)."""
        target = self.out_dir / "final"
        if self.last_saved is None or not self.last_saved.name.endswith(f"{state.step:08d}"):
            self.save(state)
        if self.runtime.is_main:
            layout.link_model_dir(self.last_saved, target)
        self.runtime.barrier()
        return target

    def load(self, checkpoint_dir: Path, state: TrainState) -> None:
        """Restore model, optimizer, counters, data position and this rank's RNG from ``checkpoint_dir``.

        Under DDP or FSDP only rank 0 reads the weights and optimizer state; it broadcasts them and
        every rank keeps its own shard, so the checkpoint loads at any world size.
        """
        from llmtrain.distributed.checkpoint import load_full_weights, restore_training_state

        training_state = layout.load_training_state(checkpoint_dir)
        load_full_weights(self.model, checkpoint_dir, strict=False)
        optimizer_state = training_state["optimizer"]
        options = None
        if self.runtime.is_distributed:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            optimizer_state = optimizer_state if self.runtime.is_main else {}
        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=options)
        restore_training_state(training_state, state, self.train_loader, self.scaler, self.runtime.rank,
                               optimizer=self.optimizer)
        self.last_saved = Path(checkpoint_dir)
