"""Held-out loss of llmtrain against LitGPT at equal tokens: same data, order, shape, optimizer and schedule.

Run with llmtrain's Python from the repository root (the peers' venvs as in README.md):

    .venv/bin/python bench/peers/loss_parity.py --seeds 1 2 --steps 300 [--windows 64] [--threads 2]

For each seed, one run at a time:
1. export: llmtrain's own data module for the debug recipe (config_hub/pretrain/debug.yaml), connected with the
   seed as `llmtrain pretrain --seed` connects it, hands out every training micro-batch of the run in order; they
   are saved as windows of max_seq_length + 1 tokens (inputs, and the labels shifted by one), with the first
   --windows windows of the validation split, which are the ones llmtrain's own validation reads.
2. llmtrain: `llmtrain pretrain --config debug.yaml --seed S --train.max_steps N`, which must see those batches:
   its logged loss of step 1 is checked against the initial model's loss on the exported first step. Its final
   model is converted with `llmtrain convert to_hf`.
3. LitGPT: litgpt_train.py trains LitGPT's GPT on the exported batches, as `litgpt pretrain` does, and writes a
   transformers folder.
4. judge: parity_judge.py loads both folders with transformers and computes the mean token cross-entropy on the
   same held-out windows (and checks that the LitGPT folder reproduces LitGPT's logits).

The last lines are a Markdown table: held-out loss and perplexity per tool and seed, the means, and llmtrain's
relative difference to LitGPT. Everything lands in --work_dir (logs of every run included).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
PEERS = Path(__file__).resolve().parent
RECIPE = ROOT / "config_hub" / "pretrain" / "debug.yaml"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    parser.add_argument("--warmup_steps", type=int, default=None,
                        help="linear warmup steps (default: a tenth of --steps, the issue's 30 of 300)")
    parser.add_argument("--windows", type=int, default=64,
                        help="held-out windows of max_seq_length tokens (a multiple of the micro batch)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each run (they run one at a time)")
    parser.add_argument("--work_dir", type=Path, default=Path("out/loss-parity"))
    parser.add_argument("--litgpt_python", default="/work/peers/litgpt-venv/bin/python")
    parser.add_argument("--hf_python", default="/work/peers/hf-venv/bin/python")
    parser.add_argument("--litgpt_schedule", choices=["litgpt", "llmtrain"], default="litgpt",
                        help="litgpt: LitGPT's own get_lr, evaluated per micro-batch as `litgpt pretrain` does; "
                             "llmtrain: llmtrain's rate for each optimizer step (README.md, 'Loss parity')")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    recipe = read_recipe(RECIPE)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, round(args.steps / 10))
    if args.windows < 1 or args.windows % recipe["micro_batch_size"]:
        raise SystemExit(f"--windows must be a positive multiple of the micro batch ({recipe['micro_batch_size']}), "
                         f"got {args.windows}")
    if not 0 < warmup < args.steps:
        raise SystemExit(f"--warmup_steps must be in [1, --steps), got {warmup}")
    # NOTE: a seed's llmtrain run is reused when its final model exists, so the folder names what decides it.
    work = args.work_dir.resolve() / f"steps-{args.steps}-warmup-{warmup}"
    work.mkdir(parents=True, exist_ok=True)
    results, timings = [], {}
    for seed in args.seeds:
        seed_dir = work / f"seed-{seed}"
        seed_dir.mkdir(exist_ok=True)
        say(f"seed {seed}: exporting {args.steps} steps of batches and {args.windows} held-out windows")
        data_path, val_path = export_data(recipe, seed, args.steps, warmup, args.windows, seed_dir)

        started = time.perf_counter()
        llmtrain_dir = run_llmtrain(recipe, seed, args.steps, warmup, args.windows, seed_dir, args.threads)
        timings[("llmtrain", seed)] = time.perf_counter() - started
        first_loss = check_first_step(recipe, seed, data_path, llmtrain_dir)
        say(f"seed {seed}: llmtrain's step 1 saw the exported batches (loss {first_loss:.4f})")
        llmtrain_hf = seed_dir / "hf-llmtrain"
        if not (llmtrain_hf / "config.json").is_file():
            run([sys.executable, "-m", "llmtrain", "convert", "to_hf", str(llmtrain_dir / "final"), str(llmtrain_hf)],
                seed_dir / "convert.log", llmtrain_env(args.threads))

        started = time.perf_counter()
        litgpt_hf = seed_dir / f"hf-litgpt-{args.litgpt_schedule}-schedule"
        run([args.litgpt_python, str(PEERS / "litgpt_train.py"), str(data_path), str(litgpt_hf),
             "--schedule", args.litgpt_schedule, "--threads", str(args.threads)],
            seed_dir / "litgpt.log", peer_env(args.threads))
        timings[("litgpt", seed)] = time.perf_counter() - started

        judged = judge(args.hf_python, val_path, [llmtrain_hf, litgpt_hf], seed_dir, args.threads)
        own_val = final_val_loss(llmtrain_dir)
        if abs(judged[0]["loss"] - own_val) > 1e-3:
            raise SystemExit(f"seed {seed}: transformers judges llmtrain's model at {judged[0]['loss']:.5f}, "
                             f"llmtrain's own final validation said {own_val:.5f}: the conversion or the windows "
                             "differ")
        say(f"seed {seed}: llmtrain's own final val_loss {own_val:.5f}, judged {judged[0]['loss']:.5f}; "
            f"LitGPT's logits check {judged[1]['check_max_diff']:.1e}")
        results += [("llmtrain", seed, judged[0]["loss"]), ("litgpt", seed, judged[1]["loss"])]
    table = markdown_table(results, args, warmup)
    name = f"results-{args.litgpt_schedule}-schedule"
    (work / f"{name}.json").write_text(json.dumps(
        [{"tool": tool, "seed": seed, "loss": loss, "train_s": timings[(tool, seed)]} for tool, seed, loss in results],
        indent=2) + "\n")
    (work / f"{name}.md").write_text(table + "\n")
    print(table)


def read_recipe(path: Path) -> dict:
    """The debug recipe's settings that both tools must share."""
    recipe = yaml.safe_load(path.read_text())
    train, optimizer = recipe["train"], recipe["optimizer"]
    if optimizer["class_path"] != "torch.optim.AdamW":
        raise SystemExit(f"{path}: the comparison trains with AdamW, the recipe says {optimizer['class_path']}")
    return {
        "model_name": recipe["model_name"], "data": recipe["data"],
        "micro_batch_size": train["micro_batch_size"], "global_batch_size": train["global_batch_size"],
        "max_seq_length": train["max_seq_length"], "min_lr": train["min_lr"], "max_norm": train["max_norm"],
        "lr": optimizer["init_args"]["lr"], "betas": list(optimizer["init_args"]["betas"]),
        "weight_decay": optimizer["init_args"]["weight_decay"],
    }


def export_data(recipe: dict, seed: int, steps: int, warmup: int, windows: int, seed_dir: Path) -> tuple[Path, Path]:
    """Every training micro-batch of the run in order, and the first held-out windows, from llmtrain's data module.

    ``data.pt``: ``train`` (steps, micro-batches per step, micro batch, max_seq_length + 1) token ids, the
    settings the LitGPT worker needs and llmtrain's rate for each step. ``val.pt``: ``windows`` (windows,
    max_seq_length + 1). A window is a micro-batch row's inputs followed by its last label.
    """
    from llmtrain.config import Config
    from llmtrain.convert.adapters import adapter_for_config
    from llmtrain.train.schedule import lr_at

    data = data_module(recipe, seed)
    micro, accum = recipe["micro_batch_size"], recipe["global_batch_size"] // recipe["micro_batch_size"]
    loader = data.train_dataloader()
    loader.prefetch = 0  # made on the spot, in this thread
    train = torch.stack([torch.stack([window_rows(next(loader)) for _ in range(accum)]) for _ in range(steps)])
    val_batches = data.val_dataloader()
    if val_batches is None or len(val_batches) * micro < windows:
        raise SystemExit(f"the validation split has fewer than {windows} windows; lower --windows")
    val = torch.cat([window_rows(batch) for batch in itertools.islice(val_batches, windows // micro)])
    config = Config.from_name(recipe["model_name"])
    lrs = [lr_at(step, base_lr=recipe["lr"], warmup_steps=warmup, total_steps=steps, min_lr=recipe["min_lr"])
           for step in range(steps)]
    settings = {key: recipe[key] for key in ("lr", "betas", "weight_decay", "min_lr", "max_norm")}
    data_path, val_path = seed_dir / "data.pt", seed_dir / "val.pt"
    save_atomic({"train": train.to(torch.int32), "seed": seed, "warmup_steps": warmup, "llmtrain_lrs": lrs,
                 "hf_config": adapter_for_config(config).hf_config(config), **settings}, data_path)
    save_atomic({"windows": val.to(torch.int32)}, val_path)
    return data_path, val_path


def data_module(recipe: dict, seed: int):
    """The recipe's data module, connected and set up as `llmtrain pretrain --seed` does on one process."""
    from llmtrain.data import PythonStdlib

    spec = recipe["data"]
    if spec["class_path"] != "llmtrain.data.PythonStdlib":
        raise SystemExit(f"{RECIPE}: the export knows PythonStdlib, the recipe says {spec['class_path']}")
    data = PythonStdlib(**spec.get("init_args", {}))
    data.validate()
    data.connect(data.default_tokenizer(), recipe["micro_batch_size"], recipe["max_seq_length"], seed)
    data.prepare_data()
    data.setup(0, 1)
    return data


def window_rows(batch: dict) -> torch.Tensor:
    """(B, T + 1) windows of a language-modelling batch, after checking its labels are the inputs shifted by one."""
    input_ids, labels = batch["input_ids"], batch["labels"]
    assert torch.equal(input_ids[:, 1:], labels[:, :-1]), "labels are not the inputs shifted by one"
    return torch.cat([input_ids, labels[:, -1:]], dim=1)


def run_llmtrain(recipe: dict, seed: int, steps: int, warmup: int, windows: int, seed_dir: Path,
                 threads: int) -> Path:
    """`llmtrain pretrain` with the debug recipe for ``steps`` steps; its final validation reads the held-out
    windows."""
    out_dir = seed_dir / "llmtrain"
    if (out_dir / "final").is_dir():
        say(f"seed {seed}: reusing {out_dir}")
        return out_dir
    run([sys.executable, "-m", "llmtrain", "pretrain", "--config", str(RECIPE), "--seed", str(seed),
         "--out_dir", str(out_dir), "--train.max_steps", str(steps), "--train.lr_warmup_steps", str(warmup),
         "--train.log_interval", "1", "--train.save_interval", str(steps), "--eval.interval", str(10 * steps),
         "--eval.max_iters", str(windows // recipe["micro_batch_size"]), "--eval.initial_validation", "false"],
        seed_dir / "llmtrain.log", llmtrain_env(threads))
    return out_dir


def check_first_step(recipe: dict, seed: int, data_path: Path, out_dir: Path) -> float:
    """The loss llmtrain logged for step 1 equals the loss of its initial weights on the exported first step."""
    from llmtrain.config import Config
    from llmtrain.distributed.parallelize import materialize
    from llmtrain.model import GPT

    with torch.device("meta"):
        model = GPT(Config.from_name(recipe["model_name"]))
    materialize(model, torch.device("cpu"), seed)  # as build_model does for `--seed`
    model.max_seq_length = recipe["max_seq_length"]
    first = torch.load(data_path)["train"][0].long()
    with torch.no_grad():
        loss = sum(float(model(rows[:, :-1], labels=rows[:, 1:])) for rows in first) / first[..., 1:].numel()
    logged = float(metrics_rows(out_dir, "loss")[0]["loss"])
    if abs(loss - logged) > 1e-4 * max(1.0, abs(logged)):
        raise SystemExit(f"llmtrain logged {logged:.6f} for step 1, its initial weights give {loss:.6f} on the "
                         f"exported first step: the run did not train on the exported batches")
    return logged


def final_val_loss(out_dir: Path) -> float:
    return float(metrics_rows(out_dir, "val_loss")[-1]["val_loss"])


def metrics_rows(out_dir: Path, column: str) -> list[dict]:
    with open(out_dir / "metrics.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get(column)]
    if not rows:
        raise SystemExit(f"{out_dir / 'metrics.csv'} has no {column}")
    return rows


def judge(python: str, val_path: Path, model_dirs: list[Path], seed_dir: Path, threads: int) -> list[dict]:
    log = seed_dir / "judge.log"
    run([python, str(PEERS / "parity_judge.py"), str(val_path), *map(str, model_dirs), "--threads", str(threads)],
        log, peer_env(threads))
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    return [json.loads(line) for line in lines[-len(model_dirs):]]


def markdown_table(results: list[tuple[str, int, float]], args: argparse.Namespace, warmup: int) -> str:
    lines = [(f"Held-out loss after {args.steps} steps (warmup {warmup}) of the debug recipe, {args.windows} windows, "
              f"judged by transformers; LitGPT schedule: {args.litgpt_schedule}"), "",
             "| tool | seed | held-out loss | perplexity |", "|---|---|---|---|"]
    lines += [f"| {tool} | {seed} | {loss:.4f} | {math.exp(loss):.2f} |" for tool, seed, loss in results]
    means = {}
    for tool in ("llmtrain", "litgpt"):
        losses = [loss for name, _, loss in results if name == tool]
        means[tool] = sum(losses) / len(losses)
        lines.append(f"| {tool} | mean | {means[tool]:.4f} | {math.exp(means[tool]):.2f} |")
    difference = (means["llmtrain"] - means["litgpt"]) / means["litgpt"]
    lines += ["", f"llmtrain vs LitGPT (mean held-out loss): {difference:+.2%}"]
    return "\n".join(lines)


def llmtrain_env(threads: int) -> dict:
    env = peer_env(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "extensions" / "deepspeed")])
    return env


def peer_env(threads: int) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    return env


def run(command: list[str], log: Path, env: dict) -> None:
    """Run ``command`` from the repository root with its output in ``log``; its tail and exit on failure."""
    with open(log, "w") as handle:
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                              check=False).returncode
    if code:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise SystemExit(f"{' '.join(command[:4])} ... failed with exit code {code} (log: {log}):\n{tail}")


def save_atomic(obj: dict, path: Path) -> None:
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, temp)
    os.replace(temp, path)


def say(message: str) -> None:
    print(f"[loss_parity] {message}", flush=True)


if __name__ == "__main__":
    main()
