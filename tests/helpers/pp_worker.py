"""Multi-process harness for tests/distributed/test_pipeline_parallel.py: the tiny training job of dist_worker.py, on 4 layers,
cut into pipeline stages.

``launch(world_size, suites, workdir)`` starts ``world_size`` copies of this file (dist_worker's launcher);
each rank runs the scenarios of each suite ("four+two": "two" on the first 2 ranks, in a process group of their own:
WORLD_SIZES) with the real ``build_model``, ``Pipeline`` and ``fit()``, and rank 0 saves their results to
``workdir/SUITE.pt``. The single-process reference runs the same ``train()`` in the test
process.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

import dist_worker as worker
from conftest import ListLoader
from llmtrain.args import EvalArgs, FSDPArgs, TrainArgs
from llmtrain.checkpoint import layout
from llmtrain.checkpoint.checkpointer import build_checkpointer
from llmtrain.checkpoint.files import save_weights
from llmtrain.checkpoint.weights import gather_full_model_state, load_weights
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.distributed.parallelize import materialize
from llmtrain.distributed.pipeline import PipelineParts, build_pipeline
from llmtrain.distributed.runtime import Runtime, host_barrier
from llmtrain.model import GPT
from llmtrain.recipes.build import build_model
from llmtrain.train.horizon import plan_horizon
from llmtrain.train.loop import Fit, TrainState, fit

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


class ReceivedBytes:
    """The bytes each collective brings to this rank, recorded per label (:meth:`recording`) while one is entered.

    torch.distributed's functions are wrapped, not replaced: the groups and the transfers stay real. The object
    collectives (gather_object, recv_object_list, ...) run on these functions, and a DTensor's gather (``full_tensor``)
    on the functional collectives, so each shows up as what it moves. A call made inside a recorded one (an object
    collective's own gathers) is counted in the outer one. A collective this rank only sends (a broadcast from it) is
    counted as received: the record is an upper bound.
    """

    C10D = {  # the tensors each function fills on this rank, from its bound arguments
        "recv": lambda a: [a["tensor"]], "irecv": lambda a: [a["tensor"]], "broadcast": lambda a: [a["tensor"]],
        "all_reduce": lambda a: [a["tensor"]], "reduce": lambda a: [a["tensor"]], "scatter": lambda a: [a["tensor"]],
        "all_gather": lambda a: a["tensor_list"], "gather": lambda a: a.get("gather_list") or [],
        "all_gather_into_tensor": lambda a: [a["output_tensor"]], "reduce_scatter_tensor": lambda a: [a["input"]],
        "all_to_all_single": lambda a: [a["output"]],
        "batch_isend_irecv": lambda a: [op.tensor for op in a["p2p_op_list"] if "recv" in op.op.__name__],
    }
    FUNCTIONAL = ("all_gather_single", "all_gather_tensor", "all_reduce", "reduce_scatter_single",
                  "reduce_scatter_tensor", "broadcast")

    def __init__(self) -> None:
        self.records: dict[str, list[tuple[str, int, str]]] = {}
        self._label: Optional[str] = None
        self._inside = threading.local()

    @contextlib.contextmanager
    def recording(self, label: str):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        patched = []
        for name, filled in self.C10D.items():
            for module in (dist, c10d):
                patched.append((module, name, getattr(module, name)))
                setattr(module, name, self._wrap(name, getattr(module, name), filled))
        for name in self.FUNCTIONAL:
            patched.append((funcol, name, getattr(funcol, name)))
            setattr(funcol, name, self._wrap(f"functional.{name}", getattr(funcol, name), None))
        self._label = label
        self.records.setdefault(label, [])
        try:
            yield self
        finally:
            self._label = None
            for module, name, original in reversed(patched):
                setattr(module, name, original)

    def _wrap(self, name: str, original: Callable, filled: Optional[Callable]) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            if getattr(self._inside, "depth", 0) or self._label is None:
                return original(*args, **kwargs)
            self._inside.depth = 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._inside.depth = 0
            tensors = [result] if filled is None else filled(signature.bind(*args, **kwargs).arguments)
            tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
            if tensors:
                self.records[self._label].append((name, sum(t.numel() * t.element_size() for t in tensors),
                                                  str(tensors[0].dtype)))
            return result

        return recorded


class SafetensorsReads:
    """The tensors read from safetensors files while entered, by name (``load_file`` reads them all: ``*``)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    @contextlib.contextmanager
    def recording(self):
        import safetensors
        import safetensors.torch

        original_open, original_load = safetensors.safe_open, safetensors.torch.load_file
        reads = self.names

        class RecordedOpen:
            def __init__(self, *args, **kwargs) -> None:
                self.file = original_open(*args, **kwargs)

            def __enter__(self) -> "RecordedOpen":
                self.file.__enter__()
                return self

            def __exit__(self, *exc) -> None:
                return self.file.__exit__(*exc)

            def get_tensor(self, name: str) -> torch.Tensor:
                reads.append(name)
                return self.file.get_tensor(name)

            def __getattr__(self, name: str):
                return getattr(self.file, name)

        def load_file(*args, **kwargs):
            reads.append("*")
            return original_load(*args, **kwargs)

        safetensors.safe_open, safetensors.torch.load_file = RecordedOpen, load_file
        try:
            yield self
        finally:
            safetensors.safe_open, safetensors.torch.load_file = original_open, original_load


SAVED_SHARDS: dict[str, dict] = {}
"""This process's own shards of weights and optimizer state at each pipeline checkpoint it saved, by the checkpoint's
path: what a resume from that checkpoint in the same processes must restore bit for bit."""


def local_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Copies of this rank's own weights and optimizer state (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    def local(value):
        if not isinstance(value, torch.Tensor):
            return value
        return (value.to_local() if isinstance(value, DTensor) else value).detach().clone()

    return {"model": {name: local(parameter) for name, parameter in model.named_parameters()},
            "optimizer": {index: {key: local(value) for key, value in entries.items()}
                          for index, entries in optimizer.state_dict()["state"].items()}}


def shard_differences(saved: dict, restored: dict) -> list[str]:
    """What differs, bit for bit, between two :func:`local_shards`."""
    differences = []
    for part in ("model", "optimizer"):
        if saved[part].keys() != restored[part].keys():
            differences.append(f"{part}: keys {sorted(saved[part])} != {sorted(restored[part])}")
            continue
        for key, value in saved[part].items():
            other = restored[part][key]
            values = value.items() if isinstance(value, dict) else [("", value)]
            for entry, tensor in values:
                again = other[entry] if entry else other
                if not (torch.equal(tensor, again) and tensor.dtype == again.dtype):
                    differences.append(f"{part} {key} {entry}".strip())
    return differences


def fsdp_units_resharding_after_forward(model: torch.nn.Module) -> list[str]:
    """The FSDP units (by their first module's name) that free their gathered weights after each forward."""
    from torch.distributed.fsdp import FSDPModule

    return sorted(name for name, module in model.named_modules() if isinstance(module, FSDPModule)
                  and module._get_fsdp_state()._fsdp_param_group is not None
                  and module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None)


def train(runtime: Runtime, *, pp: int = 1, tp: int = 1, schedule: Optional[str] = None, out_dir: Optional[Path] = None,
          checkpoint_format: str = "sharded", resume_from: Optional[Path] = None, precision: str = "32-true",
          optimizer_class: type = torch.optim.AdamW, config: Optional[Config] = None, ep: int = 1) -> dict:
    """8 AdamW steps of the 4-layer model (or ``config``) with fit(), validating at steps 0, 4 and 8; checkpoints every
    4 steps (and final/) into out_dir when given, after resuming ``resume_from`` when given. ``ep``: --ep_size.

    Under a pipeline, what rank 0 receives in each checkpoint call is recorded (``received``), and a resume from a
    checkpoint these processes saved compares every rank's restored shards with those it saved (``restored``)."""
    train_args = TrainArgs(global_batch_size=worker.GLOBAL_BATCH, micro_batch_size=1, max_steps=worker.MAX_STEPS,
                           lr_warmup_steps=2, max_norm=1.0, save_interval=worker.SAVE_INTERVAL if out_dir else None)
    plan = ParallelPlan.resolve(devices=runtime.world_size, num_nodes=1, train=train_args, precision=precision,
                                fsdp=FSDPArgs(state_dict_type=checkpoint_format), accelerator="cpu", pp=pp,
                                pp_schedule=schedule, tp=tp, ep=ep)
    runtime = Runtime.for_plan(plan, timeout_s=worker.COLLECTIVE_TIMEOUT_S) if runtime.is_distributed else runtime
    config = config or pp_config()
    model = build_model(config, plan=plan, runtime=runtime, seed=worker.SEED)
    model.max_seq_length = worker.SEQ_LEN
    initial = {name: tensor.clone() for name, tensor in gather_full_model_state(model).items()}
    optimizer = optimizer_class(model.parameters(), lr=5e-3, weight_decay=0.1)
    samples = worker.make_samples()
    loader = ListLoader(samples, 1, runtime.data_parallel_rank, runtime.data_parallel_size)
    val_samples = worker.make_samples(VAL_BATCHES, seed=1)
    val_loader = [{"input_ids": ids[None], "labels": labels[None]}
                  for ids, labels in val_samples[runtime.data_parallel_rank::runtime.data_parallel_size]]
    state = TrainState()
    checkpointer = build_checkpointer(checkpoint_format, out_dir=Path(out_dir or "."), runtime=runtime, model=model,
                                      optimizer=optimizer, train_loader=loader, model_config=config, tokenizer=None,
                                      hyperparameters={"test": True})
    received = ReceivedBytes()
    restored = None
    if resume_from is not None:
        with received.recording("load"):
            checkpointer.load(resume_from, state)
        saved = SAVED_SHARDS.get(str(Path(resume_from).resolve()))
        if saved is not None:  # the same on every rank: each saved its shards at that checkpoint
            restored = worker_gather(runtime, shard_differences(saved, local_shards(model, optimizer)))

    def save_checkpoint(state: TrainState) -> Path:
        with received.recording("save"):
            target = checkpointer.save(state)
        if isinstance(model, PipelineParts):
            SAVED_SHARDS[str(Path(target).resolve())] = local_shards(model, optimizer)
        return target

    def save_final(state: TrainState) -> Path:
        with received.recording("save_final"):
            return checkpointer.save_final(state)

    recorder = Recorder()
    pipeline = build_pipeline(model, plan, runtime) if pp > 1 else None
    job = Fit(runtime=runtime, model=model, optimizer=optimizer, train_loader=loader, val_loader=val_loader,
              config=config, train=train_args, eval=EvalArgs(interval=4, max_iters=VAL_BATCHES, final_validation=False),
              plan=plan.batch, horizon=plan_horizon(train_args, worker.GLOBAL_BATCH * worker.SEQ_LEN, None),
              precision=plan.precision, save_checkpoint=save_checkpoint if out_dir else (lambda s: None),
              save_final=save_final if out_dir else (lambda s: None), loggers=[recorder], state=state,
              autocast_enabled=not plan.mixed_precision_policy, grad_sync_only_last=plan.grad_sync_only_last,
              pipeline=pipeline, pp_mesh=pipeline.pp_mesh if pipeline is not None else None)
    fit(job)
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "val_losses": recorder.val_losses,
            "initial_weights": initial, "weights": gather_full_model_state(model), "mesh_shape": plan.describe_mesh(),
            "wrapper": plan.wrapper, "stages": [list(stage.blocks) for stage in getattr(model, "stages", [])],
            "fsdp_units": worker.fsdp_units(model), "resharding_units": fsdp_units_resharding_after_forward(model),
            "received": received.records, "restored": restored}


def worker_gather(runtime: Runtime, value) -> list:
    """Every rank's ``value``, in rank order (a test's own small objects; one process: a list of its one)."""
    if not runtime.is_distributed:
        return [value]
    gathered: list = [None] * runtime.world_size
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def load_initial_weights(runtime: Runtime, workdir: Path) -> dict:
    """pp2 × dp2 loads a model directory (--initial_checkpoint_dir's load_weights): which tensors each rank reads
    from the file, what rank 0 receives meanwhile, and the weights each stage ends up with."""
    config = pp_config()
    model_dir = workdir / "initial"
    if runtime.is_main:  # another seed than the stages' own initialisation: a load that did nothing would show
        whole = GPT(config)
        materialize(whole, torch.device("cpu"), seed=worker.SEED + 1)
        model_dir.mkdir()
        save_weights(whole.state_dict(), model_dir / layout.MODEL_FILE)
    host_barrier()
    train_args = TrainArgs(global_batch_size=worker.GLOBAL_BATCH, micro_batch_size=1, max_steps=worker.MAX_STEPS)
    plan = ParallelPlan.resolve(devices=runtime.world_size, num_nodes=1, train=train_args, precision="32-true",
                                accelerator="cpu", pp=2, pp_schedule="1f1b")
    runtime = Runtime.for_plan(plan, timeout_s=worker.COLLECTIVE_TIMEOUT_S)
    model = build_model(config, plan=plan, runtime=runtime, seed=worker.SEED)
    reads, received = SafetensorsReads(), ReceivedBytes()
    with reads.recording(), received.recording("load"):
        load_weights(model, model_dir)
    return {"reads": worker_gather(runtime, reads.names), "received": received.records["load"],
            "stage_names": worker_gather(runtime, sorted(model.state_dict())), "weights": gather_full_model_state(model),
            "model_dir": model_dir}


# ------------------------------------------------------------------------------------ suites
def suite_two(runtime: Runtime, workdir: Path) -> dict:
    # Adafactor's state is not shaped like the parameters (a row and a column of each matrix): rank 0 cannot predict
    # it, and the stages send the skeleton of their state first.
    adafactor = dict(optimizer_class=torch.optim.Adafactor, checkpoint_format="full")
    return {
        "gpipe": train(runtime, pp=2, schedule="gpipe"),
        "1f1b": train(runtime, pp=2, schedule="1f1b", out_dir=workdir / "pp2"),
        "interleaved_1f1b": train(runtime, pp=2, schedule="interleaved_1f1b"),
        "bf16-mixed": train(runtime, pp=2, schedule="1f1b", precision="bf16-mixed"),
        "adafactor": train(runtime, pp=2, schedule="1f1b", out_dir=workdir / "adafactor", **adafactor),
        "adafactor_resumed": train(runtime, pp=2, schedule="1f1b", resume_from=workdir / "adafactor" / "step-00000004",
                                   **adafactor),
    }


def suite_four(runtime: Runtime, workdir: Path) -> dict:
    return {
        "pp2_dp2": train(runtime, pp=2, schedule="1f1b", out_dir=workdir / "pp2_dp2", checkpoint_format="full"),
        # The full checkpoint it wrote, back into the same layout under another schedule (weights and optimizer
        # state scattered to the stages).
        "resumed_full": train(runtime, pp=2, schedule="gpipe", resume_from=workdir / "pp2_dp2" / "step-00000004"),
        # Tensor parallelism (sequence parallel) inside each stage: DTensor activations between the stages; its full
        # checkpoints gather each stage's tensors over its tp ranks.
        "tp2_pp2": train(runtime, pp=2, tp=2, schedule="interleaved_1f1b", out_dir=workdir / "tp2_pp2",
                         checkpoint_format="full"),
        "initial_weights": load_initial_weights(runtime, workdir),
    }


SUITES = {"two": suite_two, "four": suite_four}
WORLD_SIZES = {"two": 2, "four": 4}


def launch(world_size: int, suite: str, workdir: Path, timeout_s: float = 300.0) -> dict:
    return worker.launch(world_size, suite, workdir, timeout_s=timeout_s, script=Path(__file__))


if __name__ == "__main__":
    worker.worker_main(sys.argv[1], Path(sys.argv[2]), suites=SUITES, world_sizes=WORLD_SIZES)
