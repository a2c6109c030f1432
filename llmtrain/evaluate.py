"""Scoring a model directory on the built-in instruction set: greedy answers, checked exactly."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional

import torch


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
