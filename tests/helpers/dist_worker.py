"""Multi-process harness for tests/distributed/test_parallelize.py: a tiny training job and the ranks that run it.

``launch(world_size, suite, workdir)`` starts ``world_size`` copies of this file with torchrun-style
variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) on a free port over gloo; each rank runs
the scenarios of ``suite`` with the real ``fit()`` and rank 0 saves their results to
``workdir/SUITE.pt``. The single-process reference runs the same ``train()`` in the test process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from llmtrain.args import EvalArgs, TrainArgs
from llmtrain.config import Config
from llmtrain.args import FSDPArgs
from llmtrain.checkpoint.checkpointer import build_checkpointer
from llmtrain.checkpoint.weights import gather_full_model_state
from llmtrain.distributed.parallel_plan import DEEPSPEED_STRATEGIES, ParallelPlan
from llmtrain.distributed import shared_memory
from llmtrain.distributed.parallelize import materialize, parallelize
from llmtrain.distributed.runtime import Runtime
from llmtrain.model import GPT
from llmtrain.train.horizon import plan_horizon
from llmtrain.train.loop import IGNORE_INDEX, Fit, TrainState, fit
from llmtrain.precision import Precision

from conftest import LAUNCHER_PREFIXES, LAUNCHER_VARS, ListLoader, free_port_number

# A worker runs as a script from its own folder: it needs the repository (llmtrain), tests/ (conftest) and
# tests/helpers/ (the other helpers) on its path.
CHILD_PATHS = (Path(__file__).resolve().parents[2], Path(__file__).resolve().parents[1], Path(__file__).resolve().parent)

SEED = 1234
SEQ_LEN = 16
GLOBAL_BATCH = 8
MAX_STEPS = 8
SAVE_INTERVAL = 4
COLLECTIVE_TIMEOUT_S = 300


def tiny_config(**overrides) -> Config:
    """llama-debug shrunk to 2 layers of width 64 and a 256-token vocabulary."""
    fields = dict(n_layer=2, n_embd=64, n_head=4, n_query_groups=2, intermediate_size=128, vocab_size=256,
                  block_size=32)
    return Config.from_name("llama-debug", **{**fields, **overrides})


def moe_config() -> Config:
    """moe-debug shrunk as tiny_config (4 experts of width 64, top-2), with the auxiliary and z losses on and the
    auxiliary-loss-free bias update."""
    return Config.from_name("moe-debug", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, n_expert=4,
                            moe_intermediate_size=64, vocab_size=256, block_size=32, router_aux_loss_coef=0.05,
                            router_z_loss_coef=0.01, router_bias_update_rate=0.01)


def uneven_tied_config() -> Config:
    """Tied embeddings and an MLP width (99) that no world size here divides: FSDP pads the last shard."""
    return Config.from_name("qwen2-debug", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, intermediate_size=99,
                            vocab_size=250, padding_multiple=2, block_size=32)


def make_samples(count: int = 96, length: int = SEQ_LEN, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable sequences (each token determines the next), with 1 to `length` real targets per sample:
    padding varies a lot between ranks and micro-batches."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(count):
        tokens = [int(torch.randint(0, 256, (1,), generator=generator))]
        for _ in range(length):
            tokens.append((5 * tokens[-1] + 3) % 256)
        sequence = torch.tensor(tokens)
        labels = sequence[1:].clone()
        labels[1 + (index * 7) % length:] = IGNORE_INDEX
        samples.append((sequence[:-1], labels))
    return samples


@dataclass
class Recorder:
    """A logger for fit(): keeps loss and grad norm per step."""

    losses: dict = field(default_factory=dict)
    grad_norms: dict = field(default_factory=dict)
    moe: dict = field(default_factory=dict)
    """A mixture of experts' metrics (moe/...) per step."""

    def log(self, metrics: dict) -> None:
        if "loss" in metrics:
            self.losses[metrics["step"]] = metrics["loss"]
            self.grad_norms[metrics["step"]] = metrics["grad_norm"]
            self.moe[metrics["step"]] = {key: value for key, value in metrics.items() if key.startswith("moe/")}

    def close(self) -> None:
        pass


def layout(runtime: Runtime, *, strategy: str = "auto", fsdp: Optional[FSDPArgs] = None,
           precision: str = "32-true", num_nodes: int = 1, micro_batch_size: int = 1) -> ParallelPlan:
    """The parallel plan of this process group, resolved from flags as a recipe does.

    The flags refuse offloading (``cpu_offload``, the ``deepspeed_*_offload`` strategies) on a CPU run, where it would
    do nothing; these tests have no GPU, so they ask for it all the same to run FSDP's and DeepSpeed's offload paths
    (FSDP's policy, DeepSpeed's host optimizer, checkpoints of offloaded state) for real: the plan is resolved
    without it and gets it afterwards.
    """
    train_args = TrainArgs(global_batch_size=GLOBAL_BATCH, micro_batch_size=micro_batch_size, max_steps=MAX_STEPS,
                           lr_warmup_steps=2, max_norm=1.0)
    offload = fsdp is not None and fsdp.cpu_offload
    zero = DEEPSPEED_STRATEGIES.get(strategy)
    zero_offload = zero is not None and zero.offload_optimizer
    plan = ParallelPlan.resolve(devices=runtime.world_size // num_nodes, num_nodes=num_nodes, train=train_args,
                                precision=precision, accelerator=runtime.device.type,
                                strategy=f"deepspeed_stage_{zero.stage}" if zero_offload else strategy,
                                fsdp=replace(fsdp, cpu_offload=False) if offload else fsdp)
    return replace(plan, cpu_offload=offload, zero=zero if zero_offload else plan.zero)


def build(runtime: Runtime, *, config: Optional[Config] = None, **layout_args):
    """Meta model → parallelize → materialize, as a recipe does."""
    plan = layout(runtime, **layout_args)
    with torch.device("meta"):
        model = GPT(config or tiny_config())
    model.max_seq_length = SEQ_LEN
    model.to(plan.precision.param_dtype)
    model = parallelize(model, plan, device=runtime.device)
    materialize(model, runtime.device, SEED, cpu_offload=plan.cpu_offload)
    return model, plan


def mesh_ndim(model: torch.nn.Module, plan: ParallelPlan) -> int:
    """The dimensions of the mesh the parameters really live on (FSDP), 1 for DDP, 0 without a wrapper."""
    from torch.distributed.tensor import DTensor

    parameter = next(model.parameters())
    if isinstance(parameter, DTensor):
        return parameter.device_mesh.ndim
    return 1 if plan.wrapper == "ddp" else 0


def offload_policies(model: torch.nn.Module) -> list[str]:
    """The offload policies FSDP's units with parameters really apply (``OffloadPolicy`` is none)."""
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    groups = [unit._get_fsdp_state()._fsdp_param_group for unit in units]
    return sorted({type(group.offload_policy).__name__ for group in groups if group is not None})


def fsdp_units(model: torch.nn.Module) -> list[list[str]]:
    """The modules fully_shard made into units, grouped by unit (modules sharded together share one), sorted."""
    from torch.distributed.fsdp import FSDPModule

    units: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            units.setdefault(id(module._get_fsdp_state()), []).append(name)
    return sorted(units.values())


class CountedCalls:
    """Counts the calls of ``owner.name`` while entered (each call goes on to the real function)."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.count = owner, name, 0

    def __enter__(self) -> "CountedCalls":
        self.original = getattr(self.owner, self.name)

        def counted(*args, **kwargs):
            self.count += 1
            return self.original(*args, **kwargs)

        setattr(self.owner, self.name, counted)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.owner, self.name, self.original)


def train(runtime: Runtime, *, strategy: str = "auto", fsdp: Optional[FSDPArgs] = None, precision: str = "32-true",
          num_nodes: int = 1, micro_batch_size: int = 1, out_dir: Optional[Path] = None,
          checkpoint_formats: tuple[str, ...] = ("sharded",), resume_from: Optional[Path] = None,
          config: Optional[Config] = None) -> dict:
    """8 AdamW steps of the tiny model (or ``config``) with fit(); checkpoints every 4 steps into out_dir/FORMAT/
    when given.

    A resume loads ``resume_from`` (either format) through the first checkpointer.
    """
    config = config or tiny_config()
    model, info = build(runtime, config=config, strategy=strategy, fsdp=fsdp, precision=precision,
                        num_nodes=num_nodes, micro_batch_size=micro_batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    train_args = TrainArgs(global_batch_size=GLOBAL_BATCH, micro_batch_size=micro_batch_size, max_steps=MAX_STEPS,
                           lr_warmup_steps=2, save_interval=SAVE_INTERVAL if out_dir else None, max_norm=1.0)
    plan = info.batch
    loader = ListLoader(make_samples(), plan.micro_batch_size, runtime.data_parallel_rank,
                        runtime.data_parallel_size)
    state = TrainState()
    arguments = dict(runtime=runtime, model=model, optimizer=optimizer, train_loader=loader,
                     model_config=config, tokenizer=None, hyperparameters={"test": True})
    checkpointers = [build_checkpointer(fmt, out_dir=Path(out_dir or ".") / fmt, **arguments)
                     for fmt in checkpoint_formats]
    if resume_from is not None:
        checkpointers[0].load(resume_from, state)
    recorder = Recorder()
    job = Fit(runtime=runtime, model=model, optimizer=optimizer, train_loader=loader, val_loader=None,
              train=train_args, eval=EvalArgs(initial_validation=False, final_validation=False), plan=plan,
              horizon=plan_horizon(train_args, GLOBAL_BATCH * SEQ_LEN, None), precision=Precision(precision),
              save_checkpoint=lambda s: [c.save(s) for c in checkpointers] if out_dir else None,
              save_final=lambda s: checkpointers[0].save_final(s) if out_dir else None,
              loggers=[recorder], state=state, autocast_enabled=not info.mixed_precision_policy,
              grad_sync_only_last=info.grad_sync_only_last, config=config)
    host_calls = dict(shared_memory.calls)
    with (CountedCalls(torch.distributed, "all_gather_single") as all_gathers,  # FSDP2's all-gather of a unit
          CountedCalls(torch.distributed, "reduce_scatter_single") as reduce_scatters,  # FSDP2's own reduce-scatter
          CountedCalls(torch.distributed, "all_reduce") as all_reduces):
        fit(job)
    # Through shared memory (llmtrain.distributed.shared_memory): one host's FSDP collectives, unless switched off.
    host = {kind: shared_memory.calls[kind] - count for kind, count in host_calls.items()}
    return {"losses": recorder.losses, "all_gathers": all_gathers.count, "reduce_scatters": reduce_scatters.count,
            "all_reduces": all_reduces.count, "host_all_gathers": host["all_gather"],
            "host_reduce_scatters": host["reduce_scatter"], "grad_norms": recorder.grad_norms,
            "mesh_shape": info.describe_mesh(),
            "mesh_ndim": mesh_ndim(model, info), "wrapper": info.wrapper,
            "sharding_strategy": info.sharding_strategy, "autocast_enabled": not info.mixed_precision_policy,
            "weights": gather_full_model_state(model),
            "grad_accum_steps": plan.grad_accum_steps, "fsdp_units": fsdp_units(model),
            "offload_policies": offload_policies(model), "moe": recorder.moe,
            "expert_biases": runtime.all_gather_object(expert_biases(model))}


_ONE_PROCESS_MOE: dict = {}


def one_process_moe() -> dict:
    """``train`` of :func:`moe_config` in this process, once per process (two test modules compare with it)."""
    if not _ONE_PROCESS_MOE:
        _ONE_PROCESS_MOE.update(train(Runtime(), config=moe_config()))
    return _ONE_PROCESS_MOE


def expert_biases(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's ``expert_bias`` of each MoE layer (buffers: every rank holds them whole)."""
    from llmtrain.moe import moe_layers

    return [layer.expert_bias.detach().cpu().clone() for _, layer in moe_layers(model)]


def initial_weights(runtime: Runtime, **build_args) -> dict:
    """The full weights right after materialize (gathered on rank 0), and whether the embedding is still tied."""
    model, info = build(runtime, config=uneven_tied_config(), **build_args)
    tied = model.lm_head.weight is model.wte.weight
    return {"weights": gather_full_model_state(model), "tied": tied, "mesh_shape": info.describe_mesh(),
            "fsdp_units": fsdp_units(model)}


# ------------------------------------------------------------------------------------ suites
def suite_two(runtime: Runtime, workdir: Path) -> dict:
    from llmtrain.distributed import parallelize
    from llmtrain import compiling

    # The tiny model's gradient buffers are far below the size from which FSDP's reduce-scatter becomes an all-reduce
    # on the CPU where shared memory is off: take that path for all of them in the run that switches it off.
    parallelize.ALL_REDUCE_SCATTER_MIN_BYTES = 0
    os.environ["LLMTRAIN_HOST_COLLECTIVES"] = "0"
    try:
        through_gloo = train(runtime, fsdp=FSDPArgs(sharding_strategy="FULL_SHARD"))
    finally:
        del os.environ["LLMTRAIN_HOST_COLLECTIVES"]
    # /dev/shm without room for the slots (rank 0's posix_fallocate fails): every rank falls back to gloo, together.
    create = shared_memory._create
    shared_memory._create = lambda nbytes, kind: None
    try:
        no_room = train(runtime, fsdp=FSDPArgs(sharding_strategy="FULL_SHARD"))
    finally:
        shared_memory._create = create
    full_shard = train(runtime, fsdp=FSDPArgs(sharding_strategy="FULL_SHARD"), out_dir=workdir / "two",
                       checkpoint_formats=("sharded", "full"))
    from llmtrain.plan.memory import host_collective_bytes

    shared = {"mapped": dict(shared_memory.mapped),
              "planned": host_collective_bytes(tiny_config(),
                                               layout(runtime, fsdp=FSDPArgs(sharding_strategy="FULL_SHARD")))}
    # Block attention with the fused q/k/v path (llmtrain.fused) on FSDP's gathered weights: the tiny model's
    # sequences are below the rule's bound on rows, so lower it (as on a measured CPU).
    from llmtrain import fused, model as model_module

    thresholds = (model_module.CPU_MEASURED_FOR_BLOCK_ATTENTION, model_module.CPU_BLOCK_ATTENTION_MIN_ROWS)
    model_module.CPU_MEASURED_FOR_BLOCK_ATTENTION, model_module.CPU_BLOCK_ATTENTION_MIN_ROWS = True, 1
    fused_calls = []
    model_module.qkv_attention = lambda *args: fused_calls.append(args[0].size(1)) or fused.qkv_attention(*args)
    try:
        fused_attention = train(runtime, fsdp=FSDPArgs(sharding_strategy="FULL_SHARD"))
    finally:
        model_module.CPU_MEASURED_FOR_BLOCK_ATTENTION, model_module.CPU_BLOCK_ATTENTION_MIN_ROWS = thresholds
        model_module.qkv_attention = fused.qkv_attention
    fused_attention["fused_calls"] = len(fused_calls)
    return {
        "full_shard": full_shard,
        "fused_attention": fused_attention,
        "shared_memory_bytes": shared,
        "full_shard_gloo": through_gloo,
        "full_shard_no_room": no_room,
        "shard_grad_op": train(runtime, fsdp=FSDPArgs(sharding_strategy="SHARD_GRAD_OP"), micro_batch_size=2),
        "ddp": train(runtime, strategy="ddp"),
        "activation_checkpointing": train(runtime, fsdp=FSDPArgs(activation_checkpointing=True)),
        "op_checkpointing": train(runtime, fsdp=FSDPArgs(activation_checkpointing="op")),
        "bf16_mixed": train(runtime, precision="bf16-mixed"),
        "cpu_offload": train(runtime, fsdp=FSDPArgs(cpu_offload=True)),
        # A mixture of experts: balancing losses and the bias update, checkpointed (tests/train/test_moe_training.py).
        "moe": train(runtime, fsdp=FSDPArgs(sharding_strategy="FULL_SHARD"), config=moe_config(),
                     out_dir=workdir / "moe"),
        "init": initial_weights(runtime),
        # --compile auto: rank 0 alone would compile, then every rank would: each rank's decision after the vote.
        "compile_votes": [compiling.agree(compiling.CompileChoice(wants, "auto", local=True), runtime).enabled
                          for wants in (runtime.rank == 0, True)],
    }


def suite_four(runtime: Runtime, workdir: Path) -> dict:
    two = workdir / "two"
    return {
        "hsdp": train(runtime, num_nodes=2),
        "resume_sharded": train(runtime, num_nodes=2, out_dir=workdir / "four", resume_from=two / "sharded" / "step-00000004"),
        "resume_full": train(runtime, fsdp=FSDPArgs(sharding_strategy="FULL_SHARD"), out_dir=workdir / "four_full",
                             checkpoint_formats=("full",), resume_from=two / "full" / "step-00000004"),
        # Under DDP, and across formats: a full-format run resumes a sharded checkpoint and vice versa.
        "resume_sharded_ddp": train(runtime, strategy="ddp", out_dir=workdir / "four_ddp", checkpoint_formats=("full",),
                                    resume_from=two / "sharded" / "step-00000004"),
        "resume_full_ddp": train(runtime, strategy="ddp", out_dir=workdir / "four_ddp_full",
                                 resume_from=two / "full" / "step-00000004"),
        "init": initial_weights(runtime, num_nodes=2),
    }


def peak_bytes(runtime: Runtime, config: Config, plan: ParallelPlan, seq_len: int, steps: int = 2) -> int:
    """Peak bytes of live tensors on this rank over ``steps`` optimizer steps with the plan's gradient accumulation
    and gradient sync, as torch's MemTracker counts them on the CPU (the loop's micro-batches, without fit()'s
    bookkeeping)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from llmtrain.recipes.build import build_model
    from llmtrain.train.strategy import gradient_sync

    model = build_model(config, plan=plan, runtime=runtime, seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(runtime.rank)
    micro_batches = plan.batch.grad_accum_steps
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for _ in range(steps):
            for index in range(micro_batches):
                tracker.reset_mod_stats()  # each micro-batch runs the modules again; the peak is kept
                tokens = torch.randint(0, config.vocab_size, (plan.batch.micro_batch_size, seq_len + 1),
                                       generator=generator)
                with gradient_sync(model, index == micro_batches - 1 or not plan.grad_sync_only_last):
                    with plan.precision.autocast(runtime.device, enabled=not plan.mixed_precision_policy):
                        loss = model(tokens[:, :-1], labels=tokens[:, 1:]) / tokens[:, 1:].numel()
                    loss.backward()
                del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def suite_memory(runtime: Runtime, workdir: Path) -> dict:
    """Measured peaks of FULL_SHARD with 4 micro-batches a step, gradients reduced after the last one only
    (--fsdp.skip_gradient_sync, the default) or after each. Weights of 15M parameters and short sequences: the
    weights and gradients make the peak, not the activations. /dev/shm's slots (which the dry run counts apart)
    are off."""
    os.environ["LLMTRAIN_HOST_COLLECTIVES"] = "0"
    config = tiny_config(n_layer=4, n_embd=512, n_head=8, n_query_groups=4, intermediate_size=1536, vocab_size=4096)
    peaks = {}
    for skip in (True, False):
        plan = layout(runtime, fsdp=FSDPArgs(sharding_strategy="FULL_SHARD", skip_gradient_sync=skip))
        peaks[skip] = {"plan": plan, "measured": peak_bytes(runtime, config, plan, SEQ_LEN)}
    return {"config": config, "seq_len": SEQ_LEN, "peaks": peaks}


SUITES = {"two": suite_two, "four": suite_four, "memory": suite_memory}
WORLD_SIZES = {"two": 2, "four": 4}


def end_group_for_the_next(runtime: Runtime, workdir: Path, suite: str) -> None:
    """End this process group once rank 0 has picked a port for the next one, that of ``suite``, and written it
    where every rank of that suite finds it (:func:`meet_for`): for suites of one launch that each need a process
    group of their own."""
    if runtime.is_main:
        (workdir / f"{suite}.port.part").write_text(str(free_port_number()))
        os.replace(workdir / f"{suite}.port.part", workdir / f"{suite}.port")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def meet_for(workdir: Path, suite: str, world_size: int) -> None:
    """Point this rank at the process group of ``suite`` (a suite after the launch's first): wait until rank 0 has
    written its port, for as long as a collective may take (rank 0 may still be running a suite without this rank)."""
    port_file, deadline = workdir / f"{suite}.port", time.monotonic() + COLLECTIVE_TIMEOUT_S
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no port for suite {suite!r} after {COLLECTIVE_TIMEOUT_S}s")
        time.sleep(0.1)
    os.environ["MASTER_PORT"] = port_file.read_text()
    os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(world_size)


def worker_main(suite: str, workdir: Path, suites: Optional[dict] = None,
                world_sizes: Optional[dict] = None) -> None:
    """One rank: run the suite (of ``suites``, default SUITES; "a+b": a then b, in one process group), save rank 0's
    results of each, then leave without the interpreter's teardown.

    ``world_sizes``: {suite: ranks} for suites on fewer ranks than the launch started (default: all of them). Such a
    suite runs on the first ranks, in a process group of their own, started after the group before it ends (on a
    port that rank 0 picked: :func:`end_group_for_the_next`); the other ranks skip it."""
    code = 0
    try:
        torch.set_num_threads(1)
        rank, launched = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        names = suite.split("+")
        sizes = [(world_sizes or {}).get(name, launched) for name in names]
        for index, name in enumerate(names):
            if rank >= sizes[index]:
                continue
            if not torch.distributed.is_initialized():
                if index:
                    meet_for(workdir, name, sizes[index])
                else:
                    os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(sizes[0])
                runtime = Runtime.from_env("cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
            results = (suites or SUITES)[name](runtime, workdir)
            if runtime.is_main:
                torch.save(results, workdir / f"{name}.pt")
            if index + 1 < len(names) and sizes[index + 1] != sizes[index]:
                end_group_for_the_next(runtime, workdir, names[index + 1])
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: with gloo a rank may abort in interpreter teardown after training; skip the teardown.
    os._exit(code)


# ------------------------------------------------------------------------------------ launcher
def launch(world_size: int, suite: str, workdir: Path, timeout_s: float = 900.0, script: Optional[Path] = None) -> dict:
    """Run ``suite`` on ``world_size`` local ranks; fail fast when any rank fails, and after timeout_s at most.
    Several suites "a+b" run one after the other in the same ranks (one start-up): {name: results} of each.

    ``script``: the worker to start (default this file), called as ``script SUITE WORKDIR``."""
    workdir = Path(workdir)
    # The shell's own launcher variables (torchrun, SLURM) must not leak into the ranks.
    inherited = {name: value for name, value in os.environ.items()
                 if name not in LAUNCHER_VARS and not name.startswith(LAUNCHER_PREFIXES)}
    env = {**inherited, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_number()), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([*map(str, CHILD_PATHS), os.environ.get("PYTHONPATH", "")])}
    logs = [workdir / f"{suite}-rank{rank}.log" for rank in range(world_size)]
    processes = []
    for rank in range(world_size):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        with open(logs[rank], "w") as log:
            processes.append(subprocess.Popen([sys.executable, str(script or __file__), suite, str(workdir)], env=rank_env,
                                              stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    failure = None
    while any(p.poll() is None for p in processes):
        failed = [rank for rank, p in enumerate(processes) if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            failure = f"rank {failed[0]} failed" if failed else f"timed out after {timeout_s:.0f}s"
            break
        time.sleep(0.1)
    for p in processes:
        if p.poll() is None:
            p.kill()
        p.wait()
    if failure is None and any(p.returncode != 0 for p in processes):
        failure = f"exit codes {[p.returncode for p in processes]}"
    if failure is not None:
        tails = "\n".join(f"--- rank {rank} ---\n{log.read_text()[-3000:]}" for rank, log in enumerate(logs))
        raise RuntimeError(f"{world_size}-rank suite {suite!r}: {failure}\n{tails}")
    if "+" in suite:
        return {name: torch.load(workdir / f"{name}.pt", weights_only=False) for name in suite.split("+")}
    return torch.load(workdir / f"{suite}.pt", weights_only=False)


if __name__ == "__main__":
    worker_main(sys.argv[1], Path(sys.argv[2]), world_sizes=WORLD_SIZES)
