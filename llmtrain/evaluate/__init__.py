"""``llmtrain evaluate``: a model directory scored on lm-evaluation-harness tasks; and the built-in instruction set.

- `setup`: the command line. Checks the flags and the model directory, resolves the tasks (lm-eval's TaskManager;
  a folder of task YAMLs of one's own with --include_path), loads the model and runs lm-eval's ``simple_evaluate``
  on it through `llmtrain.evaluate.harness.LLMtrainLM`; prints lm-eval's table and writes the results JSON.
- `list_tasks`: what ``llmtrain evaluate CHECKPOINT`` without --tasks prints.
- `builtin_instruct_accuracy`: greedy answers to ``BuiltinInstruct``'s held-out items, checked exactly.

lm-eval is the ``eval`` extra (``pip install 'llmtrain[eval]'``), imported only once a command needs it, so that
``llmtrain --help`` and the refusals stay fast. Why llmtrain's own model and not HFLM over a converted folder:
BENCHMARKS.md, "Evaluate".
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional

import torch

from llmtrain.convert.hf import ensure_model_dir
from llmtrain.errors import close_matches
from llmtrain.model_dir import check_model_dir
from llmtrain.precision import PrecisionName

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

RESULTS_FILE = "results.json"
"""What --out_dir receives: lm-eval's results dictionary as JSON."""


def setup(
    checkpoint_dir: Path,
    *,
    tasks: Optional[str] = None,
    num_fewshot: Optional[int] = None,
    limit: Optional[float] = None,
    batch_size: int = 8,
    out_dir: Optional[Path] = None,
    include_path: Optional[Path] = None,
    seed: int = 1234,
    precision: Optional[PrecisionName] = None,
    accelerator: Literal["auto", "cpu", "cuda"] = "auto",
) -> None:
    """Score a model directory on lm-evaluation-harness tasks (e.g. --tasks hellaswag,arc_easy); without --tasks,
    list the tasks there are.

    Args:
        checkpoint_dir: Model directory with model.safetensors, model_config.yaml and tokenizer.json (e.g.
            out/finetune/lora/final), or a transformers folder (e.g. from `llmtrain download`).
        tasks: Comma-separated lm-eval task, group or tag names (wildcards allowed, e.g. "arc_*"). None: list them.
        num_fewshot: Examples in front of each question. None: each task's own default (0 for most).
        limit: Score only the first LIMIT documents of each task (a number below 1: that fraction of them); for a
            quick look, as the scores are not comparable to full runs.
        batch_size: Requests per forward pass (and sequences decoded together by generation tasks).
        out_dir: Write the results (every metric with its standard error, the task configs, versions) to
            OUT_DIR/results.json. None: print the table only.
        include_path: A folder of task YAMLs of your own (lm-eval's format), added to the built-in tasks: local
            data, e.g. dataset_path: json with data_files pointing at a .jsonl.
        seed: Seed of Python's, numpy's and torch's generators and of the few-shot sampler.
        precision: auto, 32-true, bf16-true, 16-true, bf16-mixed or 16-mixed. Default (auto): bf16-true on a GPU
            that supports it, else 32-true.
        accelerator: Where to run: auto (GPU if there is one), cpu or cuda.
    """
    # Before anything loads: the flags' errors, then the model directory's, then lm-eval's tasks.
    if num_fewshot is not None and num_fewshot < 0:
        raise ValueError(f"--num_fewshot must be 0 or more examples, got {num_fewshot}")
    if limit is not None and limit <= 0:
        raise ValueError(f"--limit must be a positive number of documents (or a fraction below 1), got {limit}")
    if batch_size < 1:
        raise ValueError(f"--batch_size must be at least 1, got {batch_size}")
    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"--include_path {include_path} is not a folder; pass a folder of task YAMLs")
    if out_dir is not None and Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise FileExistsError(f"--out_dir {out_dir} is a file; pass a folder for {RESULTS_FILE}")
    check_model_dir(ensure_model_dir(Path(checkpoint_dir)))  # a transformers folder is converted once, cached
    names = [name.strip() for name in (tasks or "").split(",") if name.strip()]
    require_lm_eval()
    if not names:
        print(list_tasks(include_path))
        return
    manager = task_manager(names, include_path)
    import lm_eval

    from llmtrain.evaluate.harness import LLMtrainLM
    from llmtrain.generate import load_for_generation

    loaded = load_for_generation(checkpoint_dir, precision=precision, accelerator=accelerator)
    started = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=LLMtrainLM(loaded, batch_size=batch_size, name=str(checkpoint_dir)), tasks=names,
        num_fewshot=num_fewshot, limit=limit, batch_size=batch_size, device=str(loaded.device),
        task_manager=manager, log_samples=False, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
        fewshot_random_seed=seed)
    results["config"].update(model="llmtrain", model_args=str(checkpoint_dir), precision=loaded.precision.name)
    print_results(results)
    print(f"Evaluated {checkpoint_dir} on {', '.join(results['results'])} in {time.perf_counter() - started:.1f} s",
          file=sys.stderr)
    if out_dir is not None:
        write_results(results, Path(out_dir))


def require_lm_eval() -> None:
    """lm-eval is there, or a one-line error that says how to install it."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError("llmtrain evaluate needs lm-evaluation-harness: pip install 'llmtrain[eval]' (or "
                         "pip install lm-eval)")


def task_manager(names: list[str], include_path: Optional[Path]) -> TaskManager:
    """lm-eval's TaskManager for ``names``, having checked that each names a task, group, tag or task YAML.

    Tasks of --include_path alone are found without indexing lm-eval's own thousands of task files (seconds).
    """
    from lm_eval.utils import pattern_match

    if include_path is not None:
        own = _task_manager(str(include_path), include_defaults=False)
        if all(pattern_match([name], own.all_subtasks) for name in names):
            return own
    manager = _task_manager(None if include_path is None else str(include_path), include_defaults=True)
    for name in names:
        if not pattern_match([name], manager.all_tasks) and not (name.endswith(".yaml") and Path(name).is_file()):
            close = close_matches(name, manager.all_tasks)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(f"--tasks: lm-eval has no task, group or tag {name!r}; {hint}`llmtrain evaluate "
                             "CHECKPOINT` without --tasks lists them, and --include_path adds a folder of your own "
                             "task YAMLs")
    return manager


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: Optional[str], include_defaults: bool) -> TaskManager:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def list_tasks(include_path: Optional[Path] = None) -> str:
    """The groups and tasks lm-eval knows (those of --include_path first), one per line."""
    manager = _task_manager(None if include_path is None else str(include_path), include_defaults=True)
    lines = []
    if include_path is not None:
        own = _task_manager(str(include_path), include_defaults=False)
        lines += [f"Tasks in {include_path} ({len(own.all_tasks)}):", *(f"  {name}" for name in own.all_tasks), ""]
    lines += [f"Groups ({len(manager.all_groups)}):", *(f"  {name}" for name in manager.all_groups), "",
              f"Tasks ({len(manager.all_subtasks)}):", *(f"  {name}" for name in manager.all_subtasks), "",
              "Score a model on some: llmtrain evaluate CHECKPOINT --tasks NAME[,NAME...] (wildcards allowed)"]
    return "\n".join(lines)


def print_results(results: dict) -> None:
    """lm-eval's tables: every task's metrics, then the groups'."""
    from lm_eval.utils import make_table

    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))


def write_results(results: dict, out_dir: Path) -> Path:
    """``results`` as OUT_DIR/results.json (written whole, then renamed into place)."""
    from lm_eval.utils import handle_non_serializable

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS_FILE
    partial = path.with_name(f".{RESULTS_FILE}.partial")
    partial.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    partial.replace(path)
    print(f"Wrote {path}", file=sys.stderr)
    return path


def builtin_instruct_accuracy(checkpoint_dir: Path, *, num_items: int = 100, tasks: Optional[list[str]] = None,
                              generator_seed: int = 0, max_new_tokens: int = 24) -> dict:
    """Accuracy of greedy answers to the held-out (validation) items of ``BuiltinInstruct``.

    Returns {"accuracy": float, "correct": int, "total": int, "per_task": {task: (correct, total)}}.
    """
    from llmtrain.model_dir import load_model_dir
    from llmtrain.data.builtin_instruct import TASKS, check, generate_tasks
    from llmtrain.generate import generate_text

    model, _, tokenizer, prompt_style = load_model_dir(checkpoint_dir, device="cpu", dtype=torch.float32)
    items = generate_tasks(generator_seed, "val", num_items, tasks, unique=True)
    per_task: Counter = Counter()
    totals: Counter = Counter()
    for item in items:
        task = next(name for name, _, pattern, _ in TASKS if pattern.search(item["instruction"]))
        answer = generate_text(model, tokenizer, prompt_style, item["instruction"], max_new_tokens=max_new_tokens)
        totals[task] += 1
        per_task[task] += check(item["instruction"], answer)
    correct = sum(per_task.values())
    return {"accuracy": correct / len(items), "correct": correct, "total": len(items),
            "per_task": {task: (per_task[task], totals[task]) for task in sorted(totals)}}
