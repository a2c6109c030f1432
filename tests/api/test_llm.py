"""`from llmtrain import LLM`: a model directory loaded once, answering as `llmtrain generate` and `llmtrain chat` do.

Greedy decoding makes the answers exact: each is compared with the command line's output or with `generate_text`
on the conversation written out by hand, so a prompt rendered differently or a stream that lost a piece fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import llmtrain
from llmtrain import LLM
from llmtrain.cli import main
from llmtrain.generate import PromptTooLongError, generate_text

from conftest import write_random_model_dir

ROOT = Path(__file__).resolve().parents[2]
GREEDY = ["--temperature", "0", "--accelerator", "cpu", "--precision", "32-true"]
PROMPT = "What food do llamas eat?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    tokenizer = tiny_tokenizer(["Llamas eat grass and hay. " * 4, "What food do llamas eat? They eat leaves."],
                               vocab_size=300)
    return write_random_model_dir(tmp_path_factory.mktemp("api") / "final", tokenizer, std=0.05)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM.load(model_dir, accelerator="cpu", precision="32-true")


def test_greedy_generate_is_the_command_lines_and_its_stream_joins_to_it(llm, model_dir, capsys):
    main(["generate", str(model_dir), "--prompt", PROMPT, "--max_new_tokens", "24", *GREEDY])
    printed = capsys.readouterr().out
    text = llm.generate(PROMPT, 24, temperature=0)
    assert text and printed == text + "\n"
    pieces = list(llm.generate(PROMPT, 24, temperature=0, stream=True))
    assert len(pieces) > 1 and "".join(pieces) == text
    raw = llm.generate(PROMPT, 8, temperature=0, raw=True)  # no template: another prompt, another answer
    assert raw != text[:len(raw)]


def test_a_stop_text_ends_the_answer_before_it_streamed_or_not(llm):
    text = llm.generate(PROMPT, 24, temperature=0)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    expected = text[:text.index(stop)]
    assert llm.generate(PROMPT, 24, temperature=0, stop=[stop, "never written"]) == expected
    assert "".join(llm.generate(PROMPT, 24, temperature=0, stop=stop, stream=True)) == expected


def test_sampling_with_a_seed_repeats_and_a_stream_read_in_part_leaves_the_model_usable(llm):
    first = llm.generate(PROMPT, 16, temperature=1.0, top_k=20, seed=7)
    assert llm.generate(PROMPT, 16, temperature=1.0, top_k=20, seed=7) == first
    stream = llm.generate(PROMPT, 16, temperature=0, stream=True)
    next(stream)
    stream.close()  # the reader went away: generation ends at its next token
    assert "".join(llm.generate(PROMPT, 16, temperature=1.0, top_k=20, seed=7, stream=True)) == first


def test_chat_answers_the_conversation_as_rendered_in_the_prompt_style(llm):
    model, tokenizer, style = llm.model, llm.tokenizer, llm.prompt_style
    conversation = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Which animals hum?"},
                    {"role": "assistant", "content": "Alpacas."}, {"role": "user", "content": "What do they eat?"}]
    expected = generate_text(model, tokenizer, style, conversation, max_new_tokens=12)
    assert llm.chat(conversation, 12, temperature=0) == expected
    assert "".join(llm.chat(conversation, 12, temperature=0, stream=True)) == expected
    one = generate_text(model, tokenizer, style, [{"role": "user", "content": PROMPT}], max_new_tokens=12)
    assert llm.chat(PROMPT, 12, temperature=0) == one
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    assert llm.chat(PROMPT, 12, system="Be brief.", temperature=0) == generate_text(
        model, tokenizer, style, with_system, max_new_tokens=12)


def test_bad_input_raises_the_command_lines_message(llm, model_dir, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as from_cli:
        main(["generate", str(missing)])
    with pytest.raises(FileNotFoundError) as from_api:
        LLM.load(missing)
    assert str(from_api.value) == str(from_cli.value) and "no-such-model" in str(from_api.value)
    too_long = "hay " * 300
    with pytest.raises(PromptTooLongError) as from_cli:
        main(["generate", str(model_dir), "--prompt", too_long, *GREEDY])
    for call in (lambda: llm.generate(too_long), lambda: llm.generate(too_long, stream=True)):
        with pytest.raises(PromptTooLongError) as from_api:  # at the call, also for a stream
            call()
        assert str(from_api.value) == str(from_cli.value)
    with pytest.raises(ValueError, match="--temperature must be >= 0"):
        llm.generate(PROMPT, temperature=-1)
    with pytest.raises(ValueError, match="ends with an assistant message"):
        llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    with pytest.raises(ValueError, match="--precision '8-true': expected one of"):
        LLM.load(model_dir, precision="8-true")


def test_import_llmtrain_stays_cheap_and_names_the_api():
    """The package imports no torch until a name of the API is used (the command line's start pays for nothing)."""
    code = ("import sys, llmtrain; assert 'torch' not in sys.modules, 'torch imported'; "
            "print(' '.join(name for name in dir(llmtrain) if not name.startswith('_')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) >= {"LLM", "pretrain", "finetune_lora", "finetune_full", "convert_to_hf"}
    assert llmtrain.LLM is LLM and llmtrain.pretrain.__module__ == "llmtrain.api"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        llmtrain.nothing
