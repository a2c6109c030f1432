"""`llmtrain evaluate` through the command line on local lm-eval tasks, against lm-eval's own HFLM.

A tiny model trained for a few steps on the built-in stories is scored on three local tasks, one per kind of request
(multiple choice: loglikelihood; perplexity: rolling loglikelihood over several windows; exact match:
generate_until), by `llmtrain evaluate` and by lm-eval's HFLM on the folder `convert to_hf` makes of the same model:
every metric must agree. The generation task's targets are, for every other document, the greedy answer that
`llmtrain.generate.generate` (one prompt at a time) gives, so its exact match is 0.5 only when the batched
generation of the evaluation reproduces it. Nothing reaches the network: the data are local jsonl files, the
hub and `datasets` are offline.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from llmtrain.cli import main
from llmtrain.convert.hf import to_hf
from llmtrain.data.stories import generate_stories
from llmtrain.generate import generate, generate_batch, load_model_dir

from conftest import write_tiny_model
from local_tasks import write_story_tasks, write_task

pytest.importorskip("lm_eval")

TASKS = "story_choice,story_perplexity,story_next_words"
MAX_GEN_TOKS = 6
PERPLEXITY_RTOL = 1e-4  # fp32: two implementations of the same model sum the same log-probabilities in other orders


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    """No hub, no dataset downloads, and datasets' cache in this module's own folder."""
    patch = pytest.MonkeyPatch()
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setenv("HF_DATASETS_OFFLINE", "1")
    patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
    patch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path_factory.mktemp("eval-cache")))
    yield
    patch.undo()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, offline) -> Path:
    """A tiny model pretrained for a few steps on the built-in stories (block_size 64: a story is several windows)."""
    root = tmp_path_factory.mktemp("eval-model")
    model_file = write_tiny_model(root / "tiny.yaml")
    main(["pretrain", "--model_config", str(model_file), "--out_dir", str(root / "run"), "--data", "BuiltinStories",
          "--data.num_documents", "300", "--data.num_val_documents", "20", "--train.global_batch_size", "4",
          "--train.micro_batch_size", "4", "--train.max_seq_length", "64", "--train.max_steps", "8",
          "--train.lr_warmup_steps", "1", "--eval.max_iters", "1", "--optimizer", "AdamW", "--optimizer.lr", "0.01"])
    return root / "run" / "final"


def greedy_answer(model, tokenizer, context: str) -> str:
    """llmtrain's own greedy continuation of `context`, one prompt alone, cut as lm-eval cuts answers."""
    prompt = torch.tensor(tokenizer.encode(context))
    new_ids = generate(model, prompt, MAX_GEN_TOKS, temperature=0.0, eos_id=tokenizer.eos_id)[len(prompt):]
    return tokenizer.decode(new_ids.tolist(), skip_special_tokens=True).split(".")[0]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, model_dir) -> Path:
    """Three local tasks on held-out stories: multiple choice, perplexity, generation."""
    folder = tmp_path_factory.mktemp("tasks")
    write_story_tasks(folder)
    model, _, tokenizer, _ = load_model_dir(model_dir)
    generation_rows = []
    for index, story in enumerate(generate_stories(7, "val", 8)):
        context = " ".join(story.split()[:3 + index])
        answer = greedy_answer(model, tokenizer, context) if index % 2 == 0 else " a wrong answer"
        generation_rows.append({"context": context, "answer": answer})
    write_task(folder, "story_next_words", generation_rows,
               "output_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{answer}}'\n"
               f"generation_kwargs:\n  until: ['.']\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
               "metric_list:\n  - metric: exact_match\n")
    return folder


@pytest.fixture(scope="module")
def ours(tmp_path_factory, model_dir, task_dir) -> dict:
    """`llmtrain evaluate` on the three tasks, batch 3 (batches of unequal lengths), its results JSON."""
    out_dir = tmp_path_factory.mktemp("eval-out")
    main(["evaluate", str(model_dir), "--tasks", TASKS, "--include_path", str(task_dir), "--batch_size", "3",
          "--out_dir", str(out_dir), "--accelerator", "cpu", "--precision", "32-true"])
    return json.loads((out_dir / "results.json").read_text())


def test_scores_equal_lm_evals_hflm_on_the_converted_folder(ours, model_dir, task_dir, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    hf_dir = to_hf(model_dir, tmp_path / "hf")
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={hf_dir},dtype=float32", tasks=TASKS.split(","), batch_size=2,
        device="cpu", task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        random_seed=1234, numpy_random_seed=1234, torch_random_seed=1234, fewshot_random_seed=1234)
    assert set(ours["results"]) == set(theirs["results"]) == set(TASKS.split(","))
    for task, metrics in theirs["results"].items():
        for key, expected in metrics.items():
            if key == "alias" or key.endswith("_stderr,none") and expected == "N/A":
                continue
            actual = ours["results"][task][key]
            if "perplexity" in key or "bits_per_byte" in key:
                assert math.isclose(actual, expected, rel_tol=PERPLEXITY_RTOL), (task, key, actual, expected)
            else:
                assert actual == expected, (task, key, actual, expected)
    assert ours["results"]["story_next_words"]["exact_match,none"] == 0.5  # the greedy answers, reproduced
    assert 0 < ours["results"]["story_choice"]["acc,none"] < 1
    assert ours["n-samples"]["story_choice"]["effective"] == 8 and ours["config"]["model"] == "llmtrain"


@pytest.mark.parametrize("name, overrides", [("llama-debug", {}), ("gpt-neox-debug", {}), ("phi-debug", {}),
                                             ("gemma-debug", {}), ("mistral-debug", {"sliding_window": 5})])
def test_batched_generation_equals_one_prompt_at_a_time(name, overrides):
    """Prompts of different lengths padded on the left and decoded together give each one's own greedy answer, in
    every family (partial rotary, parallel residual, a sliding window shorter than the prompts)."""
    from llmtrain.model import GPT

    from conftest import tiny_config

    torch.manual_seed(0)
    model = GPT(tiny_config(name, n_layer=2, **overrides)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 9, 9, 9]]
    batched = generate_batch(model, prompts, 12, temperature=0.0)
    assert batched == [generate(model, torch.tensor(p), 12, temperature=0.0)[len(p):].tolist() for p in prompts]
    stop = batched[1][2]  # a row ends at its first stop id, and the others go on
    stopped = generate_batch(model, prompts, 12, temperature=0.0, stop_ids=[stop])
    assert all(row == full[:full.index(stop) + 1] if stop in full else row == full
               for row, full in zip(stopped, batched))


def test_without_tasks_it_lists_them_with_the_included_ones(model_dir, task_dir, capsys):
    main(["evaluate", str(model_dir), "--include_path", str(task_dir)])
    out = capsys.readouterr().out
    assert out.index("story_perplexity") < out.index("hellaswag")  # the folder's own first, then lm-eval's
    assert "\n  arc_easy\n" in out and "\n  mmlu\n" in out


def test_an_unknown_task_is_refused_with_the_closest_names(model_dir, task_dir, tmp_path):
    with pytest.raises(ValueError, match=r"no task, group or tag 'hellaswg'; did you mean hellaswag"):
        main(["evaluate", str(model_dir), "--tasks", "story_choice,hellaswg", "--include_path", str(task_dir),
              "--out_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_requests_with_a_tokenizer_that_adds_bos_get_hflms_answers(sentencepiece_style_tokenizer, tmp_path):
    """Llama-style tokenizers put <s> in front: each kind of request, with and without a context, and a text that
    brings its own <s>, answered as HFLM answers them on the converted folder (block_size 32: several windows)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from llmtrain.checkpoint.files import write_model_dir
    from llmtrain.evaluate.harness import LLMtrainLM
    from llmtrain.generate import load_for_generation
    from llmtrain.model import GPT

    from conftest import tiny_config

    tokenizer = sentencepiece_style_tokenizer
    config = tiny_config("llama-debug", n_layer=2, block_size=32, vocab_size=tokenizer.vocab_size)
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    model_dir = write_model_dir(tmp_path / "bos", state_dict=model.state_dict(), model_config=config,
                                hyperparameters=None, tokenizer=tokenizer)
    ours = LLMtrainLM(load_for_generation(model_dir, precision="32-true", accelerator="cpu"), batch_size=3)
    theirs = HFLM(pretrained=str(to_hf(model_dir, tmp_path / "hf")), dtype="float32", batch_size=3, device="cpu")
    assert ours.tok_encode("The cat")[0] == tokenizer.bos_id == theirs.tok_encode("The cat")[0]

    def requests(kind, arguments):
        return [Instance(kind, {}, args, index) for index, args in enumerate(arguments)]

    # NOTE: this BPE has no pre-tokenizer, so a token may span words: none of these continuations merges into the
    # end of its context, which would leave it no tokens of its own (lm-eval refuses those, HFLM too).
    pairs = requests("loglikelihood", [("The dog", " ran to the box."), ("", "A quick brown fox"),
                                       ("The lazy fox", " jumps on the cat."), ("<s>The dog", " ran")])
    for (logprob, greedy), (expected, expected_greedy) in zip(ours.loglikelihood(pairs), theirs.loglikelihood(pairs)):
        assert math.isclose(logprob, expected, rel_tol=1e-5) and greedy == expected_greedy, (logprob, expected)
    texts = requests("loglikelihood_rolling", [("Tom ate a big red apple. " * 3,), ("A quick brown fox.",)])
    for logprob, expected in zip(ours.loglikelihood_rolling(texts), theirs.loglikelihood_rolling(texts)):
        assert math.isclose(logprob, expected, rel_tol=1e-5), (logprob, expected)
    settings = {"until": ["."], "max_gen_toks": 8, "do_sample": False}
    prompts = requests("generate_until", [("The dog", settings), ("A quick brown fox jumps", settings), ("Tom ate a", settings)])
    answers = ours.generate_until(prompts)
    assert answers == theirs.generate_until(prompts) and all(answers), answers
