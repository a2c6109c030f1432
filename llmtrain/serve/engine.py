"""The generation side of ``llmtrain serve``: one model, one worker thread, a queue of requests.

The HTTP handlers run on uvicorn's event loop and must never wait on the model, so every request becomes a `Job`
that the worker thread takes from a queue and answers with `generate`'s KV-cache loop, one request after another.
The worker sends what it produces back as events (text pieces, then how it finished) through the job's `emit`,
which the handler turns into a response or a stream. `/health` and new requests are answered while it works.

NOTE: requests are not batched. Measured on 2 Xeon cores with a 2-layer test model (64 tokens each, 8 requests):
8 concurrent clients got 554-618 tokens/s against 443 sequentially, from overlapping HTTP and tokenization with
generation. A decode step of 8 sequences would give about 5.5x the tokens/s of one (2.9 against 1.8-2.3 ms a step),
and is bit-exact for prompts of one length; but prompts of different lengths need per-sequence positions and a
padding mask in the model's KV cache (llmtrain.model), which it does not have: that is the next step.
"""

from __future__ import annotations

import queue
import random
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Sequence, Union

import torch

from llmtrain.chat import TextStream
from llmtrain.generate import ends_with_stop, generate

if TYPE_CHECKING:
    from llmtrain.generate import LoadedModel


class Finished(NamedTuple):
    """How a job ended: OpenAI's finish_reason ("stop": a stop token or text, "length": the token limit) and the
    usage counts (the completion counts every generated token, a stop token included)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


Event = Union[str, Finished, BaseException]
"""What a job emits: a piece of the completion's text, then `Finished`, or the error that ended it."""


@dataclass
class Job:
    """One request's generation. `emit` is called from the worker thread and must be thread-safe."""

    prompt_ids: list[int]
    max_new_tokens: int
    emit: Callable[[Event], None]
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_tokens: Sequence[Sequence[int]] = ()
    """Token sequences that end the answer besides the tokenizer's eos (the prompt style's end of turn)."""
    stop_texts: Sequence[str] = ()
    """The request's `stop` strings: the answer ends before the first one it contains."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set when the client went away: the worker skips the job or stops it at its next token."""


class _Cancelled(Exception):
    pass


class _StopText(Exception):
    pass


class StopTexts:
    """The completion's text with the request's stop strings applied as it grows: `push` returns what may be sent
    now, holding back an end that may be the start of a stop string, and says when one was found (the text ends
    before it)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.text = ""
        self.sent = 0

    def push(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        found = [index for index in (self.text.find(stop) for stop in self.stops) if index >= 0]
        if found:
            end, hit = min(found), True
        else:
            held = max((length for stop in self.stops for length in range(len(stop) - 1, 0, -1)
                        if self.text.endswith(stop[:length])), default=0)
            end, hit = len(self.text) - held, False
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out, hit

    def finish(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class Engine:
    """The loaded model and the worker thread that answers `Job`s in the order they were submitted."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.jobs: queue.Queue[Optional[Job]] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self.thread = threading.Thread(target=self._work, name="llmtrain-serve-worker", daemon=True)
        self.thread.start()

    @property
    def pending(self) -> int:
        """Requests queued or generating now."""
        return self._pending

    def submit(self, job: Job) -> None:
        with self._lock:
            self._pending += 1
        self.jobs.put(job)

    def close(self) -> None:
        """Stop the worker after the job it is running (daemon: a process that exits does not wait for it)."""
        self.jobs.put(None)

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                if not job.cancelled.is_set():
                    self.run(job)
            except _Cancelled:
                pass
            except Exception as error:  # the request fails, the server goes on
                print(f"error: a request failed: {type(error).__name__}: {error}", file=sys.stderr)
                try:
                    _send(job, error)
                except _Cancelled:
                    pass
            finally:
                with self._lock:
                    self._pending -= 1

    def run(self, job: Job) -> None:
        """Generate `job`'s answer in this thread, emitting its text as it comes and then `Finished`."""
        model, tokenizer, _, device, precision = self.loaded
        stream = TextStream(tokenizer, job.prompt_ids, job.stop_tokens, tokenizer.eos_id)
        texts = StopTexts(job.stop_texts)
        new_ids: list[int] = []
        seed = job.seed if job.seed is not None else random.randrange(2**63)
        generator = torch.Generator(device).manual_seed(seed)

        def emit_text(text: str) -> None:
            if text:
                _send(job, text)

        def on_token(token_id: int) -> None:
            if job.cancelled.is_set():
                raise _Cancelled
            new_ids.append(token_id)
            text, hit = texts.push(stream.push(token_id))
            emit_text(text)
            if hit:
                raise _StopText

        reason = "stop"
        try:
            with precision.autocast(device):
                generate(model, torch.tensor(job.prompt_ids, dtype=torch.long, device=device), job.max_new_tokens,
                         temperature=job.temperature, top_k=job.top_k, top_p=job.top_p, stop_tokens=job.stop_tokens,
                         eos_id=tokenizer.eos_id, generator=generator, on_token=on_token)
            stops = [list(stop) for stop in job.stop_tokens] + [[tokenizer.eos_id]] * (tokenizer.eos_id is not None)
            text, hit = texts.push(stream.finish())
            emit_text(text)
            if not hit:
                emit_text(texts.finish())
                reason = "stop" if ends_with_stop(new_ids, stops) else "length"
        except _StopText:
            pass
        _send(job, Finished(reason, len(job.prompt_ids), len(new_ids)))


def _send(job: Job, event: Event) -> None:
    try:
        job.emit(event)
    except RuntimeError as error:  # the event loop is gone: the server is shutting down
        raise _Cancelled from error
