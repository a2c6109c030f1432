"""`llmtrain evaluate`'s model (llmtrain.evaluate.harness.LLMtrainLM) against lm-eval's HFLM on the converted folder.

    python bench/ab/evaluate_backends.py [--work_dir /tmp/evaluate_backends] [--steps 60] [--rounds 2]
        [--batch_size 8] [--checkpoint_dir DIR]

Pretrains llama-debug on the built-in stories for --steps steps (once; or takes --checkpoint_dir), converts it with
`convert to_hf`, writes three local lm-eval tasks on held-out stories (64 four-way multiple-choice questions:
loglikelihood; 16 stories: rolling loglikelihood; 32 generations of up to 32 tokens: generate_until), then
evaluates them --rounds times with each backend, alternating, in one process: llmtrain's LM on the model directory
and lm-eval's HFLM (fp32, batch --batch_size) on the transformers folder. Prints, per backend and kind of request,
the median seconds per request over the rounds, and every metric of both (they must agree: tests/evaluate/).
Offline: HF_HUB_OFFLINE and HF_DATASETS_OFFLINE are set. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

KINDS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def pretrain(work_dir: Path, steps: int) -> Path:
    from llmtrain.cli import main

    out_dir = work_dir / "pretrain"
    if not (out_dir / "final").is_dir():
        main(["pretrain", "llama-debug", "--out_dir", str(out_dir), "--data", "BuiltinStories",
              "--data.num_documents", "4000", "--data.num_val_documents", "40", "--train.global_batch_size", "16",
              "--train.micro_batch_size", "8", "--train.max_seq_length", "256", "--train.max_steps", str(steps),
              "--train.lr_warmup_steps", "10", "--eval.max_iters", "2", "--precision", "32-true"])
    return out_dir / "final"


def write_tasks(folder: Path) -> list[str]:
    """The three tasks as YAML + jsonl in ``folder``; their names."""
    from llmtrain.data.stories import generate_stories

    folder.mkdir(parents=True, exist_ok=True)
    stories = list(generate_stories(11, "val", 112))
    rng = random.Random(1)
    vocabulary = sorted({word for story in stories for word in story.split()})

    def question(story: str) -> dict:
        words = story.split()
        at = rng.randrange(8, min(60, len(words)))
        options = [words[at], *rng.sample([w for w in vocabulary if w != words[at]], 3)]
        rng.shuffle(options)
        return {"context": " ".join(words[:at]), "choices": [" " + w for w in options],
                "label": options.index(words[at])}

    tasks = {
        "bench_choice": ([question(s) for s in stories[:64]],
                         "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
                         "doc_to_target: label\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n"
                         "  - metric: acc_norm\n"),
        "bench_perplexity": ([{"text": s} for s in stories[64:80]],
                             "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                             "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"),
        "bench_generation": ([{"context": " ".join(s.split()[:12]), "answer": " ".join(s.split()[12:16])}
                              for s in stories[80:112]],
                             "output_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{answer}}'\n"
                             "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 32\n  do_sample: false\n"
                             "metric_list:\n  - metric: exact_match\n"),
    }
    for name, (rows, body) in tasks.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")
    return list(tasks)


def timed(lm, seconds: dict, counts: dict) -> None:
    """Record how long each kind of request takes on ``lm``, and how many there were."""
    for kind in KINDS:
        method = getattr(lm, kind)

        def wrapper(requests, *args, _method=method, _kind=kind, **kwargs):
            started = time.perf_counter()
            answers = _method(requests, *args, **kwargs)
            seconds[_kind] += time.perf_counter() - started
            counts[_kind] += len(requests)
            return answers

        setattr(lm, kind, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work_dir", type=Path, default=Path("/tmp/evaluate_backends"))
    parser.add_argument("--checkpoint_dir", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8)
    args = parser.parse_args()

    import torch
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from llmtrain.convert.hf import to_hf
    from llmtrain.evaluate.harness import LLMtrainLM
    from llmtrain.generate import load_for_generation

    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = args.checkpoint_dir or pretrain(args.work_dir, args.steps)
    hf_dir = args.work_dir / "hf"
    if not hf_dir.is_dir():
        to_hf(model_dir, hf_dir)
    names = write_tasks(args.work_dir / "tasks")
    manager = TaskManager(include_path=str(args.work_dir / "tasks"), include_defaults=False)
    loaded = load_for_generation(model_dir, precision="32-true", accelerator="cpu")
    backends = {"llmtrain": lambda: LLMtrainLM(loaded, batch_size=args.batch_size, name=str(model_dir)),
                "hflm": lambda: HFLM(pretrained=str(hf_dir), dtype="float32", batch_size=args.batch_size,
                                     device="cpu")}
    per_request: dict = defaultdict(lambda: defaultdict(list))
    scores = {}
    for round_index in range(args.rounds):
        for name, make in backends.items():
            lm, seconds, counts = make(), defaultdict(float), defaultdict(int)
            timed(lm, seconds, counts)
            results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, log_samples=False,
                                              random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                              fewshot_random_seed=0)
            for kind in KINDS:
                per_request[name][kind].append(seconds[kind] / counts[kind])
            scores[name] = results["results"]
            print(f"round {round_index} {name}: " + ", ".join(
                f"{kind} {counts[kind]} requests {seconds[kind]:.2f} s" for kind in KINDS), flush=True)
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch_size}, "
          f"load average {os.getloadavg()[0]:.1f}; median ms per request over {args.rounds} rounds")
    print("| backend | " + " | ".join(KINDS) + " |")
    for name in backends:
        print(f"| {name} | " + " | ".join(f"{1000 * statistics.median(per_request[name][kind]):.2f}"
                                          for kind in KINDS) + " |")
    print("\n| task | metric | llmtrain | HFLM |")
    for task, metrics in scores["hflm"].items():
        for key, value in metrics.items():
            if key != "alias" and "stderr" not in key:
                print(f"| {task} | {key.split(',')[0]} | {scores['llmtrain'][task][key]!r} | {value!r} |")


if __name__ == "__main__":
    main()
