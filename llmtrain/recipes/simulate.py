"""``--dry_run.simulate``: chosen ranks of a large job, run on this machine through the real code, no cluster needed.

The dry run's memory and communication figures are arithmetic (:mod:`llmtrain.plan`). The simulation checks them
against what the code actually allocates and sends, at the world size the user will run, on a laptop:

- torch's fake process group (backend ``"fake"``, ``FakeStore``) makes this process rank r of a world of N: every
  collective returns at once and moves nothing, but each is issued with its real group, shapes and dtypes;
- ``FakeTensorMode`` gives every tensor a shape, dtype and size and no storage: nothing is allocated or computed;
- each simulated rank then runs what a real rank runs: the same :class:`ParallelPlan` and mesh,
  :func:`llmtrain.recipes.build.build_model` (on the meta device, ``parallelize``, materialised), the same optimizer,
  the loop's own :class:`~llmtrain.train.step.TrainStep` (the step's token all-reduce, every micro-batch of the
  planned accumulation or the pipeline schedule, clipping, the optimizer step) and the checkpointer's gathering of
  a full checkpoint. No second implementation: what the simulation measures is what those functions do.

Measured with torch's own trackers: ``FSDPMemTracker`` (FSDP) or ``MemTracker`` (peak bytes by category: parameters
sharded and gathered, gradients, optimizer state, activations, buffers for collectives), and a dispatch mode that
counts every collective with its bytes at this rank, grouped by the mesh dimension its process group belongs to.

What it cannot see: the device kernels' own workspaces and the CUDA caching allocator's fragmentation (the run's
device is stood in for by the CPU; the model picks the kernels of the plan's device, see
:func:`llmtrain.kernel_device.simulated_device_type`), NCCL's buffers, and time. DeepSpeed keeps its own buffers and
communication outside torch's dispatcher, so a DeepSpeed plan is not simulated.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan, global_rank

GiB = 2**30


# ------------------------------------------------------------------------------------ which ranks
def simulated_ranks(plan: ParallelPlan) -> list[tuple[int, str]]:
    """The ranks whose work differs, each with why it is one: rank 0 (it logs and writes shared files), the first
    rank of the last node (another node, another replica under HYBRID_SHARD), and the first rank of the last pipeline
    stage (the head and the loss). Each once, in rank order."""
    chosen = {0: "rank 0"}
    if plan.num_nodes > 1:
        chosen.setdefault(global_rank(plan.num_nodes - 1, 0, plan.devices), f"first rank of node {plan.num_nodes - 1}")
    if plan.pp > 1:
        last_stage = plan.first_rank_of_stage(plan.pp - 1)
        chosen[last_stage] = (chosen[last_stage] + ", " if last_stage in chosen else "") + "last pipeline stage"
    return sorted(chosen.items())


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` under torch's fake process group (collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # NOTE: private, but torch's own tool

    if dist.is_initialized():
        raise RuntimeError("a process group exists already: the simulation needs a process of its own")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------ counting collectives
@dataclass
class Collective:
    """Collectives of one kind on one mesh dimension: how many, and their bytes at this rank."""

    count: int = 0
    bytes: int = 0
    largest: int = 0
    """The largest single collective's bytes at this rank."""

    def add(self, nbytes: int) -> None:
        self.count += 1
        self.bytes += nbytes
        self.largest = max(self.largest, nbytes)


# The c10d operators whose size at one rank grows with the group: a gather to one rank, a scatter from one, and the
# list form of all-gather that torch's object collectives (all_gather_object, gather_object) use.
GROWS_WITH_GROUP = {"gather_", "scatter_", "allgather_", "allgather_coalesced_"}


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def _group_name(value: Any) -> Optional[str]:
    """The name of the process group ``value`` is (c10d operators get it boxed, as a ScriptObject), else None."""
    if isinstance(value, torch.ScriptObject):
        try:
            value = dist.ProcessGroup.unbox(value)
        except (RuntimeError, TypeError):  # another boxed object: a ReduceOp
            return None
    return value.group_name if isinstance(value, dist.ProcessGroup) else None


class HealthyReads(TorchDispatchMode):
    """Answers a read of a fake tensor's value (``.item()``) as a healthy run's ranks would read it: 1.

    NOTE: the fake process group delivers nothing, so a number that ranks agree on through a collective has no value
    here. The reads in a step are such agreements: the pipeline schedule's vote that every stage knows its shapes (1),
    and, for an optimizer that must be told on the host, whether the gradient norm is finite (1: it is).
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            tensor = args[0]
            return True if tensor.dtype == torch.bool else 1 if not tensor.is_floating_point() else 1.0
        return func(*args, **(kwargs or {}))


class CollectiveCounter(TorchDispatchMode):
    """Counts every collective dispatched while it is active, by (mesh dimension, operator).

    A collective's bytes at this rank are its largest tensor argument: the gathered output of an all-gather, the
    full input of a reduce-scatter, the buffer of an all-reduce, broadcast, send or receive, rank 0's list of
    outputs of a gather. ``dims`` names process groups (by group name): the mesh's dimensions and ``world``.
    """

    def __init__(self, dims: dict[str, str]) -> None:
        super().__init__()
        self.dims = dims
        self.by_dim: dict[str, dict[str, Collective]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional"):
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func, args, kwargs) -> None:
        name = func._opname
        if func.namespace == "_c10d_functional":
            if name.startswith("wait") or name == "broadcast" and False:
                return
            group = next((a for a in reversed(args) if isinstance(a, str)), kwargs.get("group_name"))  # after the op
            nbytes = _tensor_bytes(args[0])
            if name.startswith("all_gather_into_tensor"):
                group_size = next(a for a in args[1:] if isinstance(a, int))
                nbytes *= group_size
        else:
            group = next((name for name in map(_group_name, args) if name is not None), None)
            nbytes = max((_tensor_bytes(a) for a in args), default=0)
            if name in ("barrier", "monitored_barrier_"):
                nbytes = 0
        if name.startswith("wait"):
            return
        dim = self.dims.get(group, "other")
        self.by_dim.setdefault(dim, {}).setdefault(name, Collective()).add(nbytes)

    def growing(self, world_size: int) -> list[str]:
        """The collectives whose size at this rank grows with the size of their group (gathers to one rank, object
        collectives), on groups of more than one rank."""
        return [f"{op} on {dim} ({found.count}×, {_size(found.bytes)})" for dim, ops in self.by_dim.items()
                for op, found in ops.items() if op in GROWS_WITH_GROUP and found.bytes and dim != "one rank"]


def group_dims(mesh: Any) -> dict[str, str]:
    """Process group name -> the mesh dimension it belongs to (``world`` for the default group)."""
    dims = {}
    if mesh is not None:  # a dimension over every rank (FULL_SHARD over the world) is the default group itself
        for name in mesh.mesh_dim_names:
            dims.setdefault(mesh.get_group(name).group_name, name)
    dims.setdefault(dist.group.WORLD.group_name, "world")
    return dims


# ------------------------------------------------------------------------------------ one rank
@dataclass
class RankReport:
    """What one simulated rank measured, beside the dry run's estimate for its pipeline rank."""

    rank: int
    why: str
    coordinates: dict[str, int]
    peak: dict[str, int]
    """Peak bytes by category (at the moment of the step's peak total), measured by torch's memory tracker."""
    estimate: Any
    """The dry run's :class:`~llmtrain.plan.memory.MemoryEstimate` for this rank's pipeline rank."""
    comm_estimate: dict[str, float]
    """The dry run's bytes per step by mesh dimension
    (:func:`llmtrain.plan.communication.communication_bytes_per_step`)."""
    step: dict[str, dict[str, Collective]]
    """The collectives of one training step, by mesh dimension and operator."""
    checkpoint: dict[str, dict[str, Collective]] = field(default_factory=dict)
    """The collectives of gathering a full checkpoint (what rank 0 writes to model.safetensors and the optimizer)."""
    growing: list[str] = field(default_factory=list)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def peak_total(self) -> int:
        return self.peak.get("total", 0)

    @property
    def agreement(self) -> float:
        """The dry run's total over the measured peak (1.0: exact)."""
        return self.estimate.total / max(self.peak_total, 1)


def _memory_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """torch's memory tracker for ``model`` (a pipeline rank's stages together): FSDP's own categories where FSDP
    shards it, else the generic one.

    NOTE: torch's trackers keep per-module statistics for one forward of the root, and raise when a module runs again,
    which a step's next micro-batch does; the peak by category, all the simulation reads, is global, so a module's
    statistics are forgotten before each of its forwards. FSDP's tracker also expects every sharded module to run its
    own forward, which a head whose weight the fused loss reads directly never does: every module gets statistics
    before the first.
    """
    from torch.distributed.fsdp import FSDPModule

    roots = list(getattr(model, "stages", [model]))  # a pipeline rank's stages are the modules its schedule calls
    if all(isinstance(root, FSDPModule) for root in roots):
        tracker = _fsdp_tracker(roots, optimizer)
    else:
        tracker = _generic_tracker(roots)
        tracker.track_external(model, optimizer)
    # NOTE: the trackers hook every parameter's gradient, and torch refuses a hook on one that takes none (LoRA's frozen
    # base): those count as hooked already.
    for param in model.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
    return tracker


class _NoHook:
    """A hook handle for a parameter the trackers must not hook (:func:`_memory_tracker`)."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


_PROPAGATING = [0]
"""How deep this process is in DTensor's sharding propagation (:func:`_untrack_sharding_propagation`)."""


def _untrack_sharding_propagation() -> None:
    """Keep DTensor's shape propagation out of the memory trackers (in a simulated rank's own process).

    NOTE: to find an operator's output layout DTensor runs it on fake tensors of its own, which it caches with the
    operator's schema; a real run allocates nothing for them, but under the simulation's fake tensors the trackers
    counted each as a live temporary: 5.9 GiB of the 27.6 GiB measured on the last pipeline stage of a 70B model at
    tp 8, none of which a GPU would hold.
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached
    if getattr(propagate, "_llmtrain_untracked", False):
        return

    def untracked(self, *args, **kwargs):
        _PROPAGATING[0] += 1
        try:
            return propagate(self, *args, **kwargs)
        finally:
            _PROPAGATING[0] -= 1

    untracked._llmtrain_untracked = True
    ShardingPropagator._propagate_tensor_meta_non_cached = untracked


class _LeavesOutPropagation:
    """Mixed into a memory tracker: what DTensor's shape propagation dispatches is not tracked
    (:func:`_untrack_sharding_propagation`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _PROPAGATING[0]:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _fsdp_tracker(roots: list[torch.nn.Module], optimizer: torch.optim.Optimizer):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModMemStats

    class StepTracker(_LeavesOutPropagation, FSDPMemTracker):
        def _fsdp_state_pre_forward(self, fsdp_mod, orig):
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def forget_root_first(*args, **kwargs):
                if not self._mod_tracker.is_bw:  # a forward again: the next micro-batch
                    self.memory_tracking.pop(fsdp_mod, None)
                return inner(*args, **kwargs)

            return forget_root_first

        def __enter__(self):
            entered = super().__enter__()
            for name, module in self._root_mod.named_modules():
                if (not any(module is root for root in roots) and module not in self.memory_tracking
                        and hasattr(module, "_get_fsdp_state")):
                    self.memory_tracking[module] = _FSDPModMemStats(name)
            return entered

    tracker = StepTracker(roots[0], optimizer)
    if len(roots) > 1:
        tracker._root_mod = torch.nn.ModuleList(roots)  # every stage's modules, instrumented alike
    return tracker


def _generic_tracker(roots: list[torch.nn.Module]):
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(_LeavesOutPropagation, MemTracker):
        def _pre_fw_hook(self, module, inputs):
            if not self._mod_tracker.is_bw:  # a forward again: the next micro-batch
                self.memory_tracking.pop(module, None)
            return super()._pre_fw_hook(module, inputs)

    return StepTracker()


def _peak_by_category(tracker: Any) -> dict[str, int]:
    """The tracker's peak snapshot, summed over devices, with the categories named as the dry run names them."""
    snapshot = tracker.get_tracker_snapshot("peak")
    peak: dict[str, int] = {}
    for per_device in snapshot.values():
        for category, nbytes in per_device.items():
            key = "total" if str(category) == "Total" else str(getattr(category, "value", category))
            peak[key] = peak.get(key, 0) + int(nbytes)
    return peak


def _micro_batches(plan: ParallelPlan, seq_len: int, vocab_size: int) -> list[dict]:
    """One step's micro-batches, as the loaders hand them: token ids and labels of (micro batch, seq_len)."""
    shape = (plan.batch.micro_batch_size, seq_len)
    return [{"input_ids": torch.zeros(shape, dtype=torch.long), "labels": torch.ones(shape, dtype=torch.long)}
            for _ in range(plan.batch.grad_accum_steps)]


def simulate_rank(config: Config, plan: ParallelPlan, rank: int, *, seq_len: int, optimizer_spec: Any,
                  train: Any, seed: int = 42, why: str = "", checkpoint: bool = True, lora: Any = None) -> RankReport:
    """Rank ``rank`` of ``plan``: build, one training step and a full checkpoint's gathering, under the fake process
    group and fake tensors; what torch's trackers saw."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmtrain.plan import memory as planning
    from llmtrain.plan.communication import communication_bytes_per_step
    from llmtrain.distributed.runtime import Runtime
    from llmtrain.kernel_device import simulated_device_type
    from llmtrain.optim import build_optimizer
    from llmtrain.recipes.build import build_model

    started = time.perf_counter()
    _untrack_sharding_propagation()
    # NOTE: fake tensors of a CUDA plan cannot stand on a CPU-only torch (FSDP asks the device for streams); the rank
    # runs on a CPU mesh and the model and FSDP choose as on the plan's device (simulated_device_type).
    estimated_plan, plan = plan, replace(plan, device_type="cpu")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    timings = {}
    with fake_world(rank, plan.world_size), simulated_device_type(estimated_plan.device_type):
        runtime = Runtime.simulated(plan, rank)
        model = build_model(config, plan=plan, runtime=runtime, seed=seed, lora=lora, allocating=lambda: fake)
        timings["build"] = time.perf_counter() - started
        with fake, contextlib.ExitStack() as stack:
            model.max_seq_length = seq_len  # GPT and a pipeline rank's parts alike
            optimizer = build_optimizer(optimizer_spec, [p for p in model.parameters() if p.requires_grad])
            mesh = getattr(model, "mesh", None) or _mesh_of(model)
            train_step = _train_step(config, plan, runtime, model, optimizer, train, seq_len)
            stack.enter_context(HealthyReads())
            _create_optimizer_state(optimizer)  # the state every step after the first holds
            tracker, counter = _memory_tracker(model, optimizer), CollectiveCounter(group_dims(mesh))
            with tracker, counter:
                train_step()
            timings["measured step"] = time.perf_counter() - started - sum(timings.values())
            peak, step, growing = _peak_by_category(tracker), counter.by_dim, counter.growing(plan.world_size)
            checkpoint_comms: dict = {}
            if checkpoint:
                saving = CollectiveCounter(group_dims(mesh))
                with saving:
                    gather_full_checkpoint(model, optimizer, lora=lora is not None)
                checkpoint_comms = saving.by_dim
                growing += [f"checkpoint: {line}" for line in saving.growing(plan.world_size)]
    plan = estimated_plan
    pipeline_rank = runtime.pp_rank
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if lora is not None else None
    estimate = planning.estimate_memory(config, plan, seq_len=seq_len, trainable_parameters=trainable)
    if plan.pp > 1:
        params, gradients, optimizer_bytes = planning.state_bytes(config, plan, pipeline_rank)
        estimate = planning.MemoryEstimate(params, gradients, optimizer_bytes,
                                           planning.activation_bytes(config, plan, pipeline_rank, seq_len=seq_len),
                                           pipeline_rank=pipeline_rank)
    coordinates = {"pp": runtime.pp_rank, "dp": runtime.data_parallel_rank, "tp": runtime.tp_rank,
                   "node": plan.node_and_local_rank(rank)[0]}
    comm_estimate = communication_bytes_per_step(config, plan, seq_len, pipeline_rank)
    return RankReport(rank=rank, why=why, coordinates=coordinates, peak=peak, estimate=estimate, step=step,
                      comm_estimate=comm_estimate,
                      checkpoint=checkpoint_comms, growing=growing, seconds=time.perf_counter() - started,
                      timings=timings)


def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state as a run holds it from its first step on (AdamW creates its moments lazily, in the first
    ``step``): one step of the optimizer on zero gradients, which are then dropped as the loop drops them."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _mesh_of(model: torch.nn.Module) -> Any:
    """The DeviceMesh the model's parameters live on (FSDP, TP): the whole mesh, not their sub-mesh; else None."""
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor):
            return param.device_mesh._get_root_mesh()
    return None


def _train_step(config: Config, plan: ParallelPlan, runtime: Any, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, train: Any, seq_len: int) -> Callable[[], Any]:
    """The loop's own step (:class:`~llmtrain.train.step.TrainStep`) for this rank, over one step's micro-batches."""
    from llmtrain.args import EvalArgs
    from llmtrain.distributed.pipeline import build_pipeline
    from llmtrain import callbacks
    from llmtrain.train.horizon import Horizon
    from llmtrain.train.loop import Fit
    from llmtrain.train.step import TrainStep
    from llmtrain.train.strategy import TorchStrategy

    pipeline = build_pipeline(model, plan, runtime) if plan.pp > 1 else None
    job = Fit(runtime=runtime, model=model, optimizer=optimizer, train_loader=None, val_loader=None, train=train,
              eval=EvalArgs(), plan=plan.batch, horizon=Horizon(total_steps=1, warmup_steps=0, set_by="simulate"),
              precision=plan.precision, save_checkpoint=lambda state: None, save_final=lambda state: None,
              scaler=plan.precision.grad_scaler(runtime.device), autocast_enabled=not plan.mixed_precision_policy,
              grad_sync_only_last=plan.grad_sync_only_last, pipeline=pipeline,
              pp_mesh=pipeline.pp_mesh if pipeline is not None else None)
    step = TrainStep(job, TorchStrategy(job), callbacks.Callbacks([]))
    micro_batches = _micro_batches(plan, seq_len, config.padded_vocab_size)
    tokens = sum(batch["input_ids"].numel() for batch in micro_batches) * runtime.counts_batch
    return lambda: step(1, micro_batches, [tokens])


def gather_full_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, lora: bool) -> None:
    """What a full checkpoint (``--fsdp.state_dict_type full``, and ``final/``) gathers: the checkpointer's own
    function for it (:func:`llmtrain.checkpoint.checkpointer.full_states`)."""
    from llmtrain.checkpoint.checkpointer import full_states

    full_states(model, optimizer, lora=lora)


# ------------------------------------------------------------------------------------ the whole simulation
def simulate(config: Config, plan: ParallelPlan, *, seq_len: int, optimizer_spec: Any, train: Any,
             ranks: Optional[list[tuple[int, str]]] = None, checkpoint: bool = True, lora: Any = None,
             seed: int = 42) -> list[RankReport]:
    """Every rank of :func:`simulated_ranks` (or ``ranks``), each in a child process of its own, side by side."""
    children = [start_child_process(simulate_rank, config, plan, rank, seq_len=seq_len, optimizer_spec=optimizer_spec,
                                    train=train, why=why, checkpoint=checkpoint, lora=lora, seed=seed)
                for rank, why in (ranks if ranks is not None else simulated_ranks(plan))]
    return [finish(child) for child, finish in children]


def check_simulable(plan: ParallelPlan, quantize: Optional[str], config: Optional[Config] = None) -> None:
    """What the simulation cannot run, refused before it starts."""
    if config is not None and config.is_moe:
        # NOTE: routing sizes each expert's rows by the router's choices (bincount, split), values that fake tensors
        # do not have; torch's fake mode stops at the first such operator.
        raise ValueError(f"--dry_run.simulate cannot run a mixture of experts ({config.name or 'this model'}): how "
                         "many tokens each expert gets depends on the values, which its fake tensors do not have; "
                         "drop --dry_run.simulate (the dry run's estimate counts the experts)")
    if plan.wrapper == "deepspeed":
        raise ValueError("--dry_run.simulate runs torch's own data parallelism (FSDP, DDP) with tensor and pipeline "
                         "parallelism; DeepSpeed keeps its buffers and collectives outside torch's trackers: simulate "
                         "the same layout with --strategy fsdp, or drop --dry_run.simulate")
    if quantize is not None:
        raise ValueError(f"--dry_run.simulate cannot run --quantize {quantize}: bitsandbytes quantizes real weights, "
                         "which fake tensors do not have; drop one of the two")


def run_simulation(config: Config, plan: ParallelPlan, *, seq_len: int, train: Any, optimizer: Any, lora: Any = None,
                   quantize: Optional[str] = None, seed: int = 42) -> list[RankReport]:
    """``--dry_run.simulate``: simulate the ranks whose work differs and print what they measured."""
    check_simulable(plan, quantize, config)
    started = time.perf_counter()
    try:
        reports = simulate(config, plan, seq_len=seq_len, optimizer_spec=optimizer, train=train, lora=lora, seed=seed)
    except SimulationError as error:
        raise SimulationError(f"the simulation of this layout failed in the real code ({error}); the run would fail "
                              "the same way: please report it with this command", error.trace) from None
    print(describe(reports, plan))
    print(f"simulated in {time.perf_counter() - started:.1f}s")
    return reports


def in_child_process(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` in a forked child (:func:`start_child_process`): its result, or its error."""
    child, finish = start_child_process(function, *args, **kwargs)
    return finish(child)


def start_child_process(function: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Callable[[Any], Any]]:
    """Start ``function(*args, **kwargs)`` in a forked child; returns (the child, a function that waits for it and
    returns its result or raises its error here). Several children run side by side, one simulated rank each.

    NOTE: each simulated rank is a world of its own, and torch caches DeviceMeshes by their shape, names and ranks,
    not by their process groups: in one process, a second world's FSDP parameters came out on the first world's
    mesh, whose groups were destroyed with it. A fork shares the imports (milliseconds) but none of that state.
    """
    import multiprocessing
    import os
    import traceback

    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        code = 0
        try:
            send.send(("ok", function(*args, **kwargs)))
        except BaseException as error:  # noqa: BLE001 - everything goes back to the parent, which raises it
            code = 1
            send.send(("error", (type(error).__name__, str(error), traceback.format_exc())))
        finally:
            send.close()
            os._exit(code)

    process = context.Process(target=child, daemon=True)
    process.start()
    send.close()

    def finish(process: Any) -> Any:
        try:
            kind, value = receive.recv()
        except EOFError:
            process.join()
            raise SimulationError(f"the simulated rank's process died (exit code {process.exitcode})") from None
        process.join()
        if kind == "error":
            name, message, trace = value
            raise SimulationError(f"{name}: {message}", trace)
        return value

    return process, finish


class SimulationError(RuntimeError):
    """A simulated rank failed: the message, and the child's traceback in ``trace``."""

    def __init__(self, message: str, trace: str = "") -> None:
        super().__init__(message)
        self.trace = trace


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 10 else f"{nbytes / 2**20:.1f} MiB"


def describe(reports: list[RankReport], plan: ParallelPlan) -> str:
    """The simulation's lines for the dry run: per rank, measured memory beside the estimate, and the step's
    collectives per mesh dimension beside the dry run's figure."""
    lines = [f"simulated    {len(reports)} rank(s) of {plan.world_size} through the real parallelize, training step "
             "and full-checkpoint gathering (torch's fake process group and fake tensors; peak by torch's tracker)"]
    for report in reports:
        estimate = report.estimate
        where = ", ".join(f"{name} {value}" for name, value in report.coordinates.items())
        lines.append(f"  rank {report.rank:<5} {report.why} ({where}), {report.seconds:.1f}s")
        # NOTE: torch's own categories, as its tracker names them: at the peak FSDP's accumulated gradients, for one,
        # may be counted among the temporaries of the backward that made them.
        measured = " | ".join(f"{category.lower()} {_size(nbytes)}" for category, nbytes in report.peak.items()
                              if category != "total" and nbytes >= 2**20)
        lines.append(f"    memory     measured {_size(report.peak_total)} (torch's tracker): {measured}")
        lines.append(f"               estimate {_size(estimate.total)} ({report.agreement:.0%} of measured): "
                     "parameters "
                     f"{_size(estimate.parameters)} | gradients {_size(estimate.gradients)} | optimizer "
                     f"{_size(estimate.optimizer)} | activations {_size(estimate.activations)}")
        for dim, ops in sorted(report.step.items()):
            total = sum(found.bytes for found in ops.values())
            what = ", ".join(f"{found.count} {op.rstrip('_')}" for op, found in sorted(ops.items()))
            expected = report.comm_estimate.get(dim)
            lines.append(f"    step comm  {dim:13} {_size(total):>10} ({what})"
                         + (f"; dry run {_size(expected)}" if expected is not None else ""))
        if report.checkpoint:
            received = max((found.largest for ops in report.checkpoint.values() for found in ops.values()), default=0)
            total = sum(found.bytes for ops in report.checkpoint.values() for found in ops.values())
            lines.append(f"    checkpoint full state gathered: {_size(total)} in all, at most {_size(received)} in one "
                         "collective")
        for line in report.growing:
            lines.append(f"    WARNING    grows with the world size at this rank: {line}")
    return "\n".join(lines)
