"""`llmtrain serve` as a user runs it: one real server process on 127.0.0.1 for the module, spoken to with the
official `openai` client (and raw httpx for what the client would not send).

Answers are greedy, so each must equal `llmtrain generate`'s output for the same prompt, whole or streamed, one
request or eight at once; a bad request gets OpenAI's error object with a 4xx and the server goes on serving.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Union

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from llmtrain.cli import main  # noqa: E402
from llmtrain.generate import decode_completion, generate, generate_text, load_for_generation  # noqa: E402
from llmtrain.generate import setup as generate_setup  # noqa: E402
from llmtrain.prompts import save_prompt_style  # noqa: E402

from conftest import write_random_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 120  # a hung server fails the test instead of the suite; starting one takes a few seconds
MAX_NEW_TOKENS = 24
PROMPTS = ["What food do llamas eat?", "Alpacas hum.", "Tell me about hay.", "Llamas", "Why grass?", "Leaves",
           "Do alpacas eat leaves?", "Say hello"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    texts = ["Llamas eat grass and hay. " * 4, "What food do llamas eat? They eat leaves.", "Alpacas hum. " * 3]
    tokenizer = tiny_tokenizer(texts, vocab_size=300)
    # ChatML: its end of turn, <|im_end|>, is several tokens of this tokenizer, which a stream must hold back
    return write_random_model_dir(tmp_path_factory.mktemp("serve") / "tiny-chat", tokenizer, std=0.1,
                                 write_extras=lambda directory: save_prompt_style("chatml", directory))


class Server:
    """`python -m llmtrain serve` in a child process; `url` once it said where it serves."""

    def __init__(self, model_dir: Path, *flags: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "llmtrain", "serve", str(model_dir), "--port", "0", "--accelerator", "cpu",
             "--precision", "32-true", "--max_new_tokens", str(MAX_NEW_TOKENS), *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(HANG_GUARD_S) or self.process.poll() is not None:
            self.process.kill()
            raise AssertionError("the server did not start:\n" + "".join(self.lines))
        self.url = re.search(r"serving \S+ at (http://\S+)", "".join(self.lines))[1]

    def _read(self) -> None:
        for line in self.process.stderr:  # drained to the end, so the pipe never fills
            self.lines.append(line)
            if line.startswith("serving "):
                self.ready.set()
        self.ready.set()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(HANG_GUARD_S)


@pytest.fixture(scope="module")
def server(model_dir):
    server = Server(model_dir, "--model_name", "tiny")
    yield server
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="x", timeout=HANG_GUARD_S, max_retries=0)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_for_generation(model_dir, accelerator="cpu", precision="32-true")


def raw_completion(loaded, prompt: str, max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[str, int, int]:
    """`llmtrain generate --raw --temperature 0`'s completion of `prompt`, and its prompt and completion tokens."""
    ids = loaded.tokenizer.encode(prompt)
    eos = loaded.tokenizer.eos_id
    new = generate(loaded.model, torch.tensor(ids), max_new_tokens, temperature=0.0, eos_id=eos)[len(ids):].tolist()
    return decode_completion(loaded.tokenizer, ids, new, (), eos), len(ids), len(new)


def chat_answer(loaded, prompt: Union[str, list[dict]], max_new_tokens: int = MAX_NEW_TOKENS) -> str:
    return generate_text(loaded.model, loaded.tokenizer, loaded.prompt_style, prompt, max_new_tokens=max_new_tokens)


# ---- answers equal llmtrain generate's -----------------------------------------------------------


def test_models_health_and_the_readiness_line(server, client):
    assert [model.id for model in client.models.list()] == ["tiny"]
    assert httpx.get(server.url.removesuffix("/v1") + "/health").json() == {"status": "ok", "pending": 0}
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", server.url)


@pytest.mark.parametrize("raw", [True, False], ids=["completions", "chat"])
def test_an_answer_whole_and_streamed_equals_llmtrain_generate(raw, model_dir, client, loaded, capsys):
    prompt = PROMPTS[0]
    # llmtrain generate itself (in this process), greedy: what it prints is the reference
    generate_setup(model_dir, prompt, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, raw=raw, accelerator="cpu",
                   precision="32-true")
    expected = capsys.readouterr().out.removesuffix("\n")
    assert expected
    if raw:
        _, prompt_tokens, completion_tokens = raw_completion(loaded, prompt)
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW_TOKENS, temperature=0)
        text, reason = whole.choices[0].text, whole.choices[0].finish_reason
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW_TOKENS,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    else:
        prompt_tokens = len(loaded.tokenizer.encode(loaded.prompt_style.apply(prompt)))
        messages = [{"role": "user", "content": prompt}]
        whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW_TOKENS,
                                               temperature=0)
        text, reason = whole.choices[0].message.content, whole.choices[0].finish_reason
        assert whole.choices[0].message.role == "assistant"
        completion_tokens = whole.usage.completion_tokens
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW_TOKENS,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == streamed == expected
    assert len(re.findall(r"\w+", streamed)) > 2  # the stream came in pieces
    assert sum(bool(chunk.choices) for chunk in chunks) > 3
    assert reason == ("length" if completion_tokens == MAX_NEW_TOKENS else "stop")
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == reason
    counts = dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                  total_tokens=prompt_tokens + completion_tokens)
    assert whole.usage.model_dump() | counts == whole.usage.model_dump()
    assert chunks[-1].usage.model_dump() | counts == chunks[-1].usage.model_dump() and not chunks[-1].choices


def test_a_stop_string_ends_the_answer_before_it_and_max_tokens_is_capped(client, loaded):
    expected, _, _ = raw_completion(loaded, PROMPTS[1])
    stop = expected[len(expected) // 2:][:3]
    whole = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_NEW_TOKENS, temperature=0,
                                      stop=["\x00never", stop])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected[:expected.index(stop)], "stop")
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[1], temperature=0, stop=stop, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected[:expected.index(stop)]
    # max_tokens above the server's --max_new_tokens: the cap, as without max_tokens
    capped = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10 * MAX_NEW_TOKENS,
                                       temperature=0)
    assert capped.choices[0].text == expected and capped.usage.completion_tokens <= MAX_NEW_TOKENS
    short = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=3, temperature=0)
    assert (short.usage.completion_tokens, short.choices[0].finish_reason) == (3, "length")
    assert expected.startswith(short.choices[0].text)


def test_a_seed_repeats_a_sampled_answer(client):
    def sampled(seed: int) -> str:
        return client.completions.create(model="tiny", prompt=PROMPTS[2], temperature=1.5, seed=seed,
                                         extra_body={"top_k": 50}).choices[0].text

    assert sampled(7) == sampled(7)
    assert len({sampled(seed) for seed in (1, 2, 3)}) > 1


def test_eight_concurrent_requests_each_get_their_own_answer(server, client, loaded):
    expected = {prompt: chat_answer(loaded, prompt) for prompt in PROMPTS}
    assert len(set(expected.values())) > 5  # different prompts, different answers

    def ask(index: int) -> str:
        messages = [{"role": "user", "content": PROMPTS[index]}]
        if index % 2:
            stream = client.chat.completions.create(model="tiny", messages=messages, temperature=0, stream=True)
            return "".join(chunk.choices[0].delta.content or "" for chunk in stream)
        return client.chat.completions.create(model="tiny", messages=messages, temperature=0).choices[0].message.content

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = [pool.submit(ask, index) for index in range(len(PROMPTS))]
        time.sleep(0.05)  # the requests are on their way
        # the event loop is free while the worker generates: /health answers with requests still pending
        health = httpx.get(server.url.removesuffix("/v1") + "/health", timeout=HANG_GUARD_S).json()
        assert {prompt: answers[index].result(HANG_GUARD_S) for index, prompt in enumerate(PROMPTS)} == expected
    assert health["status"] == "ok" and health["pending"] > 0


def test_a_conversation_with_a_system_message_is_rendered_in_the_prompt_style(client, loaded):
    messages = [{"role": "system", "content": "You are a llama."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [
                    {"type": "text", "text": "What do you "}, {"type": "text", "text": "eat?"}]}]
    whole = client.chat.completions.create(model="tiny", messages=messages, temperature=0)
    as_written = messages[:3] + [{"role": "user", "content": "What do you eat?"}]
    assert whole.choices[0].message.content == chat_answer(loaded, as_written)


def test_a_client_that_leaves_a_stream_frees_the_worker(server, client):
    with httpx.stream("POST", server.url + "/completions", timeout=HANG_GUARD_S,
                      json={"model": "tiny", "prompt": PROMPTS[4], "stream": True, "temperature": 0}) as stream:
        first = next(stream.iter_lines())
    assert first.startswith("data: {")
    deadline = time.monotonic() + HANG_GUARD_S
    while httpx.get(server.url.removesuffix("/v1") + "/health").json()["pending"]:
        assert time.monotonic() < deadline, "the stream's job never ended"
        time.sleep(0.05)
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


# ---- bad requests ----------------------------------------------------------------------------------

TOO_LONG = "Llamas eat grass and hay. " * 80
BAD_REQUESTS = [
    # (name, endpoint, body (bytes: sent as they are), status, param, words of the message)
    ("bad JSON", "completions", b'{"model": "tiny", "prompt": ', 400, None, ["not valid JSON"]),
    ("not an object", "completions", b'["tiny"]', 400, None, ["JSON object"]),
    ("unknown model", "completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", ["'gpt-4'", "'tiny'"]),
    ("negative max_tokens", "completions", {"model": "tiny", "prompt": "hi", "max_tokens": -5}, 400, "max_tokens",
     ["greater than or equal to 1", "-5"]),
    ("zero max_tokens", "chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 0}, 400, "max_tokens", ["greater than or equal to 1"]),
    ("a prompt longer than the context", "completions", {"model": "tiny", "prompt": TOO_LONG}, 400, "prompt",
     ["holds at most 256", "shorten the prompt"]),
    ("a conversation longer than the context", "chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages", ["holds at most 256"]),
    ("max_tokens of the wrong type", "completions", {"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, 400,
     "max_tokens", ["valid integer"]),
    ("temperature of the wrong type", "completions", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, 400,
     "temperature", ["valid number"]),
    ("negative temperature", "completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, 400,
     "temperature", ["greater than or equal to 0"]),
    ("a negative seed", "completions", {"model": "tiny", "prompt": "hi", "seed": -1}, 400, "seed",
     ["greater than or equal to 0"]),
    ("top_p of zero", "completions", {"model": "tiny", "prompt": "hi", "top_p": 0}, 400, "top_p", ["greater than 0"]),
    ("an unknown field", "completions", {"model": "tiny", "prompt": "hi", "tempreature": 0}, 400, "tempreature",
     ["unknown or unsupported"]),
    ("no prompt", "completions", {"model": "tiny"}, 400, "prompt", ["required"]),
    ("n above 1", "completions", {"model": "tiny", "prompt": "hi", "n": 2}, 400, "n", ["only n=1"]),
    ("two prompts", "completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt", ["one prompt"]),
    ("no messages", "chat/completions", {"model": "tiny", "messages": []}, 400, "messages", ["at least 1"]),
    ("an unknown role", "chat/completions", {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages.0.role", ["'user'"]),
    ("the assistant first", "chat/completions",
     {"model": "tiny", "messages": [{"role": "assistant", "content": "x"}]}, 400, "messages", ["alternate"]),
    ("penalties", "chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                       "presence_penalty": 0.5}, 400, "presence_penalty", ["not supported"]),
]


def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, client, loaded):
    failures = []
    with httpx.Client(base_url=server.url, timeout=HANG_GUARD_S) as http:
        for name, endpoint, body, status, param, words in BAD_REQUESTS:
            sent = dict(content=body) if isinstance(body, bytes) else dict(json=body)
            response = http.post(f"/{endpoint}", headers={"Content-Type": "application/json"}, **sent)
            error = response.json().get("error", {}) if response.headers["content-type"].startswith(
                "application/json") else {}
            got = (response.status_code, error.get("param"), error.get("type"))
            missing = [word for word in words if word.lower() not in str(error.get("message")).lower()]
            if got != (status, param, "invalid_request_error") or missing or set(error) != {
                    "message", "type", "param", "code"}:
                failures.append(f"{name}: {response.status_code} {response.text}")
        assert http.get("/nothing-here").json()["error"]["code"] == "404"
    assert not failures, "\n".join(failures)
    # the client raises the matching exceptions, and a good request still answers after all of them
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=TOO_LONG)
    assert refused.value.code == "context_length_exceeded"
    answer = client.completions.create(model="tiny", prompt=PROMPTS[3], temperature=0)
    assert answer.choices[0].text == raw_completion(loaded, PROMPTS[3])[0]


def test_a_taken_port_is_refused_before_loading(server, model_dir):
    port = server.url.rsplit(":", 1)[1].split("/")[0]
    with pytest.raises(OSError, match=rf"--port {port}: cannot listen there .*--port 0"):
        main(["serve", str(model_dir), "--port", port])


def test_a_transformers_folder_is_served_under_its_own_name(model_dir, loaded, tmp_path, monkeypatch):
    """A download is a transformers folder: served as it is (converted once), named after the folder given."""
    from llmtrain.convert.hf import convert_to_hf

    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))  # the server's conversion goes there

    folder = tmp_path / "tiny-hf"
    convert_to_hf(model_dir, folder)
    other = Server(folder)
    try:
        client = openai.OpenAI(base_url=other.url, api_key="x", timeout=HANG_GUARD_S, max_retries=0)
        assert [model.id for model in client.models.list()] == ["tiny-hf"]
        answer = client.completions.create(model="tiny-hf", prompt=PROMPTS[1], max_tokens=MAX_NEW_TOKENS,
                                           temperature=0)
        assert answer.choices[0].text == raw_completion(loaded, PROMPTS[1])[0]
        assert other.stop() == 0
    finally:
        if other.process.poll() is None:
            other.process.kill()


# ---- last: the module's server stops --------------------------------------------------------------


def test_sigterm_stops_the_server_cleanly(server):
    assert server.stop() == 0
    output = "".join(server.lines)
    assert "Traceback" not in output and output.rstrip().endswith("stopped serving"), output
