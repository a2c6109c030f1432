"""Multi-process harness for tests/distributed/test_tensor_parallel.py: tensor-parallel scenarios on real gloo ranks.

``dist_worker.launch(4, "four+two", workdir, script=tp_worker.SCRIPT)`` starts the ranks; each runs the suite's
scenarios one after another in the same process group, "four" on all 4 ranks, then "two" on the first 2 in a group of
their own (WORLD_SIZES; one start for both), and rank 0 saves the results.
The single-process references call the same functions in the test process.
"""

from __future__ import annotations

import functools

import sys
from pathlib import Path
from typing import Callable, Optional

import torch

import dist_worker
from llmtrain.args import EvalArgs, FSDPArgs, TrainArgs
from llmtrain.checkpoint.checkpointer import build_checkpointer
from llmtrain.checkpoint.weights import gather_full_model_state
from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.distributed.parallelize import materialize, parallelize
from llmtrain.distributed.runtime import Runtime
from llmtrain.model import GPT
from llmtrain.optim import build_optimizer
from llmtrain.train.horizon import plan_horizon
from llmtrain.train.loop import Fit, TrainState, fit
from llmtrain.precision import Precision

from conftest import ListLoader

SCRIPT = Path(__file__)
SEQ_LEN = dist_worker.SEQ_LEN
GLOBAL_BATCH = dist_worker.GLOBAL_BATCH
MAX_STEPS = dist_worker.MAX_STEPS
# Every family of the zoo, shrunk so that tp 2 divides heads, query groups, MLP width and vocabulary; a sliding
# window shorter than the sequence (Mistral) and several query heads per group (Llama, Qwen2) included.
FAMILIES = {
    "llama-debug": dict(n_layer=2, n_embd=64, intermediate_size=128),
    "qwen2-debug": dict(n_embd=64, intermediate_size=96),  # qkv bias, tied embeddings
    "gemma-debug": dict(n_embd=64, n_query_groups=2, intermediate_size=128),  # tied, scaled embeddings, GeGLU
    "phi-debug": dict(n_embd=64, intermediate_size=128),  # parallel residual, shared norm, head bias
    "gpt-neox-debug": dict(n_embd=64, intermediate_size=128),  # parallel residual, LayerNorm, biases
    "mistral-debug": dict(n_embd=64, intermediate_size=96, sliding_window=8),
}


def family_config(name: str) -> Config:
    return Config.from_name(name, **{"block_size": 32, "vocab_size": 256, **FAMILIES[name]})


def resolve_plan(world_size: int, *, tp: int = 1, sequence_parallel: Optional[bool] = None, num_nodes: int = 1,
                 fsdp: Optional[FSDPArgs] = None, **split) -> ParallelPlan:
    """The plan a recipe would resolve from --devices, --num_nodes, --tp_size and --tp_sequence_parallel (``split``:
    ``ep``, ``pp`` as --ep_size, --pp_size)."""
    train = TrainArgs(global_batch_size=GLOBAL_BATCH, micro_batch_size=1, max_steps=MAX_STEPS, lr_warmup_steps=2,
                      max_norm=1.0)
    return ParallelPlan.resolve(devices=world_size // num_nodes, num_nodes=num_nodes, train=train,
                                precision="32-true", fsdp=fsdp, accelerator="cpu", tp=tp,
                                sequence_parallel=sequence_parallel, **split)


def build(plan: ParallelPlan, config: Config) -> tuple[torch.nn.Module, Runtime]:
    """This rank's runtime, and the model: meta → parallelize → materialize, as a recipe builds it."""
    runtime = Runtime.for_plan(plan, timeout_s=dist_worker.COLLECTIVE_TIMEOUT_S)
    plan.check_model(config, SEQ_LEN)
    with torch.device("meta"):
        model = GPT(config)
    model.max_seq_length = SEQ_LEN
    model = parallelize(model, plan, device=runtime.device)
    materialize(model, runtime.device, dist_worker.SEED)
    return model, runtime


def train(world_size: int = 1, *, out_dir: Optional[Path] = None, checkpoint_format: str = "sharded",
          resume_from: Optional[Path] = None, config: Optional[Config] = None,
          report: Optional[Callable[[torch.nn.Module], dict]] = None, **layout) -> dict:
    """8 AdamW steps of dist_worker's tiny model (or ``config``) with fit() on the given layout; the losses and final
    weights, and what ``report`` says of the trained model.

    With ``out_dir`` a checkpoint of ``checkpoint_format`` every 4 steps; ``resume_from`` loads one first.
    """
    plan = resolve_plan(world_size, **layout)
    config = config or dist_worker.tiny_config()
    model, runtime = build(plan, config)
    # The recipes' optimizer: fused AdamW, one kernel over every parameter, which needs them all DTensors alike.
    optimizer = build_optimizer(functools.partial(torch.optim.AdamW, lr=5e-3, weight_decay=0.1), model.parameters())
    loader = ListLoader(dist_worker.make_samples(), 1, runtime.data_parallel_rank, runtime.data_parallel_size)
    train_args = TrainArgs(global_batch_size=GLOBAL_BATCH, micro_batch_size=1, max_steps=MAX_STEPS,
                           lr_warmup_steps=2, save_interval=dist_worker.SAVE_INTERVAL if out_dir else None,
                           max_norm=1.0)
    checkpointer = build_checkpointer(checkpoint_format, out_dir=Path(out_dir or "."), runtime=runtime, model=model,
                                      optimizer=optimizer, train_loader=loader, model_config=config, tokenizer=None,
                                      hyperparameters={"test": True})
    state = TrainState()
    if resume_from is not None:
        checkpointer.load(resume_from, state)
    recorder = dist_worker.Recorder()
    fit(Fit(runtime=runtime, model=model, optimizer=optimizer, train_loader=loader, val_loader=None, config=config,
            train=train_args,
            eval=EvalArgs(initial_validation=False, final_validation=False), plan=plan.batch,
            horizon=plan_horizon(train_args, GLOBAL_BATCH * SEQ_LEN, None), precision=Precision("32-true"),
            save_checkpoint=checkpointer.save if out_dir else lambda s: None,
            save_final=checkpointer.save_final if out_dir else lambda s: None,
            loggers=[recorder], state=state, grad_sync_only_last=plan.grad_sync_only_last))
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "mesh": plan.describe_mesh(),
            "weights": gather_full_model_state(model), **(report(model) if report else {})}


def gradients(world_size: int = 1, *, name: str, **layout) -> dict:
    """One forward and backward of a zoo family on a fixed batch: the loss, every gathered gradient, the logits."""
    from torch.distributed.tensor import DTensor

    plan = resolve_plan(world_size, **layout)
    model, _ = build(plan, family_config(name))
    samples = dist_worker.make_samples(count=2)
    input_ids = torch.stack([s[0] for s in samples])
    labels = torch.stack([s[1] for s in samples])
    loss = model(input_ids, labels=labels)
    loss.backward()
    grads = {param_name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for param_name, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(input_ids)
        eval_loss = model(input_ids, labels=labels)
    return {"loss": loss.detach(), "eval_loss": eval_loss, "grads": grads, "logits": logits}


# ------------------------------------------------------------------------------------ suites
def suite_two(runtime: Runtime, workdir: Path) -> dict:
    results = {"sp": train(2, tp=2), "no_sp": train(2, tp=2, sequence_parallel=False),
               "sp_checkpointed": train(2, tp=2, fsdp=FSDPArgs(activation_checkpointing=True)),
               # Per-op checkpointing keeps the collectives' outputs: backward must not run them again.
               "sp_op_checkpointed": train(2, tp=2, fsdp=FSDPArgs(activation_checkpointing="op"))}
    for name in FAMILIES:
        results[name] = gradients(2, name=name, tp=2)
    results["llama-debug no_sp"] = gradients(2, name="llama-debug", tp=2, sequence_parallel=False)
    return results


def suite_four(runtime: Runtime, workdir: Path) -> dict:
    return {
        "dp2_tp2": train(4, tp=2, out_dir=workdir / "dp2_tp2"),
        "dp2_tp2_full": train(4, tp=2, out_dir=workdir / "dp2_tp2_full", checkpoint_format="full"),
        "dp4_resume": train(4, resume_from=workdir / "dp2_tp2" / "step-00000004"),
        # 2 "nodes" of 2 under HYBRID_SHARD: replicate 2 × shard 1 × tensor 2, a 3-D mesh on 4 ranks
        "hsdp_tp": train(4, tp=2, num_nodes=2),
    }


SUITES = {"two": suite_two, "four": suite_four}
WORLD_SIZES = {"two": 2, "four": 4}

if __name__ == "__main__":
    dist_worker.worker_main(sys.argv[1], Path(sys.argv[2]), suites=SUITES, world_sizes=WORLD_SIZES)
