"""The HTTP side of ``llmtrain serve``: a FastAPI app with OpenAI's endpoints over an `Engine`.

Each request is read and checked here, on the event loop (a bad one is answered at once with OpenAI's error
object and a 4xx), tokenized, and handed to the engine's worker as a `Job`; its events come back through an
asyncio queue and become one JSON answer or server-sent events (``data: {chunk}`` ... ``data: [DONE]``).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from llmtrain.generate import PromptTooLongError, check_prompt_fits
from llmtrain.serve.engine import Engine, Finished, Job
from llmtrain.serve.schema import Answer, ChatRequest, CompletionRequest, Sampling, error_body, usage


class ApiError(Exception):
    """A request the server refuses: answered with OpenAI's error object and `status`."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.type, self.param, self.code), status_code=self.status)


def build_app(engine: Engine, model_name: str, max_new_tokens: int) -> FastAPI:
    """The app serving `engine`'s model as `model_name`; a request's max_tokens is capped at `max_new_tokens`."""
    app = FastAPI(title="llmtrain serve")
    created = int(time.time())
    model, tokenizer, prompt_style, _, _ = engine.loaded

    @app.exception_handler(ApiError)
    async def _refused(_: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, error: HTTPException) -> JSONResponse:
        return ApiError(error.status_code, str(error.detail), code=str(error.status_code)).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error(error.errors()).response()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "pending": engine.pending}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(model_name, created)]}

    @app.get("/v1/models/{name:path}")
    async def model_card(name: str) -> dict:
        _check_model(name, model_name)
        return _model_card(model_name, created)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = _parse(CompletionRequest, await request.body())
        _check_model(body.model, model_name)
        prompt_ids = _prompt_ids(tokenizer.encode(body.text()), model, "prompt")
        return await _answer(engine, body, prompt_ids, (), Answer(chat=False, model=model_name), max_new_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = _parse(ChatRequest, await request.body())
        _check_model(body.model, model_name)
        try:
            text = prompt_style.apply([message.as_message() for message in body.messages])
        except ValueError as error:  # roles out of order, no user message
            raise ApiError(400, f"messages: {error}", param="messages") from error
        prompt_ids = _prompt_ids(tokenizer.encode(text), model, "messages")
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await _answer(engine, body, prompt_ids, prompt_style.stop_tokens(tokenizer),
                             Answer(chat=True, model=model_name), max_new_tokens)

    return app


def _model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "llmtrain"}


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ApiError(404, f"The model {requested!r} does not exist: this server serves {served!r} (GET /v1/models)",
                       param="model", code="model_not_found")


def _parse(schema: type[Sampling], raw: bytes) -> Any:
    try:
        return schema.model_validate_json(raw)
    except ValidationError as error:
        raise _validation_error(error.errors()) from error


def _validation_error(errors: list[dict]) -> ApiError:
    """The first of pydantic's errors as one line naming the field, as OpenAI's API says it."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"The request body is not valid JSON ({first['ctx'].get('error', first['msg'])}); send "
                        "a JSON object", code="invalid_json")
    location = [str(part) for part in first["loc"] if part != "body"]
    # A field of a Union (prompt: str | list[str]) is located as prompt.str, prompt.list[str]: keep the field.
    param = ".".join(part for part in location if not part.startswith(("str", "list[", "function-")))
    if first["type"] == "model_type" or not param:
        return ApiError(400, "The request body must be a JSON object with the endpoint's fields (OpenAI's API)")
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown or unsupported field"
    elif first["type"] == "missing":
        message = "this field is required"
    elif "input" in first and first["type"] != "value_error":  # llmtrain's own messages say what they got
        message += f" (got {json.dumps(first['input'], default=str)[:80]})"
    return ApiError(400, f"{param}: {message}", param=param)


def _prompt_ids(ids: list[int], model: Any, param: str) -> list[int]:
    if not ids:
        raise ApiError(400, f"{param}: the prompt is empty", param=param)
    try:
        check_prompt_fits(len(ids), model.config, model.max_seq_length)
    except PromptTooLongError as error:
        raise ApiError(400, str(error), param=param, code="context_length_exceeded") from error
    return ids


async def _answer(engine: Engine, body: Sampling, prompt_ids: list[int], stop_tokens: tuple[list[int], ...],
                  answer: Answer, cap: int) -> Union[dict, StreamingResponse]:
    """Queue the job; the whole answer, or a stream of its chunks."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    max_tokens = cap if body.max_tokens is None else min(body.max_tokens, cap)
    job = Job(prompt_ids, max_tokens, emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
              temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed,
              stop_tokens=stop_tokens, stop_texts=body.stop_texts())
    engine.submit(job)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_stream(job, events, answer, include_usage), media_type="text/event-stream")
    pieces = []
    try:
        while isinstance(event := await events.get(), str):
            pieces.append(event)
    finally:
        job.cancelled.set()  # a no-op once it finished; stops it if this handler was cancelled
    if isinstance(event, BaseException):
        raise ApiError(500, f"generation failed: {type(event).__name__}: {event}", type="server_error")
    return answer.whole("".join(pieces), event.finish_reason, usage(event.prompt_tokens, event.completion_tokens))


async def _stream(job: Job, events: asyncio.Queue, answer: Answer, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of text, the finishing chunk, the usage if asked, then [DONE].

    A client that goes away closes this generator, which stops the job at its next token."""
    try:
        if answer.chat:
            yield _event(answer.chunk(first=True))
        while isinstance(event := await events.get(), str):
            yield _event(answer.chunk(event))
        if isinstance(event, Finished):
            yield _event(answer.chunk(finish_reason=event.finish_reason))
            if include_usage:
                yield _event(answer.usage_chunk(usage(event.prompt_tokens, event.completion_tokens)))
        else:
            yield _event(error_body(f"generation failed: {type(event).__name__}: {event}", "server_error"))
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
