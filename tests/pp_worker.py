"""Multi-process harness for tests/test_pipeline_parallel.py: the tiny training job of dist_worker.py, on 4 layers,
cut into pipeline stages.

``launch(world_size, suite, workdir)`` starts ``world_size`` copies of this file (dist_worker's launcher);
each rank runs the scenarios of ``suite`` with the real ``build_model``, ``Pipeline`` and ``fit()``, and rank 0
saves their results to ``workdir/SUITE.pt``. The single-process reference runs the same ``train()`` in the test
process.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch

import dist_worker as worker
from conftest import ListLoader
from llmtrain.args import EvalArgs, FSDPArgs, TrainArgs
from llmtrain.checkpoint.checkpointer import build_checkpointer
from llmtrain.checkpoint.weights import gather_full_model_state
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.distributed.pipeline import build_pipeline
from llmtrain.distributed.runtime import Runtime
from llmtrain.recipes.build import build_model
from llmtrain.train.loop import Fit, TrainState, fit, plan_horizon

VAL_BATCHES = 6
"""Validation batches (of one sequence) over all data-parallel ranks: fewer than a step's micro-batches, so the
pipeline fills up the last group."""


def pp_config() -> Config:
    """dist_worker's tiny model with 4 layers: 2 stages of 2, or 4 interleaved stages of 1."""
    return worker.tiny_config(n_layer=4)


class Recorder(worker.Recorder):
    """Also keeps the validation loss per step."""

    def __init__(self) -> None:
        super().__init__()
        self.val_losses: dict = {}

    def log(self, metrics: dict) -> None:
        super().log(metrics)
        if "val_loss" in metrics:
            self.val_losses[metrics["step"]] = metrics["val_loss"]


def train(runtime: Runtime, *, pp: int = 1, tp: int = 1, schedule: Optional[str] = None, out_dir: Optional[Path] = None,
          checkpoint_format: str = "sharded", resume_from: Optional[Path] = None, precision: str = "32-true") -> dict:
    """8 AdamW steps of the 4-layer model with fit(), validating at steps 0, 4 and 8; checkpoints every 4 steps
    (and final/) into out_dir when given, after resuming ``resume_from`` when given."""
    train_args = TrainArgs(global_batch_size=worker.GLOBAL_BATCH, micro_batch_size=1, max_steps=worker.MAX_STEPS,
                           lr_warmup_steps=2, max_norm=1.0, save_interval=worker.SAVE_INTERVAL if out_dir else None)
    plan = ParallelPlan.resolve(devices=runtime.world_size, num_nodes=1, train=train_args, precision=precision,
                                fsdp=FSDPArgs(state_dict_type=checkpoint_format), accelerator="cpu", pp=pp,
                                pp_schedule=schedule, tp=tp)
    runtime = Runtime.for_plan(plan, timeout_s=worker.COLLECTIVE_TIMEOUT_S) if runtime.is_distributed else runtime
    config = pp_config()
    model = build_model(config, plan=plan, runtime=runtime, seed=worker.SEED)
    model.max_seq_length = worker.SEQ_LEN
    initial = {name: tensor.clone() for name, tensor in gather_full_model_state(model).items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    samples = worker.make_samples()
    loader = ListLoader(samples, 1, runtime.data_parallel_rank, runtime.data_parallel_size)
    val_samples = worker.make_samples(VAL_BATCHES, seed=1)
    val_loader = [{"input_ids": ids[None], "labels": labels[None]}
                  for ids, labels in val_samples[runtime.data_parallel_rank::runtime.data_parallel_size]]
    state = TrainState()
    checkpointer = build_checkpointer(checkpoint_format, out_dir=Path(out_dir or "."), runtime=runtime, model=model,
                                      optimizer=optimizer, train_loader=loader, model_config=config, tokenizer=None,
                                      hyperparameters={"test": True})
    if resume_from is not None:
        checkpointer.load(resume_from, state)
    recorder = Recorder()
    pipeline = build_pipeline(model, plan, runtime) if pp > 1 else None
    job = Fit(runtime=runtime, model=model, optimizer=optimizer, train_loader=loader, val_loader=val_loader,
              train=train_args, eval=EvalArgs(interval=4, max_iters=VAL_BATCHES, final_validation=False),
              plan=plan.batch, horizon=plan_horizon(train_args, worker.GLOBAL_BATCH * worker.SEQ_LEN, None),
              precision=plan.precision, save_checkpoint=checkpointer.save if out_dir else (lambda s: None),
              save_final=checkpointer.save_final if out_dir else (lambda s: None), loggers=[recorder], state=state,
              autocast_enabled=not plan.mixed_precision_policy, grad_sync_only_last=plan.grad_sync_only_last,
              pipeline=pipeline, pp_mesh=pipeline.pp_mesh if pipeline is not None else None)
    fit(job)
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "val_losses": recorder.val_losses,
            "initial_weights": initial, "weights": gather_full_model_state(model), "mesh_shape": plan.describe_mesh(),
            "wrapper": plan.wrapper, "stages": [list(stage.blocks) for stage in getattr(model, "stages", [])],
            "fsdp_units": worker.fsdp_units(model)}


# ------------------------------------------------------------------------------------ suites
def suite_two(runtime: Runtime, workdir: Path) -> dict:
    return {
        "gpipe": train(runtime, pp=2, schedule="gpipe"),
        "1f1b": train(runtime, pp=2, schedule="1f1b", out_dir=workdir / "pp2"),
        "interleaved_1f1b": train(runtime, pp=2, schedule="interleaved_1f1b"),
        "bf16-mixed": train(runtime, pp=2, schedule="1f1b", precision="bf16-mixed"),
    }


def suite_four(runtime: Runtime, workdir: Path) -> dict:
    return {
        "pp2_dp2": train(runtime, pp=2, schedule="1f1b", out_dir=workdir / "pp2_dp2", checkpoint_format="full"),
        # The full checkpoint it wrote, back into the same layout under another schedule (weights and optimizer
        # state scattered to the stages).
        "resumed_full": train(runtime, pp=2, schedule="gpipe", resume_from=workdir / "pp2_dp2" / "step-00000004"),
        # Tensor parallelism (sequence parallel) inside each stage: DTensor activations between the stages.
        "tp2_pp2": train(runtime, pp=2, tp=2, schedule="interleaved_1f1b"),
    }


SUITES = {"two": suite_two, "four": suite_four}


def launch(world_size: int, suite: str, workdir: Path, timeout_s: float = 300.0) -> dict:
    return worker.launch(world_size, suite, workdir, timeout_s=timeout_s, script=Path(__file__))


if __name__ == "__main__":
    worker.worker_main(sys.argv[1], Path(sys.argv[2]), suites=SUITES)
