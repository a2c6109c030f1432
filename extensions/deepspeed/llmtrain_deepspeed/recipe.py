"""DeepSpeed as a recipe's engine: the :class:`llmtrain.recipes.engine.Engine` that
:func:`llmtrain.recipes.engine.engine` returns for a DeepSpeed run, and the only name llmtrain's core imports
from this package.

Importing it loads the config module alone (pure Python); the engine, the partitioned build and the checkpointer
(which import deepspeed) load when a rank asks for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from llmtrain.args import TrainArgs
from llmtrain.checkpoint.checkpointer import Checkpointer
from llmtrain.distributed.parallel_plan import DEEPSPEED_STRATEGIES, ParallelPlan, ZeroSettings
from llmtrain.distributed.runtime import Runtime
from llmtrain.recipes.engine import Engine
from llmtrain.train.loop import Fit
from llmtrain.train.strategy import Strategy
from llmtrain_deepspeed import config as ds_config

if TYPE_CHECKING:
    from llmtrain.recipes.run import RunSpec


class DeepSpeedEngine(Engine):
    """DeepSpeed's ZeRO: its config from the flags and ``--deepspeed.config``, the model partitioned under stage 3,
    its engine around model and optimizer with :class:`llmtrain_deepspeed.engine.DeepSpeedStrategy` for the step,
    and :class:`llmtrain_deepspeed.checkpoint.DeepSpeedCheckpointer`."""

    def zero_settings(self, flags: dict[str, Any]) -> Optional[ZeroSettings]:
        """The ZeRO settings of ``--deepspeed.config``, if one was given (read without importing deepspeed)."""
        path = flags["deepspeed"].config
        if path is None:
            return None
        return ds_config.zero_settings(ds_config.read_config(path), path, DEEPSPEED_STRATEGIES.get(flags["strategy"]))

    def config(self, plan: ParallelPlan, train: TrainArgs, flags: dict[str, Any],
               resume_from: Optional[Path]) -> Optional[dict]:
        """The run's DeepSpeed config: deepspeed must be installed, and the file must agree with the flags. A resume
        on another number of processes than the checkpoint's loads it as DeepSpeed's universal checkpoint."""
        ds_config.require_deepspeed(flags["strategy"])
        path = flags["deepspeed"].config
        config = ds_config.build_config(plan, train, ds_config.read_config(path) if path is not None else None, path)
        return ds_config.resume_config(config, resume_from, plan.world_size) if resume_from is not None else config

    def build_model(self, spec: "RunSpec", runtime: Runtime, compile: bool) -> torch.nn.Module:
        """Under ZeRO stage 3 the model built partitioned, so that no rank holds all of it; stages 1 and 2 keep every
        parameter whole on every rank and build as torch's engine does."""
        plan = spec.plan
        if plan.zero is None or plan.zero.stage != 3 or spec.quantize is not None:
            return super().build_model(spec, runtime, compile)
        from llmtrain_deepspeed.build import build_partitioned_model

        return build_partitioned_model(spec.config, plan=plan, runtime=runtime, seed=spec.seed, compile=compile,
                                       deepspeed_config=spec.deepspeed_config,
                                       initial_checkpoint_dir=spec.initial_checkpoint_dir, lora=spec.lora)

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, spec: "RunSpec",
             runtime: Runtime) -> tuple[torch.nn.Module, Any, Optional[Callable[[Fit], Strategy]]]:
        """The engine is the model the loop calls; it scales fp16 losses itself (no torch scaler)."""
        from llmtrain_deepspeed.engine import DeepSpeedStrategy, initialize

        return initialize(model, optimizer, spec.deepspeed_config, runtime), None, DeepSpeedStrategy

    def checkpointer(self, spec: "RunSpec", **arguments: Any) -> Checkpointer:
        from llmtrain_deepspeed.checkpoint import DeepSpeedCheckpointer

        return DeepSpeedCheckpointer(lora=spec.lora is not None, base_dir=spec.initial_checkpoint_dir,
                                     out_dir=spec.out_dir, model_config=spec.config,
                                     hyperparameters=spec.hyperparameters, keep_last=spec.train.keep_last, **arguments)
