"""The cost curve: tokens/s and MFU against model size and against sequence length, as a table and a PNG.

    .venv/bin/python bench/ab/cost_curve.py [--out_dir out/cost_curve] [--precision 32-true]
    .venv/bin/python bench/ab/cost_curve.py --plot_only out/cost_curve/records.jsonl   # redraw from the records

Two sweeps of ``llmtrain benchmark`` (the real pretrain step, one process, ``--steps`` timed steps after
``--warmup``), every point at the same tokens per step (``--tokens`` per micro batch, one micro batch per step):

- size: the zoo's Pythia models (14M to 410M) at sequence ``--size_seq_len`` (256);
- length: ``--length_model`` (pythia-70m) at sequences 256 to 2048, the micro batch shrinking as the sequence grows.

The table gives each point's FLOPs per token (llmtrain.flops: 6 × matmul weights + the attention matmuls),
tokens/s, MFU against the matmul peak the run measured, and the **cost ratio**: seconds per FLOP relative to the
sweep's cheapest point. Where the cost ratio climbs, a token costs more than its FLOPs say: the step spends its
time outside the matmuls the FLOPs count (attention's kernels, elementwise passes, memory traffic).
Records are appended to ``OUT_DIR/records.jsonl``; the tables and the plot (``OUT_DIR/cost_curve.png``) take the
latest record of each point, so ``--models`` (none) ``--lengths 512`` measures one point again. MFU is against one
peak for all points, the median of the runs' measured matmul peaks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZES = ("pythia-14m", "pythia-31m", "pythia-70m", "pythia-160m", "pythia-410m")
LENGTHS = (256, 512, 1024, 2048)


def bench(model: str, seq_len: int, micro_batch_size: int, args: argparse.Namespace, sweep: str) -> dict:
    results = args.out_dir / "records.jsonl"
    before = results.read_text().count("\n") if results.exists() else 0
    command = [str(ROOT / ".venv" / "bin" / "llmtrain"), "benchmark", "--model", model, "--precision", args.precision,
               "--micro_batch_size", str(micro_batch_size), "--seq_len", str(seq_len), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--baseline", "null", "--results", str(results)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    lines = results.read_text().splitlines()
    assert len(lines) == before + 1, "the benchmark appended no record"
    record = json.loads(lines[-1])
    record["sweep"] = sweep
    lines[-1] = json.dumps(record)
    results.write_text("\n".join(lines) + "\n")
    print(f"{sweep}: {model} seq {seq_len} x {micro_batch_size}: {record['tokens_per_sec_per_device']:,.0f} tokens/s, "
          f"MFU {record['mfu']:.1%}", flush=True)
    return record


def latest(records: list[dict]) -> list[dict]:
    """The last record of each (sweep, model, sequence length): a point measured again replaces the earlier one."""
    points = {(r.get("sweep"), r["model"], r["seq_len"]): r for r in records}
    return sorted(points.values(), key=lambda r: (r.get("sweep") or "", r["parameters"], r["seq_len"]))


def steady_mfu(record: dict, peak: float) -> float:
    """MFU against one peak for every point (the median of the runs' measured peaks): a run's own three timed
    matmuls are noisier than its training steps, and the curve should show the steps."""
    return record["flops_per_token"] * record["tokens_per_sec_per_device"] / peak


def table(records: list[dict], sweep: str, peak: float) -> str:
    points = [r for r in records if r.get("sweep") == sweep]
    if not points:
        return ""
    cheapest = min(1 / (r["tokens_per_sec_per_device"] * r["flops_per_token"]) for r in points)
    rows = ["| model | parameters | seq × batch | FLOPs per token | tokens/s | step (median, min–max) | MFU | cost ratio | "
            "peak RSS |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in points:
        cost = 1 / (r["tokens_per_sec_per_device"] * r["flops_per_token"]) / cheapest
        rows.append(f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['seq_len']} × {r['micro_batch_size']} | "
                    f"{r['flops_per_token'] / 1e6:,.0f}M | {r['tokens_per_sec_per_device']:,.0f} | "
                    f"{r['step_time_median_s']:.2f} s ({r['step_time_min_s']:.2f}–{r['step_time_max_s']:.2f}) | "
                    f"{steady_mfu(r, peak):.1%} | {cost:.2f} | {r['peak_memory_gb']:.2f} GB |")
    return "\n".join(rows)


def plot(records: list[dict], output: Path, peak: float) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    figure = Figure(figsize=(11, 8), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2)
    for column, (sweep, key, label) in enumerate((("size", "parameters", "parameters (millions)"),
                                                  ("length", "seq_len", "sequence length (tokens)"))):
        points = sorted((r for r in records if r.get("sweep") == sweep), key=lambda r: r[key])
        if not points:
            continue
        xs = [r[key] / 1e6 if key == "parameters" else r[key] for r in points]
        speed_ax, mfu_ax = axes[0][column], axes[1][column]
        speed_ax.plot(xs, [r["tokens_per_sec_per_device"] for r in points], marker="o")
        mfu_ax.plot(xs, [100 * steady_mfu(r, peak) for r in points], marker="o", color="tab:orange")
        for ax in (speed_ax, mfu_ax):
            ax.set_xscale("log", base=2 if key == "seq_len" else 10)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel(label)
        for ax in (speed_ax, mfu_ax):
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xticks(xs, [f"{x:g}" if key == "seq_len" else f"{x:.0f}" for x in xs])
        if key == "seq_len":
            speed_ax.set_ylim(0, 1.15 * max(r["tokens_per_sec_per_device"] for r in points))
        else:
            speed_ax.set_yscale("log")
            for r, x in zip(points, xs):
                speed_ax.annotate(r["model"], (x, r["tokens_per_sec_per_device"]), fontsize=8,
                                  textcoords="offset points", xytext=(4, 4))
        speed_ax.set_ylabel("tokens/s (one process)")
        mfu_ax.set_ylabel(f"MFU (% of {peak / 1e9:.0f} GFLOP/s, the runs' median matmul peak)")
        mfu_ax.set_ylim(0, 100)
        title = ("against model size, seq " + str(points[0]["seq_len"]) if sweep == "size"
                 else f"against sequence length, {points[0]['model']}")
        speed_ax.set_title(title)
    first = records[0]
    figure.suptitle(f"llmtrain benchmark, {first['precision']}, {first['device']}, "
                    f"{first['threads_per_process']} threads, commit {first['commit']}")
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", type=Path, default=ROOT / "out" / "cost_curve")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step (micro batch x sequence)")
    parser.add_argument("--size_seq_len", type=int, default=256)
    parser.add_argument("--length_model", default="pythia-70m")
    parser.add_argument("--models", nargs="*", default=list(SIZES), help="the size sweep's models (none: skip it)")
    parser.add_argument("--lengths", nargs="*", type=int, default=list(LENGTHS),
                        help="the length sweep's sequence lengths (none: skip it)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--plot_only", type=Path, help="records.jsonl of an earlier sweep: only tabulate and plot")
    args = parser.parse_args()

    results = args.plot_only or args.out_dir / "records.jsonl"
    if not args.plot_only:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for seq_len in args.lengths:
            if args.tokens % seq_len:
                raise SystemExit(f"error: --tokens {args.tokens} is not a multiple of sequence length {seq_len}")
        for model in args.models:
            bench(model, args.size_seq_len, args.tokens // args.size_seq_len, args, "size")
        for seq_len in args.lengths:
            bench(args.length_model, seq_len, args.tokens // seq_len, args, "length")
    # Every point the records file holds, the latest of each: a sweep run again with fewer points updates those.
    records = latest([json.loads(line) for line in results.read_text().splitlines()])
    peak = statistics.median(r["matmul_peak_flops"] for r in records)
    output = results.parent / "cost_curve.png"
    print(f"\nMFU against {peak / 1e9:.0f} GFLOP/s, the median of the runs' measured matmul peaks")
    print("\n" + table(records, "size", peak) + "\n\n" + table(records, "length", peak))
    plot(records, output, peak)
    print(f"\nplot: {output}")


if __name__ == "__main__":
    sys.exit(main())
