"""The requests ``llmtrain serve`` accepts, as pydantic models of OpenAI's API, and the bodies it answers with.

A field OpenAI has and llmtrain does not implement (n > 1, penalties, logprobs, echo, tools) is refused with a
400 that names it, rather than ignored: a client would otherwise believe it took effect. Types are strict (a
string is not a number), as OpenAI's own API is.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4
"""OpenAI's limit on `stop`."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    """Send a last chunk with the usage counts (and no choices) before ``data: [DONE]``."""


class Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    """Most tokens to generate; default and upper bound: the server's --max_new_tokens."""
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=1)
    """Not OpenAI's: sample among the k most likely tokens only."""
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=0, le=2**64 - 1)
    """The sampler's seed (torch.Generator's range); default: a random one per request."""
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"only n=1 is supported (one choice per request), got {value}; send {value} requests")
        return value

    @field_validator("presence_penalty", "frequency_penalty", "logprobs", "echo", check_fields=False)
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        """OpenAI's fields that llmtrain does not implement are accepted only at their defaults (0, false, null)."""
        if value:
            raise ValueError(f"not supported by llmtrain serve, got {value!r}; leave it out")
        return value

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value: Union[str, list[str], None]) -> Union[str, list[str], None]:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        return value

    def stop_texts(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(Sampling):
    """POST /v1/completions: the prompt is given to the model as it is (no prompt style)."""

    prompt: Union[str, list[str]]
    logprobs: Optional[int] = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Union[str, list[str]]) -> Union[str, list[str]]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"one prompt per request (a string, or a list of one), got a list of {len(value)}")
        return value

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    """developer is OpenAI's newer name for system."""
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def as_message(self) -> dict[str, str]:
        """The message as llmtrain's prompt styles take it."""
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(Sampling):
    """POST /v1/chat/completions: the messages are written out in the model's prompt style."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    """OpenAI's newer name for max_tokens."""
    logprobs: bool = False


# ------------------------------------------------------------------------------------------ answers
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class Answer:
    """The bodies of one request's answer, whole or as stream chunks, for either endpoint."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _body(self, object: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def whole(self, text: str, finish_reason: str, counts: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._body(self.object, [choice], usage=counts)

    def chunk(self, text: Optional[str] = None, finish_reason: Optional[str] = None, first: bool = False) -> dict:
        """A stream chunk: a piece of text, or (text None) the last one with the finish reason."""
        if not self.chat:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            return self._body(self.object, [choice])
        delta: dict = {"role": "assistant", "content": ""} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._body("chat.completion.chunk", [choice])

    def usage_chunk(self, counts: dict) -> dict:
        return self._body("chat.completion.chunk" if self.chat else self.object, [], usage=counts)
