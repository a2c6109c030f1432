"""Interleaved A/B inside one process: the whole model's forward and backward with one code path against another.

    .venv/bin/python bench/ab/step_ab.py attention_dtype --model llama-20m --seq_len 256 --micro_batch_size 8
    .venv/bin/python bench/ab/step_ab.py lora_update --model llama-debug --precision 32-true
    .venv/bin/python bench/ab/step_ab.py compile --model llama-debug --precision bf16-true

Experiments (A against B):
- ``attention_dtype``: a bfloat16 model's training attention in bfloat16 against float32, the rule of
  ``llmtrain.model.attention_dtype`` (A turns the rule off, B applies it at --seq_len).
- ``lora_update``: LoRA (rank 8, alpha 16, no dropout, on q and v) with the update computed as a separate matmul,
  scaling and add (A, what ``LoRALinear`` did before) against one addmm onto the base output (B, what it does).
- ``compile``: eager (A) against ``--compile`` (B: ``parallelize.apply_compile``, each Block compiled).
- ``compile_whole``: each Block compiled (A, what ``--compile`` does) against the whole GPT compiled as one graph,
  its loss included (B, what LitGPT does).
- ``rms_norm``: RMSNorm differentiated by autograd through its composite of torch operators (A, what ``RMSNorm`` did
  before) against its backward written out (B, ``llmtrain.model._RMSNormFunction``).
- ``block_attention``: training attention through SDPA (A, CPU flash attention) against block-causal batched
  matmuls (B, ``llmtrain.attention``), at --seq_len whatever the rule of ``llmtrain.model.attention_kernel`` says
  (B still needs float32 attention and enough stacked query rows, or a bfloat16 model on a CPU with AMX tiles).
- ``bf16_block_attention``: a bfloat16 model's training attention as float32 block attention on an upcast copy (A,
  the rule for AVX512-BF16 CPUs without AMX before 91bce34) against bfloat16 block attention with float32 scores and
  softmax (B, the rule now), up to ``max(--seq_len, 512)`` tokens.
- ``fused_projections``: each projection of a Block its own module and GEMM (A) against one GEMM per shared input,
  q/k/v with RoPE and block attention and gate/up with the activation written out (B, ``llmtrain.fused``), where
  the rule picks block attention.
- ``block_kernel``: block attention as ``llmtrain/attention.py`` was at git revision ``--rev`` (A) against the
  working tree's (B), where the rule picks block attention.
- ``loss_kernel``: the loss (``head_loss_sum``) as ``llmtrain/loss.py`` was at ``--rev`` (A) against the working
  tree's (B).

Each of ``--pairs`` pairs times two steps of A and two of B, in alternating order, so that a drift in the machine's
speed hits both; prints the medians and A / B. The model and its loss are the recipes' (``GPT(..., labels=...)``,
the fused loss) with random weights and tokens. Finer-grained than ``bench/ab/ab.py``, which runs whole benchmarks:
on this shared machine a run's speed drifts by up to 10%, more than the changes measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def attention_dtype_sides(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    from llmtrain import model as model_module

    model_module.CPU_MEASURED_FOR_FLOAT32_ATTENTION = True  # B applies the rule on any CPU, to measure it there

    def native() -> None:
        model_module.CPU_FLOAT32_ATTENTION_MAX_SEQ = 0

    def upcast() -> None:
        model_module.CPU_FLOAT32_ATTENTION_MAX_SEQ = args.seq_len

    return {"attention in bfloat16": native, "attention in float32": upcast}


def lora_update_sides(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    import torch.nn.functional as F

    from llmtrain.lora import LoRALinear

    fused = LoRALinear.forward

    def separate_forward(self: LoRALinear, x):
        out = self.base(x)
        hidden = F.linear(self.dropout(x.to(self.lora_A.dtype)), self.lora_A)
        update = F.linear(hidden, self.lora_B) * self.scaling
        return out + update.to(out.dtype)

    def separate() -> None:
        LoRALinear.forward = separate_forward

    def one_addmm() -> None:
        LoRALinear.forward = fused

    return {"separate update": separate, "one addmm": one_addmm}


def compile_sides(args: argparse.Namespace, model) -> dict[str, Callable[[], None]]:
    from llmtrain.distributed.parallelize import apply_compile
    from llmtrain.model import transformer_blocks

    apply_compile(model)
    blocks = {block: block._compiled_call_impl for block in transformer_blocks(model)}

    def eager() -> None:
        for block in blocks:
            block._compiled_call_impl = None

    def compiled() -> None:
        for block, call in blocks.items():
            block._compiled_call_impl = call

    return {"eager": eager, "each Block compiled": compiled}


def compile_whole_sides(args: argparse.Namespace, model, call: dict) -> dict[str, Callable[[], None]]:
    import torch

    from llmtrain.distributed.parallelize import apply_compile
    from llmtrain.model import transformer_blocks

    apply_compile(model)
    blocks = {block: block._compiled_call_impl for block in transformer_blocks(model)}
    whole = torch.compile(model)

    def each_block() -> None:
        for block, compiled in blocks.items():
            block._compiled_call_impl = compiled
        call["model"] = model

    def one_graph() -> None:
        for block in blocks:  # traced inside the whole model's graph instead
            block._compiled_call_impl = None
        call["model"] = whole

    return {"each Block compiled": each_block, "the whole model compiled": one_graph}


def block_attention_sides(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    from llmtrain import model as model_module

    import torch

    model_module.CPU_MEASURED_FOR_BLOCK_ATTENTION = True  # B applies the rule on any CPU, to measure it there
    longest = model_module.CPU_BLOCK_ATTENTION_MAX_SEQ
    if args.precision == "bf16-true" and torch.cpu._is_amx_tile_supported():
        model_module.CPU_MEASURED_FOR_BF16_BLOCK_ATTENTION = True  # bfloat16 blocks, as on this CPU

    def flash() -> None:
        model_module.CPU_BLOCK_ATTENTION_MAX_SEQ = model_module.CPU_BF16_BLOCK_ATTENTION_MAX_SEQ = 0

    def blocks() -> None:
        model_module.CPU_BLOCK_ATTENTION_MAX_SEQ = max(longest, args.seq_len)
        model_module.CPU_BF16_BLOCK_ATTENTION_MAX_SEQ = args.seq_len

    return {"SDPA (flash)": flash, "block attention": blocks}


def bf16_block_attention_sides(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    from llmtrain import model as model_module

    longest = max(args.seq_len, model_module.CPU_BF16_BLOCK_ATTENTION_MAX_SEQ)

    def upcast() -> None:
        model_module.CPU_MEASURED_FOR_FLOAT32_ATTENTION = True
        model_module.CPU_MEASURED_FOR_BF16_BLOCK_ATTENTION = False

    def bf16_blocks() -> None:
        model_module.CPU_MEASURED_FOR_BF16_BLOCK_ATTENTION = True
        model_module.CPU_BF16_BLOCK_ATTENTION_MAX_SEQ = longest

    return {"float32 blocks on an upcast copy": upcast, "bfloat16 blocks": bf16_blocks}


def rms_norm_sides(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    from llmtrain.model import RMSNorm, rms_norm_composite

    written_out = RMSNorm.forward

    def composite_forward(self: RMSNorm, x):
        return rms_norm_composite(x, self.weight, self.eps, self.unit_offset)

    def composite() -> None:
        RMSNorm.forward = composite_forward

    def backward_written_out() -> None:
        RMSNorm.forward = written_out

    return {"autograd through the composite": composite, "backward written out": backward_written_out}


def module_at_revision(rev: str, path: str):
    """The module in file ``path`` as it was at git revision ``rev``, loaded beside the working tree's."""
    import subprocess
    import types

    root = Path(__file__).resolve().parents[2]
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, check=True, capture_output=True,
                            text=True).stdout
    name = f"{Path(path).stem}_at_{rev}".replace("~", "_").replace("^", "_")
    before = types.ModuleType(name)
    sys.modules[name] = before  # where torch.compile looks its functions up
    exec(compile(source, f"{rev}:{path}", "exec"), before.__dict__)
    return before


def revision_sides(rev: str, path: str, names: dict[str, list[str]], label: str) -> dict[str, Callable[[], None]]:
    """Sides that point each module's (key of ``names``) names at the functions of those names in ``path`` at
    ``rev`` (A) and back at the working tree's (B)."""
    import importlib

    before = module_at_revision(rev, path)
    modules = {importlib.import_module(module): attrs for module, attrs in names.items()}
    now = {(module, name): getattr(module, name) for module, attrs in modules.items() for name in attrs}

    def old() -> None:
        for module, name in now:
            setattr(module, name, getattr(before, name))

    def new() -> None:
        for (module, name), function in now.items():
            setattr(module, name, function)

    return {f"{label} at {rev}": old, f"{label} now": new}


def block_kernel_sides(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    # The modules' path calls block_causal_attention, the fused q/k/v path attend_blocks and its backward.
    names = {"llmtrain.model": ["block_causal_attention"], "llmtrain.fused": ["attend_blocks", "attend_blocks_backward"]}
    return revision_sides(args.rev, "llmtrain/attention.py", names, "block attention")


def loss_kernel_sides(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    return revision_sides(args.rev, "llmtrain/loss.py", {"llmtrain.model": ["head_loss_sum"]}, "the loss")


def fused_projections_sides(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    from llmtrain import fused
    from llmtrain import model as model_module

    def separate() -> None:
        model_module.fusable = lambda *_: False

    def stacked() -> None:
        model_module.fusable = fused.fusable

    return {"one GEMM per projection": separate, "one GEMM per shared input": stacked}


EXPERIMENTS = {"attention_dtype": attention_dtype_sides, "lora_update": lora_update_sides,
               "compile": compile_sides, "compile_whole": compile_whole_sides,
               "block_attention": block_attention_sides, "rms_norm": rms_norm_sides, "block_kernel": block_kernel_sides, "loss_kernel": loss_kernel_sides,
               "fused_projections": fused_projections_sides, "bf16_block_attention": bf16_block_attention_sides}


def random_model(name: str, precision: str, threads: int):
    """The zoo's model ``name`` with the recipes' init (seed 0) in ``precision``'s dtype, in a process set up as
    training sets it up on the CPU: ``threads`` threads, freed host memory kept for reuse."""
    import torch

    from llmtrain.config import Config
    from llmtrain.distributed.host_memory import keep_freed_host_memory
    from llmtrain.model import GPT

    torch.set_num_threads(threads)
    keep_freed_host_memory()
    torch.manual_seed(0)
    model = GPT(Config.from_name(name))
    model.init_weights()
    return model.to(torch.bfloat16 if precision == "bf16-true" else torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=sorted(EXPERIMENTS))
    parser.add_argument("--model", default="llama-debug")
    parser.add_argument("--precision", default="bf16-true", choices=("32-true", "bf16-true"))
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true",
                        help="compile each Block (as --compile does) for both sides; not with the compile experiments")
    parser.add_argument("--rev", default="HEAD",
                        help="block_kernel, loss_kernel: the git revision of side A's llmtrain/attention.py or loss.py")
    args = parser.parse_args()
    if args.experiment in ("attention_dtype", "bf16_block_attention") and args.precision != "bf16-true":
        parser.error(f"{args.experiment} compares the attention of a bfloat16 model: use --precision bf16-true")

    import torch

    from llmtrain.lora import LoRAArgs, apply_lora, mark_only_lora_trainable

    model = random_model(args.model, args.precision, args.threads)
    if args.experiment == "lora_update":
        apply_lora(model, LoRAArgs(lora_dropout=0.0))
        mark_only_lora_trainable(model)
    model.train()
    if args.compile and not args.experiment.startswith("compile"):
        from llmtrain.distributed.parallelize import apply_compile

        apply_compile(model)
    tokens = torch.randint(0, model.config.vocab_size, (args.micro_batch_size, args.seq_len + 1))

    call = {"model": model}  # what a step calls: the model, or (compile_whole) its compiled whole

    def step() -> float:
        start = time.perf_counter()
        call["model"](tokens[:, :-1], labels=tokens[:, 1:]).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    experiment = EXPERIMENTS[args.experiment]
    if args.experiment == "compile_whole":
        sides = experiment(args, model, call)
    else:
        sides = experiment(args, model) if args.experiment == "compile" else experiment(args)
    times: dict[str, list[float]] = {side: [] for side in sides}
    for side in sides.values():  # warm-up (and compilation)
        side()
        step()
        step()
    for pair in range(args.pairs):
        for side in (list(sides) if pair % 2 else list(reversed(sides))):
            sides[side]()
            times[side].extend(step() for _ in range(2))
    medians = {side: statistics.median(values) * 1e3 for side, values in times.items()}
    (a, a_ms), (b, b_ms) = medians.items()
    print(f"{args.experiment}: {args.model} {args.precision}{', compiled' if args.compile else ''}, micro batch {args.micro_batch_size} x {args.seq_len}, "
          f"{args.pairs} pairs, {args.threads} threads: step medians A ({a}) {a_ms:.1f} ms, B ({b}) {b_ms:.1f} ms; "
          f"A / B = {a_ms / b_ms:.3f}")


if __name__ == "__main__":
    main()
