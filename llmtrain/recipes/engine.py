"""The data-parallel engine a run trains with, as the recipes see it: torch's own, or DeepSpeed's.

:func:`engine` is the one place that picks it, and the one place that loads the DeepSpeed extension
(``extensions/deepspeed``, :mod:`llmtrain_deepspeed.recipe`); everything else asks the :class:`Engine` it returns.
An engine answers what a run needs outside the training step: the ZeRO settings of a ``--deepspeed.config`` file,
the engine's config, the model, the wrapper around model and optimizer with the loop's
:class:`~llmtrain.train.loop.Strategy` for the step, and the checkpointer. :class:`Engine` itself is torch's
(DDP, FSDP, tensor and pipeline parallelism), whose strategy is the loop's default.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from llmtrain.args import TrainArgs
from llmtrain.checkpoint.checkpointer import Checkpointer, build_checkpointer
from llmtrain.distributed.parallel_plan import ParallelPlan, ZeroSettings
from llmtrain.distributed.runtime import Runtime
from llmtrain.recipes import build
from llmtrain.train.loop import Fit
from llmtrain.train.strategy import Strategy

if TYPE_CHECKING:
    from llmtrain.recipes.run import RunSpec


class Engine:
    """torch's own engine; an extension's engine subclasses it and answers for its own."""

    def zero_settings(self, flags: dict[str, Any]) -> Optional[ZeroSettings]:
        """The ZeRO settings of the run's ``--deepspeed.config`` file, read before the plan is resolved; None
        without one."""
        return None

    def config(self, plan: ParallelPlan, train: TrainArgs, flags: dict[str, Any],
               resume_from: Optional[Path]) -> Optional[dict]:
        """The engine's own config (plain data, for the ranks' :class:`~llmtrain.recipes.run.RunSpec`), checked
        in the launching process; None for torch's."""
        return None

    def build_model(self, spec: RunSpec, runtime: Runtime, compile: bool) -> torch.nn.Module:
        """This rank's model, built and parallelized (:func:`llmtrain.recipes.build.build_model`)."""
        return build.build_model(spec.config, plan=spec.plan, runtime=runtime, seed=spec.seed, compile=compile,
                                 initial_checkpoint_dir=spec.initial_checkpoint_dir, lora=spec.lora,
                                 quantize=spec.quantize)

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, spec: RunSpec,
             runtime: Runtime) -> tuple[torch.nn.Module, Any, Optional[Callable[[Fit], Strategy]]]:
        """(the model the loop calls, the gradient scaler, the loop's strategy for the step: None for torch's)."""
        return model, scaler, None

    def checkpointer(self, spec: RunSpec, **arguments: Any) -> Checkpointer:
        """The checkpointer of the run's step directories and ``final/``."""
        return build_checkpointer(spec.fsdp.state_dict_type, async_save=spec.fsdp.async_save,
                                  lora=spec.lora is not None, out_dir=spec.out_dir, model_config=spec.config,
                                  hyperparameters=spec.hyperparameters, keep_last=spec.train.keep_last, **arguments)


def engine(deepspeed: bool) -> Engine:
    """DeepSpeed's engine (the extension, loaded only here) where ``deepspeed``, else torch's.

    ``deepspeed``: the plan's wrapper is ``deepspeed`` (a rank: its spec carries a DeepSpeed config), or, before
    the plan exists, a ``--deepspeed.config`` file was given (read then even under another strategy, so that the
    plan can refuse the combination with the file's settings in hand).
    """
    if not deepspeed:
        return Engine()
    from llmtrain_deepspeed.recipe import DeepSpeedEngine  # NOTE: the extension, only for a DeepSpeed run

    return DeepSpeedEngine()
