"""Multi-process harness for tests/test_deepspeed.py: FSDP and every DeepSpeed ZeRO variant in one process group.

``dist_worker.launch(2, "parity", workdir, script=ds_worker.py)`` starts two ranks over gloo; each trains the tiny
model of dist_worker for 8 AdamW steps with the real ``fit()``, first under FSDP (dist_worker.train), then under
each ``--strategy deepspeed_*`` through DeepSpeed's engine and llmtrain_deepspeed's strategy, as the recipe
builds them. Rank 0 saves every run's losses and final weights to ``workdir/parity.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed

import torch

import dist_worker
from dist_worker import GLOBAL_BATCH, MAX_STEPS, SEQ_LEN, ListLoader, Recorder, build, make_samples, tiny_config
from llmtrain.args import EvalArgs, FSDPArgs, TrainArgs
from llmtrain.distributed.parallel_plan import DEEPSPEED_STRATEGIES
from llmtrain.distributed.parallelize import unwrap
from llmtrain.distributed.runtime import Runtime
from llmtrain.train.loop import Fit, TrainState, fit, plan_horizon
from llmtrain.train.precision import Precision


def train_deepspeed(runtime: Runtime, strategy: str) -> dict:
    """dist_worker.train's run (same model, seed, data, optimizer and schedule) through DeepSpeed's engine."""
    import deepspeed

    from llmtrain_deepspeed.config import build_config
    from llmtrain_deepspeed.engine import DeepSpeedStrategy, initialize

    model, info = build(runtime, strategy=strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    train_args = TrainArgs(global_batch_size=GLOBAL_BATCH, micro_batch_size=1, max_steps=MAX_STEPS,
                           lr_warmup_steps=2, max_norm=1.0)
    # Stage 3 keeps parameters under 1e5 elements whole (all of this model's): a threshold of 0 partitions them all.
    user = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if info.zero.stage == 3 else None
    engine = initialize(model, optimizer, build_config(info, train_args, user), runtime)
    loader = ListLoader(dist_worker.make_samples(), info.batch.micro_batch_size, runtime.data_parallel_rank,
                        runtime.data_parallel_size)
    recorder = Recorder()
    seen: dict = {}

    def observe(state: TrainState) -> None:  # after the last step: what the engine really partitions
        zero = engine.optimizer
        flat = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat
        seen.update(stage=engine.zero_optimization_stage(), offload_optimizer=engine.zero_cpu_offload(),
                    optimizer_numel=sum(group.numel() for group in flat),
                    parameters_numel=sum(p.numel() for p in unwrap(engine).parameters()))

    fit(Fit(runtime=runtime, model=engine, optimizer=optimizer, train_loader=loader, val_loader=None,
            train=train_args, eval=EvalArgs(initial_validation=False, final_validation=False), plan=info.batch,
            horizon=plan_horizon(train_args, GLOBAL_BATCH * SEQ_LEN, None), precision=Precision("32-true"),
            save_checkpoint=lambda state: None, save_final=observe, loggers=[recorder], state=TrainState(),
            autocast_enabled=True, strategy=DeepSpeedStrategy))
    parameters = list(unwrap(engine).parameters())
    with deepspeed.zero.GatheredParameters(parameters):  # stage 3: whole on every rank inside the block
        weights = {name: tensor.detach().clone().cpu() for name, tensor in unwrap(engine).state_dict().items()}
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "weights": weights, **seen}


def samples_of_two_widths() -> list:
    """make_samples' sequences, every other one 4 tokens shorter: in each micro-step (micro batch 1) rank 0 trains
    on 16 tokens and rank 1 on 12, as fine-tuning's batches differ in width between ranks."""
    return [(inputs[:12], labels[:12]) if index % 2 else (inputs, labels)
            for index, (inputs, labels) in enumerate(make_samples())]


def suite_parity(runtime: Runtime, workdir: Path) -> dict:
    from llmtrain import model as model_module

    # Where widths differ between ranks, so may the attention path: here (as on a CPU measured for it) the fused
    # q/k/v path takes rank 0's 16 tokens (2 query heads a group: 32 rows) and not rank 1's 12.
    model_module.CPU_MEASURED_FOR_BLOCK_ATTENTION = True
    model_module.CPU_BLOCK_ATTENTION_MIN_ROWS = 32
    dist_worker.make_samples = samples_of_two_widths
    results = {"fsdp": dist_worker.train(runtime, fsdp=FSDPArgs(sharding_strategy="FULL_SHARD"))}
    for strategy in DEEPSPEED_STRATEGIES:
        results[strategy] = train_deepspeed(runtime, strategy)
    return results


SUITES = {"parity": suite_parity}



# ------------------------------------------------------------------------------------ command lines
class _Hiding:
    """``importlib.machinery.PathFinder`` that cannot see one top-level package: to Python it is not installed
    (``importlib.util.find_spec`` answers None, ``import`` raises ModuleNotFoundError)."""

    def __init__(self, finder, package: str) -> None:
        self.finder, self.package = finder, package

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] == self.package:
            return None
        return self.finder.find_spec(fullname, path, target)

    def invalidate_caches(self) -> None:
        self.finder.invalidate_caches()


def hide_package(package: str) -> None:
    import importlib.machinery

    assert package not in sys.modules, f"{package} was imported already; it cannot be hidden any more"
    sys.meta_path[:] = [_Hiding(finder, package) if finder is importlib.machinery.PathFinder else finder
                        for finder in sys.meta_path]


def run_command_lines(cases: list[dict]) -> list[dict]:
    """Each case's ``argv`` through llmtrain's console script (``main()`` reading sys.argv, as ``llmtrain ARGV``),
    in this one process: its exit code, stdout, stderr, and whether it got as far as starting workers (it is
    stopped there, exit code 99). ``hide_deepspeed`` cases (put them last) run without the deepspeed package."""
    import contextlib
    import io
    import traceback

    import llmtrain.recipes.run as recipe_run
    from llmtrain import cli

    launched: list[bool] = []

    def no_workers(*args, **kwargs) -> None:
        launched.append(True)
        sys.exit(99)

    recipe_run.launch = no_workers
    results = []
    for case in cases:
        if case.get("hide_deepspeed"):
            hide_package("deepspeed")
        launched.clear()
        sys.argv = ["llmtrain", *case["argv"]]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main()
                code = 0
            except SystemExit as stop:
                code = stop.code
            except BaseException:  # what the interpreter would print as a traceback, exit 1
                traceback.print_exc()
                code = 1
        results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "launched": bool(launched)})
    return results


if __name__ == "__main__":
    if sys.argv[1] == "command-lines":  # ds_worker.py command-lines CASES.json RESULTS.json
        import json

        cases, results = Path(sys.argv[2]), Path(sys.argv[3])  # before the cases change sys.argv
        results.write_text(json.dumps(run_command_lines(json.loads(cases.read_text()))))
    else:
        dist_worker.worker_main(sys.argv[1], Path(sys.argv[2]), suites=SUITES)
