"""Local lm-eval tasks for `llmtrain evaluate` without a network: a task YAML beside a jsonl of its documents.

- ``write_task``: one task (``dataset_path: json`` over the jsonl) in a folder that ``--include_path`` takes;
- ``write_story_tasks``: two tasks on held-out built-in stories, whichever model is scored: ``story_choice``
  (four-way multiple choice of a story's next word: loglikelihood) and ``story_perplexity`` (whole stories:
  rolling loglikelihood).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from llmtrain.data.stories import generate_stories


def write_task(folder: Path, name: str, rows: list[dict], body: str) -> Path:
    """Task ``name`` over ``rows`` in ``folder``: ``body`` is the rest of its YAML (output_type, doc_to_*, metrics)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = folder / f"{name}.yaml"
    path.write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    f"test_split: test\n{body}")
    return path


def write_story_tasks(folder: Path, seed: int = 7) -> list[str]:
    """``story_choice`` (8 questions) and ``story_perplexity`` (4 stories) in ``folder``; their names."""
    stories = list(generate_stories(seed, "val", 12))
    rng = random.Random(seed)
    words = sorted({word for story in stories for word in story.split()})
    questions = []
    for story in stories[:8]:
        story_words = story.split()
        at = rng.randrange(4, 20)
        choices = [" " + word for word in [story_words[at], *rng.sample(
            [word for word in words if word != story_words[at]], 3)]]
        rng.shuffle(choices)
        questions.append({"context": " ".join(story_words[:at]), "choices": choices,
                          "label": choices.index(" " + story_words[at])})
    write_task(folder, "story_choice", questions,
               "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
               "doc_to_target: label\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    write_task(folder, "story_perplexity", [{"text": story} for story in stories[8:12]],
               "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
               "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    return ["story_choice", "story_perplexity"]
