"""``llmtrain serve``: a model directory behind an HTTP server with OpenAI's API.

Endpoints: ``POST /v1/completions`` (the prompt as it is), ``POST /v1/chat/completions`` (the messages in the
model's prompt style, as ``llmtrain chat`` writes them), both streaming as server-sent events with
``"stream": true``; ``GET /v1/models`` and ``GET /health`` (``{"status": "ok", "pending": N}``, N the requests
queued or generating). Any OpenAI client works with ``base_url=http://HOST:PORT/v1``. Greedy answers
(``temperature`` 0) equal ``llmtrain generate``'s (``--raw`` for completions).

Built on FastAPI and uvicorn, not LitServe (LitGPT's choice): they are the most widely used and kept Python web
stack, they give server-sent events (a streaming response) and request validation (pydantic) directly, and one
model answering from one worker thread needs no multi-worker batching framework on top.

- `engine`: the model and the worker thread that generates, one request after another.
- `schema`: the requests (pydantic models of OpenAI's fields) and the answers' bodies.
- `app`: the FastAPI app: endpoints, errors as OpenAI's error object, streaming.
- `setup`: the command line. FastAPI and uvicorn are imported only here, when serving (the extra ``serve``).
"""

from __future__ import annotations

import importlib.util
import signal
import socket
import sys
from pathlib import Path
from typing import Literal, Optional

from llmtrain.convert.hf import ensure_model_dir
from llmtrain.model_dir import check_model_dir
from llmtrain.precision import PrecisionName
from llmtrain.quantize import QuantizeMode

GRACEFUL_SHUTDOWN_S = 10
"""How long SIGTERM waits for the answers in progress before the server stops anyway."""


def setup(
    checkpoint_dir: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: Optional[str] = None,
    max_new_tokens: int = 512,
    quantize: Optional[QuantizeMode] = None,
    precision: Optional[PrecisionName] = None,
    accelerator: Literal["auto", "cpu", "cuda"] = "auto",
) -> None:
    """Serve a model directory (e.g. `out/finetune/lora/final`) over HTTP with OpenAI's API, until SIGTERM or Ctrl-C.

    Prints "serving MODEL at http://HOST:PORT/v1" on stderr once it answers.

    Args:
        checkpoint_dir: Model directory with model.safetensors, model_config.yaml and tokenizer.json, or a
            transformers folder (e.g. from `llmtrain download`).
        host: Address to listen on: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface).
        port: Port to listen on; 0 picks a free one (the line "serving ... at" says which).
        model_name: The model's id in the API (the requests' "model"). Default: the directory's name.
        max_new_tokens: Most tokens per answer: a request's max_tokens default and its cap.
        quantize: Quantize the transformer blocks' weights with bitsandbytes (4-bit NF4/FP4, -dq for
            double quantization, or int8) to save memory.
        precision: auto, 32-true, bf16-true, 16-true, bf16-mixed or 16-mixed. Default (auto): bf16-true on a GPU
            that supports it, else 32-true.
        accelerator: Where to run: auto (GPU if there is one), cpu or cuda.
    """
    given = Path(checkpoint_dir)
    if max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be at least 1, got {max_new_tokens}")
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (0: any free port), got {port}")
    # A transformers folder (a download) is converted once and cached; the API names it by the folder given.
    checkpoint_dir = check_model_dir(ensure_model_dir(given))
    name = model_name if model_name is not None else given.resolve().name
    if not name.strip():
        raise ValueError("--model_name must not be empty; leave it out to use the directory's name")
    missing = [package for package in ("fastapi", "uvicorn") if importlib.util.find_spec(package) is None]
    if missing:
        raise ValueError(f"llmtrain serve needs {' and '.join(missing)}, which is not installed; install the serve "
                         "extra: pip install 'llmtrain[serve]'")
    # The port before the weights: a taken port is said at once, not after minutes of loading.
    listener = listen(host, port)
    from llmtrain.generate import load_for_generation
    from llmtrain.serve.app import build_app
    from llmtrain.serve.engine import Engine

    loaded = load_for_generation(checkpoint_dir, quantize=quantize, precision=precision, accelerator=accelerator)
    engine = Engine(loaded)
    try:
        serve(build_app(engine, name, max_new_tokens), listener, name)
    finally:
        engine.close()
    print("stopped serving", file=sys.stderr)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` (reusing a port in TIME_WAIT), or an OSError saying which flag to change."""
    try:
        return socket.create_server((host, port), family=_family(host), backlog=2048)
    except socket.gaierror as error:
        raise OSError(f"--host {host}: not an address of this machine ({error.strerror}); pass 127.0.0.1 or "
                      "0.0.0.0") from error
    except OSError as error:
        raise OSError(f"--host {host} --port {port}: cannot listen there ({error.strerror}); pick another --port, or "
                      "--port 0 for any free one") from error


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def url(listener: socket.socket) -> str:
    host, port = listener.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def serve(app, listener: socket.socket, name: str) -> None:
    """Run `app` on `listener` with uvicorn until SIGTERM or Ctrl-C, then return (the process exits 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                print(f"serving {name} at {url(listener)}", file=sys.stderr, flush=True)

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    # NOTE: uvicorn stops gracefully on SIGTERM and SIGINT, then raises the signal again for the handler it found
    # installed; a handler that ignores it lets this function return, so a requested stop exits 0 (Ctrl-C
    # would otherwise be reported as an interrupted training run).
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        Server(config).run(sockets=[listener])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        listener.close()
