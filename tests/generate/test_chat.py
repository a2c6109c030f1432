"""`llmtrain chat` through the real command line (piped and on a pseudo-terminal), and its pieces in process.

Replies are checked against `generate_text` on the conversation written out by hand: greedy decoding
makes them exact, so a reply that missed the earlier turns, or a stream that printed a byte wrong,
fails the comparison.
"""

from __future__ import annotations

import dataclasses
import io
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llmtrain.chat import PROMPT, Chat, TextStream
from llmtrain.generate import decode_completion, generate_text, load_for_generation, load_model_dir
from llmtrain.model import GPT
from llmtrain.prompts import PromptStyle

from conftest import write_random_model_dir
from forked_cli import forked_driver, forked_results

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 120  # a hung chat fails the test instead of the suite; no run comes near it
GREEDY = ["--temperature", "0", "--accelerator", "cpu", "--precision", "32-true"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    texts = ["Llamas eat grass and hay. " * 4, "What food do llamas eat? They eat leaves.", "Alpacas hum. " * 3]
    tokenizer = tiny_tokenizer(texts, vocab_size=300)
    return write_random_model_dir(tmp_path_factory.mktemp("chat") / "final", tokenizer, std=0.05)


@pytest.fixture(scope="module")
def answer(model_dir):
    """generate_text's greedy reply to a conversation (a list of messages)."""
    model, _, tokenizer, prompt_style = load_model_dir(model_dir)

    def reply(messages: list[dict], max_new_tokens: int) -> str:
        return generate_text(model, tokenizer, prompt_style, messages, max_new_tokens=max_new_tokens)

    return reply


def chat_process(model_dir: Path, stdin: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmtrain", "chat", str(model_dir), *flags], input=stdin,
                          capture_output=True, encoding="utf-8", timeout=HANG_GUARD_S, cwd=ROOT, env=child_env())


def child_env() -> dict[str, str]:
    # NOTE: TERM=dumb keeps readline from wrapping each line in bracketed-paste escapes on the terminal.
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8",
            "TERM": "dumb"}


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


# ---- piped stdin ---------------------------------------------------------------------------------


def test_two_turns_the_second_given_the_first(model_dir, answer):
    done = chat_process(model_dir, "What do llamas eat?\nAnd alpacas?\n", *GREEDY, "--max_new_tokens", "12")
    assert done.returncode == 0, done.stderr
    first = answer([user("What do llamas eat?")], 12)
    second = answer([user("What do llamas eat?"), assistant(first), user("And alpacas?")], 12)
    assert second != answer([user("And alpacas?")], 12)  # else this test could not tell history was kept
    assert done.stdout == f"{first}\n{second}\n"
    assert "Traceback" not in done.stderr


def test_oldest_turns_go_when_the_conversation_outgrows_the_block(model_dir, answer):
    system = {"role": "system", "content": "Answer in one word."}
    messages = ["Which animals hum?", "What food do llamas eat? They eat grass and hay.",
                "What food do llamas eat in winter? They eat leaves.", "And what do alpacas eat?"]
    done = chat_process(model_dir, "\n".join(messages) + "\n", *GREEDY, "--max_new_tokens", "8",
                        "--system", system["content"])
    assert done.returncode == 0, done.stderr
    conversation, replies = [system], []
    for message in messages[:3]:  # these fit with room for an 8-token reply
        conversation.append(user(message))
        replies.append(answer(conversation, 8))
        conversation.append(assistant(replies[-1]))
    # The fourth message leaves no room for a reply unless the first turn goes.
    _, _, tokenizer, prompt_style = load_model_dir(model_dir)
    assert len(tokenizer.encode(prompt_style.apply(conversation + [user(messages[3])]))) + 8 > 256
    replies.append(answer([system, *conversation[3:], user(messages[3])], 8))
    assert done.stdout == "".join(f"{reply}\n" for reply in replies)
    assert done.stderr.count("dropped the oldest turn") == 1, done.stderr


BAD_FLAGS = [(["--temperature", "-1"], "--temperature"), (["--max_new_tokens", "0"], "--max_new_tokens"),
             (["--precision", "8-true"], "--precision")]


@pytest.fixture(scope="module")
def refused(model_dir, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each bad command line as its own `python -m llmtrain chat` process, forked from one interpreter that has
    imported llmtrain (forked_cli: a fresh interpreter each would spend its start-up on the import alone); stdin
    at its end, so that a chat that read it would end at once. Keyed by the flag, and "path" for a missing model."""
    root = tmp_path_factory.mktemp("chat-refused")
    argvs = {says: ["chat", str(model_dir), *flags] for flags, says in BAD_FLAGS}
    argvs["path"] = ["chat", str(root / "no-such-model")]
    driver = subprocess.run(forked_driver(list(argvs.values()), root / "logs"), stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=HANG_GUARD_S * len(argvs), cwd=ROOT,
                            env=child_env())  # the guard each process had, for the four
    assert driver.returncode == 0, driver.stdout + driver.stderr
    return dict(zip(argvs, forked_results(root / "logs")))


@pytest.mark.parametrize("flags, says", BAD_FLAGS)
def test_bad_flag_exits_2_before_loading(refused, flags, says):
    done = refused[says]
    assert done.returncode == 2
    assert says in done.stderr and "Traceback" not in done.stderr
    assert "Loaded" not in done.stderr and done.stdout == ""


def test_bad_path_exits_2_with_one_error_line(refused):
    done = refused["path"]
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no-such-model" in errors[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


# ---- a terminal ----------------------------------------------------------------------------------


def read_until(fd: int, marker: bytes, *, within_s: float = HANG_GUARD_S, key: bytes = b"") -> bytes:
    """What the terminal shows until `marker` (or until the child closes it).

    With `key`, nothing shown for `within_s` seconds presses it again (up to the hang guard), as a user does.
    NOTE: CPython's readline misses a SIGINT that lands between its check for signals and its select()
    (nothing wakes that select up); a Ctrl-C pressed the instant the prompt shows can hit that window on a
    loaded machine, and a second one is seen.
    """
    seen, deadline, quiet_since = b"", time.monotonic() + HANG_GUARD_S, time.monotonic()
    while marker not in seen:
        assert time.monotonic() < deadline, f"no {marker!r} on the terminal; it shows {seen!r}"
        if key and not seen and time.monotonic() - quiet_since > within_s:
            os.write(fd, key)
            quiet_since = time.monotonic()
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # Linux: EIO once the child has closed the terminal
            chunk = b""
        if not chunk:
            break
        seen += chunk
    return seen


@pytest.mark.parametrize("key", ["ctrl-d", "ctrl-c"])
def test_on_a_terminal_a_reply_streams_and_the_key_ends_the_chat(model_dir, answer, key):
    pty = pytest.importorskip("pty")
    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat, on the terminal
        try:
            # NOTE: a suite started in the background from a script inherits SIGINT ignored, and Python then
            # never raises KeyboardInterrupt; a user at a terminal has it at its default.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.chdir(ROOT)
            os.execve(sys.executable, [sys.executable, "-m", "llmtrain", "chat", str(model_dir), *GREEDY,
                                       "--max_new_tokens", "12"], child_env())
        finally:
            os._exit(127)  # never back into pytest
    try:
        assert read_until(fd, PROMPT.encode()).endswith(PROMPT.encode())
        os.write(fd, b"What do llamas eat?\r")
        shown = read_until(fd, PROMPT.encode())
        reply = answer([user("What do llamas eat?")], 12)
        # The terminal echoes the line, then shows the reply (its newlines as \r\n) and the next prompt.
        assert shown == f"What do llamas eat?\n{reply}\n{PROMPT}".replace("\n", "\r\n").encode()
        pressed = {"ctrl-d": b"\x04", "ctrl-c": b"\x03"}[key]
        os.write(fd, pressed)
        read_until(fd, b"never shown: read to the end", within_s=10, key=pressed if key == "ctrl-c" else b"")
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    finally:
        os.close(fd)
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


# ---- in process ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_for_generation(model_dir, accelerator="cpu", precision="32-true")


def test_text_stream_holds_back_split_characters_and_stop_beginnings(loaded):
    tokenizer = loaded.tokenizer
    prompt_ids = tokenizer.encode("Say it:")
    euro = tokenizer.encode("€", bos=False)
    assert len(euro) == 3  # three bytes the tokenizer never merged: three tokens
    stream = TextStream(tokenizer, prompt_ids)
    assert [stream.push(token) for token in euro] == ["", "", "€"]

    hay, stop = tokenizer.encode(" hay", bos=False), tokenizer.encode("<|end|>", bos=False)
    assert len(stop) > 1
    stream = TextStream(tokenizer, prompt_ids, stop_tokens=(stop,))
    pieces = [stream.push(token) for token in hay + stop]
    assert "".join(pieces) == " hay" and pieces[-len(stop):] == [""] * len(stop)
    assert stream.finish() == "" and stream.text == " hay"
    # The beginning of the stop sequence without its end is text after all.
    stream = TextStream(tokenizer, prompt_ids, stop_tokens=(stop,))
    pieces = [stream.push(token) for token in stop[:-1] + hay] + [stream.finish()]
    assert "".join(pieces) == stream.text == tokenizer.decode(stop[:-1] + hay)


def test_text_stream_of_a_byte_fallback_tokenizer_drops_nothing(sentencepiece_style_tokenizer):
    """Llama 2's tokenizer writes unseen characters as <0xNN> byte tokens, and its decoder turns a whole run of them
    into "\\ufffd"s once one byte is invalid: a stray byte must not rewrite the printed "é", nor silence the rest."""
    tokenizer = sentencepiece_style_tokenizer
    prompt_ids = tokenizer.encode("The cat:")
    e_acute, the_mat = tokenizer.encode("é", bos=False), tokenizer.encode("the mat", bos=False)
    assert [tokenizer.processor.id_to_token(token) for token in e_acute] == ["▁", "<0xC3>", "<0xA9>"]
    stray = e_acute[-1]  # a continuation byte with no character to continue
    stream = TextStream(tokenizer, prompt_ids, eos_id=tokenizer.eos_id)
    pieces = [stream.push(token) for token in e_acute + [stray] + the_mat + [tokenizer.eos_id]] + [stream.finish()]
    assert "".join(pieces) == stream.text == " é\ufffd the mat"
    # Without bytes, the text is the decoded completion, with the space SentencePiece writes as the "▁" of "▁the".
    stream = TextStream(tokenizer, prompt_ids, eos_id=tokenizer.eos_id)
    pieces = [stream.push(token) for token in the_mat + e_acute] + [stream.finish()]
    assert "".join(pieces) == stream.text == decode_completion(tokenizer, prompt_ids, the_mat + e_acute) == " the mat é"


class InterruptedOutput(io.StringIO):
    """Output on which Ctrl-C is pressed as soon as the `after`-th piece of text shows."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.pieces_left = after

    def write(self, text: str) -> int:
        written = super().write(text)
        if text:
            self.pieces_left -= 1
            if self.pieces_left == 0:
                raise KeyboardInterrupt
        return written


def test_ctrl_c_during_a_reply_keeps_what_was_shown_and_the_chat_goes_on(loaded, answer):
    notices = io.StringIO()
    out = InterruptedOutput(after=3)
    chat = Chat(loaded, temperature=0.0, max_new_tokens=12, out=out, notices=notices)
    shown = chat.reply("What do llamas eat?")
    assert shown and out.getvalue() == shown + "\n"
    assert answer([user("What do llamas eat?")], 12).startswith(shown) and "(stopped)" in notices.getvalue()
    second = chat.reply("And alpacas?")
    assert second == answer([user("What do llamas eat?"), assistant(shown), user("And alpacas?")], 12)
    assert out.getvalue() == f"{shown}\n{second}\n"


def test_a_message_too_long_for_the_model_is_refused_and_the_chat_goes_on(loaded, monkeypatch):
    notices = io.StringIO()
    chat = Chat(loaded, temperature=0.0, max_new_tokens=4, out=io.StringIO(), notices=notices)
    lines = iter(["hi", "hay " * 300, "and hay?"])

    def read(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", read)
    chat.run(prompt="")
    assert "error: this message makes a prompt of" in notices.getvalue()
    assert "dropped" not in notices.getvalue()  # the refused message cost no turn
    assert [message["content"] for message in chat.history[::2]] == ["hi", "and hay?"]


class Replay(GPT):
    """A GPT that answers any prompt with the token ids of `reply`, the first of them right after the prompt."""

    def __init__(self, config, reply: list[int]) -> None:
        super().__init__(config)
        self.reply = reply

    def forward(self, idx, input_pos=None):
        if int(input_pos[0]) == 0:  # the prefill: the prompt ends where the reply begins
            self.reply_start = input_pos.numel()
        logits = torch.zeros(*idx.shape, self.config.padded_vocab_size)
        logits[:, -1, self.reply[int(input_pos[-1]) + 1 - self.reply_start]] = 1.0
        return logits


@pytest.mark.parametrize("style", ["alpaca", "chatml", "default", "gemma", "llama3", "llama3.1", "phi",
                                   "tinyllama"])
def test_the_next_turn_holds_the_reply_as_the_model_wrote_it(loaded, style):
    """The conversation the model reads next turn begins with what it read and wrote this turn, as fine-tuning
    writes an answer out (a style that puts a space before the answer must not put a second one)."""
    prompt_style = PromptStyle.from_name(style)
    tokenizer = loaded.tokenizer
    # What fine-tuning teaches the model to write after the first message.
    asked = [{"role": "system", "content": "Answer briefly."}, user("What do llamas eat?")]
    written = prompt_style.render(asked + [assistant("They eat hay.")])[-1].text
    reply = tokenizer.encode(written, bos=False) + [tokenizer.eos_id]
    model = Replay(dataclasses.replace(loaded.model.config, block_size=1024), reply)  # room for llama3's headers
    chat = Chat(loaded._replace(model=model, prompt_style=prompt_style), system="Answer briefly.",
                temperature=0.0, max_new_tokens=len(reply), out=io.StringIO(), notices=io.StringIO())
    first = tokenizer.decode(chat.prompt_ids("What do llamas eat?"))
    chat.reply("What do llamas eat?")
    assert tokenizer.decode(chat.prompt_ids("And alpacas?")).startswith(first + written)


@pytest.mark.parametrize("command", ["/exit", "/quit", "exit", "quit", "!exit", "!quit", "  /Exit "])
def test_an_exit_command_ends_the_chat_without_a_reply(loaded, monkeypatch, command):
    out, notices = io.StringIO(), io.StringIO()
    chat = Chat(loaded, temperature=0.0, max_new_tokens=4, out=out, notices=notices)
    lines = iter(["hi", command, "never read"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    chat.run(prompt="")
    assert [message["content"] for message in chat.history[::2]] == ["hi"]  # the command went to no model
    assert next(lines) == "never read" and notices.getvalue() == ""


def test_the_command_line_names_its_exit_commands_and_obeys_them(model_dir, monkeypatch, capsys):
    from llmtrain.cli import main

    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    assert "a line /exit, /quit, exit, quit, !exit or !quit ends it" in " ".join(capsys.readouterr().out.split())
    monkeypatch.setattr(sys, "stdin", io.StringIO("/quit\nWhat do llamas eat?\n"))
    main(["chat", str(model_dir), *GREEDY])
    done = capsys.readouterr()
    assert done.out == "" and "/exit or Ctrl-D ends the chat" in done.err
