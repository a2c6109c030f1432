"""Multi-process harness for tests/distributed/test_deepspeed.py: FSDP and every DeepSpeed ZeRO variant in one process group.

``dist_worker.launch(2, "parity", workdir, script=ds_worker.py)`` starts two ranks over gloo; each trains the tiny
model of dist_worker for 8 AdamW steps with the real ``fit()``, first under FSDP (dist_worker.train), then under
each ``--strategy deepspeed_*`` through DeepSpeed's engine and llmtrain_deepspeed's strategy, as the recipe
builds them. Rank 0 saves every run's losses and final weights to ``workdir/parity.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed

import torch

import dist_worker
from dist_worker import GLOBAL_BATCH, MAX_STEPS, SEQ_LEN, ListLoader, Recorder, build, make_samples, tiny_config
from llmtrain.args import EvalArgs, FSDPArgs, TrainArgs
from llmtrain.distributed.parallel_plan import DEEPSPEED_STRATEGIES
from llmtrain.distributed.parallelize import unwrap
from llmtrain.distributed.runtime import Runtime
from llmtrain.train.horizon import plan_horizon
from llmtrain.train.loop import Fit, TrainState, fit
from llmtrain.precision import Precision


def build_for_deepspeed(runtime: Runtime, strategy: str, *, precision: str = "32-true", config=None,
                        user: Optional[dict] = None, lora=None) -> tuple:
    """The model, plan and DeepSpeed config of ``strategy`` as the recipe builds them: stage 3 partitioned under
    deepspeed.zero.Init (llmtrain_deepspeed.build), the other stages as for one process (dist_worker.build)."""
    from llmtrain_deepspeed.build import build_partitioned_model
    from llmtrain_deepspeed.config import build_config

    info = dist_worker.layout(runtime, strategy=strategy, precision=precision)
    train_args = TrainArgs(global_batch_size=dist_worker.GLOBAL_BATCH, micro_batch_size=1, max_steps=MAX_STEPS,
                           lr_warmup_steps=2, max_norm=1.0)
    config_dict = build_config(info, train_args, user)
    if info.zero.stage == 3:
        model = build_partitioned_model(config or tiny_config(), plan=info, runtime=runtime, seed=dist_worker.SEED,
                                        deepspeed_config=config_dict, lora=lora)
        unwrap(model).max_seq_length = SEQ_LEN
    else:
        model, info = build(runtime, strategy=strategy, precision=precision, config=config)
    return model, info, config_dict, train_args


def train_deepspeed(runtime: Runtime, strategy: str, *, precision: str = "32-true",
                    user: Optional[dict] = None) -> dict:
    """dist_worker.train's run (same model, seed, data, optimizer and schedule) through DeepSpeed's engine; ``user``:
    a --deepspeed.config file's contents."""
    import deepspeed

    from llmtrain_deepspeed.engine import DeepSpeedStrategy, initialize

    if DEEPSPEED_STRATEGIES[strategy].stage == 3:
        # Stage 3 keeps parameters under 1e5 elements whole (all of this model's): a threshold of 0 partitions them.
        zero = {**(user or {}).get("zero_optimization", {}), "stage3_param_persistence_threshold": 0}
        user = {**(user or {}), "zero_optimization": zero}
    model, info, config, train_args = build_for_deepspeed(runtime, strategy, precision=precision, user=user)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    engine = initialize(model, optimizer, config, runtime)
    loader = ListLoader(dist_worker.make_samples(), info.batch.micro_batch_size, runtime.data_parallel_rank,
                        runtime.data_parallel_size)
    recorder = Recorder()
    seen: dict = {}

    def observe(state: TrainState) -> None:  # after the last step: what the engine really partitions
        zero = engine.optimizer
        flat = (getattr(zero, "single_partition_of_fp32_groups", None) or getattr(zero, "fp32_groups_flat_partition",
                                                                                  None)
                or zero.fp32_partitioned_groups_flat)  # ZeRO 1 and 2; ZeRO 1 in bf16 (BF16_Optimizer); ZeRO 3
        seen.update(stage=engine.zero_optimization_stage(), offload_optimizer=engine.zero_cpu_offload(),
                    optimizer_numel=sum(group.numel() for group in flat),
                    parameters_numel=sum(p.numel() for p in unwrap(engine).parameters()),
                    optimizer=type(zero).__name__)

    fit(Fit(runtime=runtime, model=engine, optimizer=optimizer, train_loader=loader, val_loader=None,
            train=train_args, eval=EvalArgs(initial_validation=False, final_validation=False), plan=info.batch,
            horizon=plan_horizon(train_args, GLOBAL_BATCH * SEQ_LEN, None), precision=Precision(precision),
            save_checkpoint=lambda state: None, save_final=observe, loggers=[recorder], state=TrainState(),
            autocast_enabled=not info.mixed_precision_policy, strategy=DeepSpeedStrategy))
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "weights": full_fp32_weights(engine),
            **seen}


def full_fp32_weights(engine) -> dict:
    """Every weight of the engine's model, whole on every rank: the fp32 master copy where the optimizer keeps one."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    weights = {}
    for name, param in unwrap(engine).named_parameters():
        master = safe_get_full_fp32_param(param)
        if master is None:
            with deepspeed.zero.GatheredParameters([param]):
                master = param.detach().float()
        weights[name] = master.clone().cpu()
    return weights


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


BF16_REDUCTION = {"data_types": {"grad_accum_dtype": "bf16"}, "communication_data_type": "bf16"}
"""What DeepSpeed does under bf16 unless told otherwise: it accumulates and reduces the gradients in bf16."""


def suite_parity_bf16(runtime: Runtime, workdir: Path) -> dict:
    """bf16-mixed: FSDP (bf16 compute, fp32 reduction) against each ZeRO stage with the generated config, and
    against stage 2 told to accumulate and reduce in bf16 (DeepSpeed's own default) as the control."""
    results = {"fsdp": dist_worker.train(runtime, fsdp=FSDPArgs(sharding_strategy="FULL_SHARD"),
                                         precision="bf16-mixed")}
    for strategy in ("deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"):
        results[strategy] = train_deepspeed(runtime, strategy, precision="bf16-mixed")
    results["bf16_reduction"] = train_deepspeed(runtime, "deepspeed_stage_2", precision="bf16-mixed",
                                                user=BF16_REDUCTION)
    results["gradient_error"] = {strategy: reduced_gradient_error(runtime, strategy)
                                 for strategy in ("deepspeed_stage_1", "deepspeed_stage_2")}
    results["gradient_error"]["bf16_reduction"] = reduced_gradient_error(runtime, "deepspeed_stage_2",
                                                                         user=BF16_REDUCTION)
    return results


def reduced_gradient_error(runtime: Runtime, strategy: str, user: Optional[dict] = None) -> float:
    """One optimizer step's gradient as a bf16 engine accumulates (4 micro-batches) and reduces it (2 ranks),
    against the exact sum of the same bf16 micro-batch gradients (float64): the largest error of a parameter's
    gradient, relative to that gradient's largest element. Every rank computes the same micro-batch gradients
    as the engine does (same bf16 weights and kernels), so the error is the accumulation's and reduction's alone."""
    from deepspeed.utils import safe_get_full_grad

    from llmtrain_deepspeed.engine import initialize

    model, info, config, _ = build_for_deepspeed(runtime, strategy, precision="bf16-mixed", user=user)
    engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=5e-3), config, runtime)
    loader = iter(ListLoader(dist_worker.make_samples(), 1, runtime.data_parallel_rank, runtime.data_parallel_size))
    micro_batches = [(batch["input_ids"], batch["labels"]) for batch in
                     (next(loader) for _ in range(info.batch.grad_accum_steps))]
    parameters = dict(unwrap(engine).named_parameters())

    def loss_of(inputs, labels, forward) -> torch.Tensor:
        logits = forward(inputs)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                 reduction="sum") / 64

    exact = {name: torch.zeros(param.shape, dtype=torch.float64) for name, param in parameters.items()}
    for inputs, labels in micro_batches:  # the module alone, and autograd.grad: no hook of the engine runs
        loss = loss_of(inputs, labels, engine.module)
        for name, grad in zip(parameters, torch.autograd.grad(loss, list(parameters.values()))):
            exact[name] += grad.double()
    for index, (inputs, labels) in enumerate(micro_batches):
        engine.set_gradient_accumulation_boundary(index == len(micro_batches) - 1)
        engine.backward(loss_of(inputs, labels, engine), scale_wrt_gas=False)
    worst = 0.0
    for name, param in parameters.items():
        torch.distributed.all_reduce(exact[name])
        reference = exact[name] / runtime.world_size  # ZeRO averages over the ranks
        error = (safe_get_full_grad(param).double() - reference).abs().max() / reference.abs().max()
        worst = max(worst, float(error))
    return worst


def suite_zero3_build(runtime: Runtime, workdir: Path) -> dict:
    """Stage 3 models built partitioned: what each rank holds right after the build, and the weights gathered whole
    (the plain tiny model in fp32 and bf16, a tied and unevenly sized one, and LoRA on weights from a file)."""
    import deepspeed
    from safetensors.torch import save_file

    from dist_worker import uneven_tied_config
    from llmtrain.lora import LoRAArgs
    from llmtrain_deepspeed.build import load_partitioned_weights, partitioned_numel

    def gathered(model) -> dict:
        parameters = list(unwrap(model).parameters())
        with deepspeed.zero.GatheredParameters(parameters):
            return {name: tensor.detach().clone() for name, tensor in unwrap(model).state_dict().items()}

    dist_worker.GLOBAL_BATCH = 2 * runtime.world_size  # nothing trains here: any world size will do
    results = {}
    for name, config, precision in (("tiny", tiny_config(), "32-true"), ("tiny_bf16", tiny_config(), "bf16-mixed"),
                                    ("uneven_tied", uneven_tied_config(), "32-true")):
        model, *_ = build_for_deepspeed(runtime, "deepspeed_stage_3", precision=precision, config=config)
        held, whole = partitioned_numel(model)
        results[name] = {"held": held, "whole": whole, "weights": gathered(model),
                         "tied": unwrap(model).lm_head.weight is unwrap(model).wte.weight}
    # Weights from model directories (each built model's weights times 3; a tied output layer is not stored): LoRA
    # on the tiny model, whose adapters are as reset_lora_parameters draws them, and the uneven tied model.
    for name in ("tiny", "uneven_tied"):
        if runtime.is_main:
            (workdir / name).mkdir(exist_ok=True)
            weights = {key: tensor.float() * 3 for key, tensor in results[name]["weights"].items()
                       if not (key == "lm_head.weight" and results[name]["tied"])}
            save_file(weights, str(workdir / name / "model.safetensors"))
    torch.distributed.barrier()
    lora = LoRAArgs(lora_r=4, lora_alpha=8, lora_query=True, lora_value=True, lora_mlp=True)
    model, *_ = build_for_deepspeed(runtime, "deepspeed_stage_3", lora=lora)
    load_partitioned_weights(model, workdir / "tiny")
    results["lora"] = {"weights": gathered(model),
                       "trainable": sorted(n for n, p in unwrap(model).named_parameters() if p.requires_grad)}
    model, *_ = build_for_deepspeed(runtime, "deepspeed_stage_3", config=uneven_tied_config())
    load_partitioned_weights(model, workdir / "uneven_tied")
    results["uneven_tied_loaded"] = {"weights": gathered(model)}
    return results


def suite_final_stream(runtime: Runtime, workdir: Path) -> dict:
    """final/'s tensors as DeepSpeedCheckpointer streams them, under stage 3 (fp32) and stage 2 (bf16, whose engine
    holds bf16 weights and fp32 masters): rank 0's (name, tensor) pairs, each dropped as the writer drops it, with
    the most bytes of them alive at once; and the engine's fp32 weights to compare them with."""
    import weakref

    import deepspeed

    from llmtrain_deepspeed.checkpoint import DeepSpeedCheckpointer
    from llmtrain_deepspeed.engine import initialize

    results = {}
    for strategy, precision in (("deepspeed_stage_3", "32-true"), ("deepspeed_stage_2", "bf16-mixed")):
        user = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
        model, info, config, _ = build_for_deepspeed(runtime, strategy, precision=precision, user=user)
        engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=5e-3), config, runtime)
        loader = iter(ListLoader(make_samples(), 1, runtime.data_parallel_rank, runtime.data_parallel_size))
        for index in range(info.batch.grad_accum_steps):  # one step: the fp32 masters leave their bf16 copies
            batch = next(loader)
            engine.set_gradient_accumulation_boundary(index == info.batch.grad_accum_steps - 1)
            logits = engine(batch["input_ids"])
            engine.backward(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                                                              ignore_index=-100), scale_wrt_gas=False)
        engine.step()
        checkpointer = DeepSpeedCheckpointer.__new__(DeepSpeedCheckpointer)  # only what _final_weights reads
        checkpointer.model, checkpointer.runtime, checkpointer.lora, checkpointer.base_dir = engine, runtime, False, None
        streamed, alive, most_alive = {}, [], 0
        weights = checkpointer._final_weights()
        if runtime.is_main:
            assert not isinstance(weights, dict)  # pairs to write as they come, not the whole model
            for name, tensor in weights:
                streamed[name] = tensor.clone()  # what the file gets; the writer keeps nothing
                alive.append((weakref.ref(tensor), tensor.nbytes))
                del tensor
                most_alive = max(most_alive, sum(size for ref, size in alive if ref() is not None))
        module = {}
        for name, param in unwrap(engine).named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                module[name] = param.detach().float().clone()
        results[strategy] = {"streamed": streamed, "most_alive": most_alive, "weights": full_fp32_weights(engine),
                             "module": module}
    return results


UNIVERSAL_CASES = (("deepspeed_stage_3", "32-true"), ("deepspeed_stage_1", "bf16-mixed"))
"""ZeRO 3's partitioned files, and ZeRO 1 in bf16 (DeepSpeed's BF16_Optimizer): what a universal resume converts."""


def full_training_state(engine) -> dict:
    """Every parameter's fp32 master and Adam moments, whole (on every rank), and the optimizer's step counts."""
    from deepspeed.utils import safe_get_full_optimizer_state

    state = {"weights": full_fp32_weights(engine)}
    for key in ("exp_avg", "exp_avg_sq"):
        state[key] = {name: safe_get_full_optimizer_state(param, key).clone().cpu()
                      for name, param in unwrap(engine).named_parameters()}
    return state


def suite_universal_save(runtime: Runtime, workdir: Path) -> dict:
    """Two AdamW steps, then a step checkpoint of DeepSpeedCheckpointer's files, for each UNIVERSAL_CASES."""
    from llmtrain_deepspeed.checkpoint import DeepSpeedCheckpointer
    from llmtrain_deepspeed.engine import initialize

    results = {}
    for strategy, precision in UNIVERSAL_CASES:
        model, info, config, _ = build_for_deepspeed(runtime, strategy, precision=precision)
        engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=5e-3), config, runtime)
        loader = iter(ListLoader(make_samples(), 1, runtime.data_parallel_rank, runtime.data_parallel_size))
        for _ in range(2):
            for index in range(info.batch.grad_accum_steps):
                batch = next(loader)
                engine.set_gradient_accumulation_boundary(index == info.batch.grad_accum_steps - 1)
                logits = engine(batch["input_ids"])
                engine.backward(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                                  batch["labels"].flatten(), ignore_index=-100),
                                scale_wrt_gas=False)
            engine.step()
        checkpointer = DeepSpeedCheckpointer.__new__(DeepSpeedCheckpointer)  # only what _write_tensors reads
        checkpointer.model, checkpointer.runtime, checkpointer.optimizer = engine, runtime, engine.optimizer
        directory = workdir / strategy / "step-00000002"
        directory.parent.mkdir(parents=True, exist_ok=True)
        checkpointer._write_tensors(directory)
        results[strategy] = full_training_state(engine)
    return results


def suite_universal_load(runtime: Runtime, workdir: Path) -> dict:
    """Each UNIVERSAL_CASES checkpoint of suite_universal_save loaded here (another world size) as the recipe loads
    it: the config's checkpoint.load_universal (config.resume_config), then DeepSpeedCheckpointer._load_universal."""
    from llmtrain.checkpoint import files
    from llmtrain_deepspeed.checkpoint import DeepSpeedCheckpointer
    from llmtrain_deepspeed.config import resume_config
    from llmtrain_deepspeed.engine import initialize

    dist_worker.GLOBAL_BATCH = 4 * runtime.world_size  # nothing trains here: any world size will do
    results = {}
    for strategy, precision in UNIVERSAL_CASES:
        directory = workdir / strategy / "step-00000002"
        if runtime.is_main:
            files.write_marker(directory, {"world_size": 2})  # what a step checkpoint's marker records
        runtime.barrier()  # (one process has no process group before DeepSpeed's)
        model, info, config, _ = build_for_deepspeed(runtime, strategy, precision=precision)
        engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=5e-3),
                            resume_config(config, directory, runtime.world_size), runtime)
        checkpointer = DeepSpeedCheckpointer.__new__(DeepSpeedCheckpointer)  # only what _load_universal reads
        checkpointer.model, checkpointer.runtime, checkpointer.out_dir = engine, runtime, workdir / f"{strategy}-out"
        assert engine.load_universal_checkpoint()
        checkpointer._load_universal(directory)
        results[strategy] = {**full_training_state(engine), "left": sorted(
            p.name for p in checkpointer.out_dir.iterdir()) if checkpointer.out_dir.exists() else []}
    return results


SUITES = {"parity": suite_parity, "parity_bf16": suite_parity_bf16, "zero3_build": suite_zero3_build,
          "final_stream": suite_final_stream, "universal_save": suite_universal_save,
          "universal_load": suite_universal_load}



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

    import llmtrain.recipes.prepare as recipe_prepare
    from llmtrain import cli

    launched: list[bool] = []

    def no_workers(*args, **kwargs) -> None:
        launched.append(True)
        sys.exit(99)

    recipe_prepare.launch = no_workers
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
