"""A Hugging Face Hub on 127.0.0.1: local folders served as model repositories, for the real ``huggingface_hub``.

    with local_hub({"org/name": folder}) as hub:          # hub.url is the endpoint
        env = {**os.environ, "HF_ENDPOINT": hub.url}       # `llmtrain download org/name` reads it
        ...
        hub.requests                                       # what the client asked, in order

It answers what ``snapshot_download`` (huggingface_hub 2.4) asks, and nothing else:

- ``GET /api/models/REPO[/revision/REV]``: the repository's info, its commit ``sha`` and ``siblings``;
- ``GET /api/models/REPO/tree/REV``: its files with size and git blob id (one page);
- ``HEAD|GET /REPO/resolve/REV/FILE``: the file, with ``X-Repo-Commit``, ``ETag`` (the content's sha256, as the Hub
  gives for LFS files), ``Content-Length`` and ``Accept-Ranges``; a ``Range: bytes=N-`` request gets 206.

No Xet headers are sent, so the client downloads over plain HTTP. The switches:

- ``gated``: repositories whose files answer 401 (no token) or 403 (a token not in ``tokens``) with
  ``X-Error-Code: GatedRepo``, as the Hub does; their info stays public, with ``"gated": "manual"``.
- ``drop_once``: file names whose first GET sends half the body and closes the connection.
- ``hold``: file names whose GETs send half the body and then wait until ``hub.release()`` (``hub.held`` is set
  when one is waiting): a download to interrupt at a known point.

An unknown repository answers 404 with ``X-Error-Code: RepoNotFound``, a missing file 404 ``EntryNotFound``.

``write_tiny_llama(folder)`` writes what such a repository holds for a model: a random 2-layer Llama saved by
transformers (safetensors), a byte-level BPE tokenizer and a chat template.
"""

from __future__ import annotations

import hashlib
import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterable, Iterator, Optional
from urllib.parse import unquote, urlsplit


@dataclass
class Request:
    method: str
    path: str
    range: Optional[str]
    authorization: Optional[str]


@dataclass
class _Repo:
    root: Path
    files: dict[str, bytes]
    sha: str

    @classmethod
    def read(cls, root: Path) -> "_Repo":
        files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}
        digest = hashlib.sha1()
        for name, data in files.items():
            digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
        return cls(Path(root), files, digest.hexdigest())


@dataclass
class LocalHub:
    """A running hub: ``url`` is the endpoint to give huggingface_hub (``HF_ENDPOINT``)."""

    url: str
    repos: dict[str, _Repo]
    gated: set[str]
    tokens: set[str]
    drop_once: set[str]
    hold: set[str]
    requests: list[Request] = field(default_factory=list)
    held: threading.Event = field(default_factory=threading.Event)
    _released: threading.Event = field(default_factory=threading.Event)
    _dropped: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __str__(self) -> str:
        return self.url

    def release(self) -> None:
        """Let the held downloads go on (their clients may have gone)."""
        self._released.set()

    def gets(self, name: Optional[str] = None) -> list[Request]:
        """The GETs of files (``/resolve/``), of file ``name`` alone if given."""
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path
                and (name is None or r.path.endswith(f"/{name}"))]


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _handler(hub: LocalHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args) -> None:  # quiet: the requests are recorded instead
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            with hub._lock:
                hub.requests.append(Request(self.command, path, self.headers.get("Range"),
                                            self.headers.get("Authorization")))
            if path.startswith("/api/models/"):
                return self._api(path.removeprefix("/api/models/"))
            if "/resolve/" in path:
                repo_id, _, rest = path.lstrip("/").partition("/resolve/")
                _revision, _, name = rest.partition("/")
                return self._file(repo_id, name, body)
            self._json(404, {"error": "not found"})

        def _api(self, rest: str) -> None:
            parts = rest.split("/")
            repo_id, tail = "/".join(parts[:2]), parts[2:]
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._json(404, {"error": "Repository not found"}, error_code="RepoNotFound")
            if tail and tail[0] == "tree":
                return self._json(200, [{"type": "file", "path": name, "size": len(data), "oid": _git_blob_id(data)}
                                        for name, data in repo.files.items()])
            self._json(200, {"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                             "gated": "manual" if repo_id in hub.gated else False, "tags": [],
                             "siblings": [{"rfilename": name} for name in repo.files]})

        def _file(self, repo_id: str, name: str, body: bool) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._json(404, {"error": "Repository not found"}, error_code="RepoNotFound")
            if repo_id in hub.gated:
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
                if token not in hub.tokens:
                    return self._json(403 if token else 401, {"error": f"Access to model {repo_id} is restricted"},
                                      error_code="GatedRepo")
            data = repo.files.get(name)
            if data is None:
                return self._json(404, {"error": "Entry not found"}, error_code="EntryNotFound",
                                  extra={"X-Repo-Commit": repo.sha})
            start = 0
            asked = self.headers.get("Range")
            if body and asked and asked.startswith("bytes=") and asked.endswith("-"):
                start = int(asked.removeprefix("bytes=").removesuffix("-"))
            part = data[start:]
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", repo.sha)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(part)))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            with hub._lock:
                drop = name in hub.drop_once and name not in hub._dropped
                if drop:
                    hub._dropped.add(name)
            if drop or name in hub.hold:
                self.wfile.write(part[:len(part) // 2])
                self.wfile.flush()
                if name in hub.hold:
                    hub.held.set()
                    hub._released.wait(timeout=120)
                self.close_connection = True
                return
            self.wfile.write(part)

        def _json(self, status: int, value, error_code: Optional[str] = None, extra: Optional[dict] = None) -> None:
            payload = json.dumps(value).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            if error_code:
                self.send_header("X-Error-Code", error_code)
                self.send_header("X-Error-Message", value.get("error", ""))
            for key, text in (extra or {}).items():
                self.send_header(key, text)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

    return Handler


@contextmanager
def local_hub(repos: dict[str, Path], *, gated: Iterable[str] = (), tokens: Iterable[str] = ("hf_test_token",),
              drop_once: Iterable[str] = (), hold: Iterable[str] = ()) -> Iterator[LocalHub]:
    """Serve each folder of ``repos`` (repo id -> folder, read once now) as a model repository on 127.0.0.1."""
    hub = LocalHub("", {repo_id: _Repo.read(root) for repo_id, root in repos.items()}, set(gated), set(tokens),
                   set(drop_once), set(hold))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    server.handle_error = lambda request, address: None  # a client that went away mid-file (a killed download)
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="local-hub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.release()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def write_tiny_llama(root: Path) -> Path:
    """A transformers folder as the Hub holds one: a random 2-layer Llama (safetensors, config.json,
    generation_config.json), a tokenizer trained on a line of text, and a chat template."""
    import torch
    import transformers

    from llmtrain.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(iter(["the cat sat on the mat. a dog ran far away."] * 50), vocab_size=300,
                                    out_dir=root)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                      bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    transformers.LlamaForCausalLM(config).save_pretrained(root, safe_serialization=True)
    (root / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return root
