"""llmtrain, LitGPT and transformers' Trainer side by side: tokens/s, MFU and peak memory, in interleaved rounds.

    # on a GPU (the workloads of issue 46):
    python bench/peers/side_by_side.py --rounds 3 --steps 20 --warmup 5 \
        --litgpt_python /work/peers/litgpt-venv/bin/python --hf_python /work/peers/hf-venv/bin/python
    # here, on tiny shapes (about a minute on 2 cores without the compiled workload):
    python bench/peers/side_by_side.py --cpu --rounds 1 --steps 2 --warmup 1

The workloads, the same model, data shape, batch and precision for every tool (``--workloads`` picks some):
- ``pretrain``, ``pretrain-compiled``: TinyLlama-1.1B's shape (llmtrain's zoo ``tiny-llama-1.1b``) from random
  init, bf16-true, micro batch 4 × 2,048, eager and compiled (llmtrain ``--compile true``, LitGPT
  ``torch.compile(model)`` as ``litgpt pretrain`` does, the Trainer's ``torch_compile``);
- ``lora``: LoRA r 8, alpha 16, no dropout on the query and value projections of Llama-3.2-1B's shape, bf16-true,
  4 × 2,048 (the adapters of finetune_compare.sh);
- ``qlora``: the same with the frozen base in bitsandbytes nf4 (llmtrain and LitGPT ``--quantize bnb.nf4``, the
  Trainer through ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` and peft).
With ``--cpu``: the same four on llmtrain's ``llama-debug``, bf16-true, 2 × 64 tokens.

Round r runs every tool once on every workload before round r + 1 starts (the tools' order rotates each round),
each as a subprocess of its own interpreter: ``llmtrain benchmark`` under ``--llmtrain_python`` (with this
repository first on PYTHONPATH, so the tree's llmtrain is the one timed), ``litgpt_bench.py`` under
``--litgpt_python`` and ``hf_trainer_bench.py`` under ``--hf_python``. A tool whose interpreter is missing or lacks
a package a workload needs is a "not installed" row with the way to install it; a run that fails is a "failed" row
with its log's path (``OUT_DIR/logs``). Nothing is dropped from the table.

MFU: llmtrain's record has its own (its model FLOPs per token, llmtrain.flops, over the matmul peak it measured on
this device in the run's dtype); a peer's is the same FLOPs per token times the peer's tokens/s over that same
peak (the median of llmtrain's over the rounds; measured here when llmtrain has no record), so the column compares
tools on one scale. Peak memory: torch.cuda.max_memory_allocated on a GPU, the process's peak RSS on a CPU (which
counts the interpreter and its imports too). Every run's record, with its workload, round and the header (device,
driver, torch, commit, command), is appended to ``--results``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOOLS = ("llmtrain", "litgpt", "transformers.Trainer")
LORA_FLAGS = dict(lora_r=8, lora_alpha=16, lora_dropout=0.0, targets=("query", "value"))
DEFAULT_PEERS = {"litgpt": Path("/work/peers/litgpt-venv/bin/python"), "transformers.Trainer":
                 Path("/work/peers/hf-venv/bin/python")}
HOW_TO_INSTALL = {  # bench/peers/README.md has the venvs
    "llmtrain": "pip install -e . (and bitsandbytes for qlora) in that interpreter",
    "litgpt": "python3 -m venv /work/peers/litgpt-venv && /work/peers/litgpt-venv/bin/pip install -c "
              "constraints.txt torch litgpt==0.5.13 (+ bitsandbytes for qlora; bench/peers/README.md)",
    "transformers.Trainer": "python3 -m venv /work/peers/hf-venv && /work/peers/hf-venv/bin/pip install -c "
                            "constraints.txt torch transformers accelerate (+ peft for lora, peft bitsandbytes for "
                            "qlora; bench/peers/README.md)",
}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    model: str  # llmtrain's zoo name; the peers get its shape
    recipe: str  # pretrain or finetune_lora
    precision: str
    micro_batch_size: int
    seq_len: int
    compile: bool = False
    quantize: Optional[str] = None

    def modules(self, tool: str) -> list[str]:
        """The packages ``tool`` needs for this workload (checked without importing them)."""
        needed = {"llmtrain": ["llmtrain", "torch"], "litgpt": ["litgpt", "lightning"],
                  "transformers.Trainer": ["transformers", "accelerate"]}[tool]
        if tool == "transformers.Trainer" and self.recipe == "finetune_lora":
            needed.append("peft")
        return needed + (["bitsandbytes"] if self.quantize else [])


WORKLOAD_NAMES = ("pretrain", "pretrain-compiled", "lora", "qlora")


def workloads(cpu: bool, names: list[str]) -> list[Workload]:
    """The named workloads at the GPU's shapes of issue 46, or the tiny ones of ``--cpu``."""
    pretrain_model, lora_model = ("llama-debug", "llama-debug") if cpu else ("tiny-llama-1.1b", "Llama-3.2-1B")
    micro, seq = (2, 64) if cpu else (4, 2048)
    every = {
        "pretrain": Workload("pretrain", pretrain_model, "pretrain", "bf16-true", micro, seq),
        "pretrain-compiled": Workload("pretrain-compiled", pretrain_model, "pretrain", "bf16-true", micro, seq,
                                      compile=True),
        "lora": Workload("lora", lora_model, "finetune_lora", "bf16-true", micro, seq),
        "qlora": Workload("qlora", lora_model, "finetune_lora", "bf16-true", micro, seq, quantize="bnb.nf4"),
    }
    return [every[name] for name in names]


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    out_dir = Path(args.out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    results = Path(args.results) if args.results else out_dir / "records.jsonl"
    results.parent.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.cpu else "cuda"
    chosen = workloads(args.cpu, args.workloads)
    header = machine_header(device, argv)
    for key, value in header.items():
        print(f"{key:<10} {value}")
    pythons = {"llmtrain": args.llmtrain_python, "litgpt": args.litgpt_python, "transformers.Trainer": args.hf_python}
    shapes = write_shapes(chosen, out_dir / "shapes")
    missing = {(tool, work.name): cannot_run(tool, work, device) or not_installed(tool, pythons[tool], work)
               for tool in TOOLS for work in chosen}
    runs: dict[tuple[str, str], list] = {key: [] for key in missing}  # (tool, workload) -> records or failures
    for round_ in range(1, args.rounds + 1):
        order = TOOLS[(round_ - 1) % 3:] + TOOLS[:(round_ - 1) % 3]
        for work in chosen:
            for tool in order:
                if missing[(tool, work.name)]:
                    continue
                print(f"round {round_}: {work.name}, {tool}", flush=True)
                outcome = run_tool(tool, pythons[tool], work, shapes[work.model], args, device, out_dir, round_)
                if isinstance(outcome, dict):
                    outcome.update(tool=tool, workload=work.name, round=round_, side_by_side=header)
                    with open(results, "a") as handle:
                        handle.write(json.dumps(outcome) + "\n")
                runs[(tool, work.name)].append(outcome)
    print()
    print(table(chosen, runs, missing, device))
    print(f"\nrecords: {results}; logs: {out_dir / 'logs'}")
    return 0


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (llama-debug, 2 × 64)")
    parser.add_argument("--workloads", default=",".join(WORKLOAD_NAMES),
                        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
                        help=f"comma-separated, of {', '.join(WORKLOAD_NAMES)} (default: all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of every run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--llmtrain_python", default=sys.executable)
    parser.add_argument("--litgpt_python", default=str(DEFAULT_PEERS["litgpt"]))
    parser.add_argument("--hf_python", default=str(DEFAULT_PEERS["transformers.Trainer"]))
    parser.add_argument("--out_dir", default="out/side_by_side", help="logs, the peers' shapes, records")
    parser.add_argument("--results", help="JSON-lines file the records are appended to (default OUT_DIR/records.jsonl)")
    parser.add_argument("--timeout_s", type=float, default=1200, help="one run's limit")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.workloads) - set(WORKLOAD_NAMES))
    if unknown or not args.workloads:
        parser.error(f"--workloads: name one or more of {', '.join(WORKLOAD_NAMES)}, got {unknown or 'none'}")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--rounds and --steps must be at least 1, --warmup at least 0")
    return args


def machine_header(device: str, argv: Optional[list[str]]) -> dict:
    """What the numbers were measured on: the card and its driver (nvidia-smi) or the CPU, torch, the commit, time."""
    import torch

    from llmtrain.benchmark.machine import device_name, git_commit

    card = device_name("cpu") if device == "cpu" else torch.cuda.get_device_name()
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
            card += f" | nvidia-smi: {'; '.join(smi)}" if smi else ""
        except (OSError, subprocess.SubprocessError):
            pass
    command = shlex.join([sys.executable, str(Path(__file__).relative_to(ROOT)),
                          *(sys.argv[1:] if argv is None else argv)])
    return {"device": card, "torch": f"{torch.__version__} (cuda {torch.version.cuda})", "commit": git_commit(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command}


def write_shapes(chosen: list[Workload], folder: Path) -> dict[str, Path]:
    """Each model's shape for the peers: ``NAME/config.json`` (transformers, hf_config.py's) and ``NAME.json``
    (llmtrain's Config fields, which litgpt_bench.py gives LitGPT's Config where it has them)."""
    from llmtrain.config import Config
    from llmtrain.convert.adapters import adapter_for_config

    shapes = {}
    for name in sorted({work.model for work in chosen}):
        config = Config.from_name(name)
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "config.json").write_text(json.dumps(adapter_for_config(config).hf_config(config), indent=2))
        fields = {key: value for key, value in dataclasses.asdict(config).items()
                  if isinstance(value, (int, float, str, bool, type(None), dict, list))}
        (folder / f"{name}.json").write_text(json.dumps(fields, indent=2))
        shapes[name] = folder / name
    return shapes


def cannot_run(tool: str, work: Workload, device: str) -> str:
    """Why ``tool`` cannot run ``work`` on ``device`` at all, whatever is installed (empty when it can)."""
    if tool == "litgpt" and work.quantize and device == "cpu":
        return ("not on a CPU: LitGPT's --quantize is Lightning's BitsandbytesPrecision, which raises \"Bitsandbytes "
                "is only supported on CUDA GPUs\"")
    return ""


def not_installed(tool: str, python: str, work: Workload) -> str:
    """Empty when ``python`` exists and finds every package ``tool`` needs for ``work``; else why and how."""
    if not Path(python).exists():
        return f"not installed: no interpreter {python}; {HOW_TO_INSTALL[tool]}"
    probe = ("import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] "
             "if importlib.util.find_spec(m) is None))")
    done = subprocess.run([python, "-c", probe, *work.modules(tool)], capture_output=True, text=True,
                          env=tool_env(tool), timeout=120)
    lacking = done.stdout.split() if done.returncode == 0 else ["(the interpreter failed: " + done.stderr[-200:] + ")"]
    return f"not installed: {python} lacks {', '.join(lacking)}; {HOW_TO_INSTALL[tool]}" if lacking else ""


def tool_env(tool: str) -> dict:
    """llmtrain's runs import this repository's llmtrain (and its DeepSpeed extension's path), not an installed one."""
    env = dict(os.environ)
    if tool == "llmtrain":
        paths = [str(ROOT), str(ROOT / "extensions" / "deepspeed"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
    return env


def tool_command(tool: str, python: str, work: Workload, shape: Path, args: argparse.Namespace, device: str,
                 out_dir: Path, record_file: Path) -> list[str]:
    """The command line of one run of ``tool`` on ``work``, its record appended to ``record_file``."""
    sizes = ["--micro_batch_size", str(work.micro_batch_size), "--seq_len", str(work.seq_len),
             "--steps", str(args.steps), "--warmup", str(args.warmup)]
    lora = work.recipe == "finetune_lora"
    targets = LORA_FLAGS["targets"]
    if tool == "llmtrain":
        command = [python, "-m", "llmtrain", "benchmark", "--model", work.model, "--recipe", work.recipe,
                   "--precision", work.precision, *sizes, "--baseline", "null", "--results", str(record_file),
                   "--out_dir", str(out_dir / "llmtrain-runs")]
        if lora:
            command += ["--lora.lora_r", str(LORA_FLAGS["lora_r"]), "--lora.lora_alpha", str(LORA_FLAGS["lora_alpha"]),
                        "--lora.lora_dropout", str(LORA_FLAGS["lora_dropout"])]
            command += [f"--lora.lora_{name}={'true' if name in targets else 'false'}"
                        for name in ("query", "key", "value", "projection", "mlp", "head")]
        return command + (["--compile", "true"] if work.compile else []) + (
            ["--quantize", work.quantize] if work.quantize else [])
    script, model = ((HERE / "litgpt_bench.py", shape.parent / f"{shape.name}.json") if tool == "litgpt"
                     else (HERE / "hf_trainer_bench.py", shape))
    command = [python, str(script), str(model), "--precision", work.precision, *sizes, "--device", device,
               "--recipe", work.recipe, "--results", str(record_file)]
    if lora:
        command += ["--lora_r", str(LORA_FLAGS["lora_r"]), "--lora_alpha", str(LORA_FLAGS["lora_alpha"]),
                    "--lora_dropout", str(LORA_FLAGS["lora_dropout"]), "--lora_targets", ",".join(targets)]
    return command + (["--compile"] if work.compile else []) + (["--quantize", work.quantize] if work.quantize else [])


def run_tool(tool: str, python: str, work: Workload, shape: Path, args: argparse.Namespace, device: str,
             out_dir: Path, round_: int):
    """One run: its record (dict), or a "failed: ..." line naming its log."""
    slug = f"{work.name}-{tool}-round{round_}"
    log, record_file = out_dir / "logs" / f"{slug}.log", out_dir / "logs" / f"{slug}.jsonl"
    record_file.unlink(missing_ok=True)
    command = tool_command(tool, python, work, shape, args, device, out_dir, record_file)
    started = time.perf_counter()
    with open(log, "w") as handle:
        handle.write(shlex.join(command) + "\n\n")
        handle.flush()
        try:
            done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=tool_env(tool),
                                  cwd=ROOT, timeout=args.timeout_s)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = f"timed out after {args.timeout_s:g} s"
    if code != 0 or not record_file.exists():
        tail = log.read_text().strip().splitlines()[-1:] or [""]
        print(f"  failed ({code}): {tail[0][:200]} (log {log})", file=sys.stderr, flush=True)
        return f"failed ({code}): see {log}"
    record = json.loads(record_file.read_text().strip().splitlines()[-1])
    print(f"  {record.get('tokens_per_sec_per_device', record.get('tokens_per_sec')):,.0f} tokens/s "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    return record


def table(chosen: list[Workload], runs: dict, missing: dict, device: str) -> str:
    """The Markdown table: workload × tool → median tokens/s, MFU, peak memory, runs; llmtrain over the best peer."""
    lines = ["| workload | tool | tokens/s (median) | MFU | peak memory | runs | llmtrain / best peer |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    peak_cache: dict = {}
    for work in chosen:
        medians = {}
        for tool in TOOLS:
            records = [run for run in runs[(tool, work.name)] if isinstance(run, dict)]
            if records:
                medians[tool] = statistics.median(speed(record) for record in records)
        peers = {tool: value for tool, value in medians.items() if tool != "llmtrain"}
        best = max(peers, key=peers.get) if peers else None
        ratio = (f"{medians['llmtrain'] / peers[best]:.2f}x ({best})" if best and "llmtrain" in medians else "n/a")
        shape = f"{work.model} {work.precision} {work.micro_batch_size}×{work.seq_len}"
        for tool in TOOLS:
            name = f"{work.name} ({shape})"
            if missing[(tool, work.name)]:
                lines.append(f"| {name} | {tool} | {missing[(tool, work.name)]} | | | 0 | |")
                continue
            outcomes = runs[(tool, work.name)]
            records = [run for run in outcomes if isinstance(run, dict)]
            failures = [run for run in outcomes if not isinstance(run, dict)]
            if not records:
                lines.append(f"| {name} | {tool} | {failures[0] if failures else 'no run'} | | | 0 | |")
                continue
            mfu = statistics.median(mfu_of(record, work, runs, device, peak_cache) for record in records)
            memory = statistics.median(record.get("peak_memory_gb") or 0.0 for record in records)
            failed = f" ({len(failures)} failed)" if failures else ""
            lines.append(f"| {name} | {tool} | {medians[tool]:,.0f} | {mfu:.1%} | {memory:.2f} GB | "
                         f"{len(records)}{failed} | {ratio if tool == 'llmtrain' else ''} |")
    return "\n".join(lines)


def speed(record: dict) -> float:
    return record.get("tokens_per_sec_per_device", record.get("tokens_per_sec"))


def mfu_of(record: dict, work: Workload, runs: dict, device: str, peak_cache: dict) -> float:
    """A record's MFU: its own (llmtrain's), else llmtrain's FLOPs per token for the workload times its tokens/s over
    the workload's matmul peak (llmtrain's median; measured here without one)."""
    if record.get("mfu") is not None:
        return record["mfu"]
    ours = [run for run in runs[("llmtrain", work.name)] if isinstance(run, dict)]
    flops = ours[0]["flops_per_token"] if ours else workload_flops(work)
    if ours:
        peak = statistics.median(run["matmul_peak_flops"] for run in ours)
    else:
        if work.precision not in peak_cache:
            import torch

            from llmtrain.flops import measure_matmul_peak

            dtype = torch.bfloat16 if work.precision.startswith("bf16") else torch.float32
            peak_cache[work.precision] = measure_matmul_peak(dtype, device=device)[0]
        peak = peak_cache[work.precision]
    return flops * speed(record) / peak


def workload_flops(work: Workload) -> float:
    """llmtrain's model FLOPs per token for the workload (the adapters' parameters under LoRA)."""
    from llmtrain.config import Config
    from llmtrain.flops import flops_per_token
    from llmtrain.lora import LoRAArgs
    from llmtrain.plan.memory import lora_trainable_parameters

    config = Config.from_name(work.model)
    if work.recipe != "finetune_lora":
        return flops_per_token(config, work.seq_len)
    adapters = LoRAArgs(lora_r=LORA_FLAGS["lora_r"], lora_alpha=LORA_FLAGS["lora_alpha"],
                        lora_dropout=LORA_FLAGS["lora_dropout"], lora_query=True, lora_key=False, lora_value=True,
                        lora_projection=False, lora_mlp=False, lora_head=False)
    return flops_per_token(config, work.seq_len, adapter_parameters=lora_trainable_parameters(config, adapters))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this tree's llmtrain for the shapes, the FLOPs and the header
    sys.exit(main())
