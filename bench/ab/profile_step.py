"""Where a training step's time goes: per phase (data, forward, backward, optimizer) and per operator.

    .venv/bin/python bench/ab/profile_step.py --model llama-debug --precision 32-true [--compile] [--steps 3 --warmup 3]
        [--recipe pretrain|finetune_lora|finetune_full]

Runs the recipe exactly as ``llmtrain benchmark`` does (built-in corpus, micro batch 8 x 256 by default,
no validation; fine-tuning from a random model directory, LoRA with finetune_lora's default adapters without dropout unless --lora_dropout) with ``--profile`` over ``--steps`` steps after ``--warmup``, then reads rank 0's Chrome trace:

- phases: the loop labels them (``llmtrain.train.step.PHASES``); "other" is the rest of the step (logging, the
  schedule, the profiler's step marker). Milliseconds per step.
- operators: each operator's self time (its time minus that of the operators it called), summed per name and
  per group (matmul, attention, elementwise, ...), in milliseconds per step and as a share of the step.

Prints Markdown tables and, with ``--json FILE``, appends one record with every number.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Operator names -> group, first match wins (substrings of the aten name).
GROUPS = (
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")),
    ("optimizer", ("_fused_adam", "_foreach_", "adamw")),
    ("loss", ("log_softmax", "nll_loss", "logsumexp", "cross_entropy")),
    ("copies and casts", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat",
                          "aten::index", "aten::embedding", "aten::stack")),
    ("allocation and fills", ("aten::empty", "aten::zeros", "aten::zero_", "aten::fill_", "aten::ones", "aten::full",
                              "aten::resize_")),
    ("reductions", ("aten::sum", "aten::mean", "aten::norm", "aten::linalg_vector_norm", "aten::max", "aten::amax")),
)


def group_of(name: str) -> str:
    for group, needles in GROUPS:
        if any(needle in name for needle in needles):
            return group
    if name.startswith("aten::"):
        return "elementwise and views"
    return "other (autograd, profiler, Python)"


def parse_trace(path: Path, steps: int) -> dict:
    """Phase times and operator self times per step from a Chrome trace of ``steps`` steps."""
    from llmtrain.train.step import PHASES

    labels = {label: phase for phase, label in PHASES.items()}
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    step_marks = [e for e in spans if e["name"].startswith("ProfilerStep#")]
    window = (sum(e["dur"] for e in step_marks) if step_marks else
              max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans))
    phase_time = collections.Counter()
    op_self = collections.Counter()
    op_phase = collections.defaultdict(collections.Counter)
    by_thread = collections.defaultdict(list)
    for event in spans:
        by_thread[(event["pid"], event["tid"])].append(event)
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, children's time, phase]
        for event in thread_events + [None]:
            while stack and (event is None or event["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]):
                done, children, phase = stack.pop()
                if done["cat"] == "cpu_op":
                    op_self[done["name"]] += done["dur"] - children
                    op_phase[done["name"]][phase] += done["dur"] - children
                if stack and done["cat"] == "cpu_op":
                    stack[-1][1] += done["dur"]
                elif stack and done["cat"] == "user_annotation" and stack[-1][0]["cat"] == "cpu_op":
                    stack[-1][1] += done["dur"]
            if event is None:
                break
            phase = stack[-1][2] if stack else "other"
            if event["cat"] == "user_annotation" and event["name"] in labels:
                phase = labels[event["name"]]
                if not any(frame[0]["name"] in labels for frame in stack):  # outermost label only
                    phase_time[phase] += event["dur"]
            stack.append([event, 0, phase])
    def ms(microseconds: float) -> float:  # in the window -> per step
        return microseconds / 1e3 / steps

    step_ms = ms(window)
    phases = {phase: ms(phase_time[phase]) for phase in PHASES}
    phases["other"] = step_ms - sum(phases.values())
    groups = collections.Counter()
    for name, self_us in op_self.items():
        groups[group_of(name)] += self_us
    # On a GPU: the device's busy time (kernels, copies, fills) against the step, the launches per step, and the
    # runtime calls that make the host wait (synchronizations, device-to-host copies).
    device_events = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = collections.Counter(e["name"] for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime")
    device = {}
    if device_events:
        kernels = collections.Counter()
        for event in device_events:
            kernels[event["name"][:90]] += event["dur"]
        device = {"device_busy_ms": ms(sum(kernels.values())), "launches_per_step": len(device_events) / steps,
                  "host_waits_per_step": sum(count for name, count in runtime.items()
                                             if "Synchronize" in name or name.startswith("cudaMemcpy")) / steps,
                  "device_kernels_ms": {name: ms(us) for name, us in kernels.most_common(12)}}
    return {
        **device,
        "step_ms": step_ms,
        "phases_ms": phases,
        "groups_ms": {group: ms(us) for group, us in groups.most_common()},
        "operators_ms": {name: ms(us) for name, us in op_self.most_common(25)},
        "operator_phases_ms": {name: {phase: ms(us) for phase, us in op_phase[name].items()}
                               for name, _ in op_self.most_common(25)},
    }


def print_tables(result: dict) -> None:
    step = result["step_ms"]
    print(f"\nstep: {step:.1f} ms (the profiled steps' median is in the benchmark; the profiler adds its own overhead)")
    if "device_busy_ms" in result:
        print(f"device busy {result['device_busy_ms']:.1f} ms per step ({result['device_busy_ms'] / step:.0%}), "
              f"{result['launches_per_step']:.0f} launches and {result['host_waits_per_step']:.0f} host waits per step")
        print("\n| device kernel | ms per step |\n| --- | --- |")
        for name, ms in result["device_kernels_ms"].items():
            print(f"| `{name}` | {ms:.2f} |")
    print("\n| phase | ms per step | share |\n| --- | --- | --- |")
    for phase, ms in result["phases_ms"].items():
        print(f"| {phase} | {ms:.1f} | {ms / step:.1%} |")
    print("\n| operator group (self time) | ms per step | share |\n| --- | --- | --- |")
    for group, ms in result["groups_ms"].items():
        print(f"| {group} | {ms:.1f} | {ms / step:.1%} |")
    print("\n| operator (self time) | ms per step | share | by phase |\n| --- | --- | --- | --- |")
    for name, ms in list(result["operators_ms"].items())[:15]:
        phases = ", ".join(f"{phase} {value:.1f}" for phase, value in
                           sorted(result["operator_phases_ms"][name].items(), key=lambda item: -item[1]) if value >= 0.05)
        print(f"| `{name}` | {ms:.1f} | {ms / step:.1%} | {phases} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-debug")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the profiled ones")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--recipe", default="pretrain", choices=("pretrain", "finetune_lora", "finetune_full"))
    parser.add_argument("--lora_dropout", type=float, default=0.0,
                        help="finetune_lora's adapter dropout (0 as in bench/peers/finetune_compare.sh)")
    parser.add_argument("--json", type=Path, help="append the record to this JSON-lines file")
    args = parser.parse_args()
    if args.lora_dropout and args.recipe != "finetune_lora":
        parser.error("--lora_dropout sets finetune_lora's adapters: drop it or use --recipe finetune_lora")

    from llmtrain.args import FSDPArgs, ProfileArgs
    from llmtrain.benchmark.machine import git_commit
    from llmtrain.benchmark.training import _train, _train_args
    from llmtrain.distributed.parallel_plan import ParallelPlan
    from llmtrain.lora import LoRAArgs

    train = _train_args(args.micro_batch_size, args.micro_batch_size, args.seq_len, args.warmup + args.steps, None)
    plan = ParallelPlan.resolve(devices=1, num_nodes=1, train=train, precision=args.precision)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        _train(run_dir, model=args.model, plan=plan, fsdp=FSDPArgs(), train=train, compile=args.compile,
               recipe=args.recipe, lora=LoRAArgs(lora_dropout=args.lora_dropout),
               profile=ProfileArgs(start_step=args.warmup + 1, end_step=args.warmup + args.steps, memory=False))
        result = parse_trace(run_dir / "train" / "profile" / "rank0.json", args.steps)
    result.update(recipe=args.recipe, model=args.model, precision=args.precision, micro_batch_size=args.micro_batch_size,
                  seq_len=args.seq_len, compile=args.compile, steps=args.steps, warmup=args.warmup,
                  commit=git_commit(), command="bench/ab/profile_step.py " + " ".join(sys.argv[1:]))
    print_tables(result)
    if args.json:
        with open(args.json, "a") as handle:
            handle.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
