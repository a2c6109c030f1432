"""Tokenize documents once into a memory-mapped token file, cached by content.

A cache entry is two files under ``cache_dir()/tokens``: ``<key>.bin`` (the raw token ids,
uint16 or uint32) and ``<key>.json`` (dtype, counts). Both are written under temporary
names and renamed into place, the .json last, so a reader that finds the .json finds a
complete .bin beside it, even while another process is still tokenizing.
"""

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np

from llmtrain.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
"""Bump when the layout of cache entries changes, so stale entries are never read."""
CHUNK_CHARS = 4_000_000
"""Characters per unit of tokenization work: large enough to amortize overhead, small enough to bound memory."""
PIECE_CHARS = 1_000_000
"""Long documents are encoded in line-aligned pieces of about this many characters."""
PROCESS_POOL_MIN_CHARS = 64_000_000
"""Below this much text a process pool costs more than it saves (tokenizers' threads already use every core)."""


def cache_dir() -> Path:
    """Where tokenized data and built-in tokenizers are cached: $LLMTRAIN_CACHE_DIR or ~/.cache/llmtrain."""
    configured = os.environ.get("LLMTRAIN_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "llmtrain"


def available_cpu_count() -> int:
    """CPU cores this process may use (respects SLURM/cgroup affinity, unlike os.cpu_count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity masks
        return os.cpu_count() or 1


def cache_key(*parts: object) -> str:
    """A short stable hash of JSON-serializable parts."""
    payload = json.dumps([CACHE_FORMAT_VERSION, *parts], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Piece:
    """Part of a document: text, and whether the document starts or ends with it."""

    text: str
    starts_document: bool = True
    ends_document: bool = True


def whole_documents(documents: Iterable[str]) -> Iterator[Piece]:
    for text in documents:
        yield Piece(text)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def cached_token_file(key: str) -> Optional[Path]:
    """The .bin file of a complete cache entry, or None."""
    bin_path = cache_dir() / "tokens" / f"{key}.bin"
    return bin_path if bin_path.with_suffix(".json").is_file() and bin_path.is_file() else None


def tokenize_to_cache(
    pieces: Iterable[Piece],
    tokenizer: Tokenizer,
    key: str,
    num_workers: int = 1,
    total_chars: Optional[int] = None,
    description: str = "",
) -> Path:
    """Tokenize `pieces` into cache entry `key` unless it exists; return the .bin path.

    Each document gets the tokenizer's default bos in front and eos after it. `pieces` is
    consumed only on a cache miss, so callers pass lazy generators.
    """
    existing = cached_token_file(key)
    if existing is not None:
        return existing
    bin_path = cache_dir() / "tokens" / f"{key}.bin"
    with exclusive_lock(bin_path.with_suffix(".lock")):
        existing = cached_token_file(key)  # another process may have finished while we waited
        if existing is not None:
            return existing
        return _tokenize(pieces, tokenizer, bin_path, num_workers, total_chars, description)


def _tokenize(
    pieces: Iterable[Piece], tokenizer: Tokenizer, bin_path: Path, num_workers: int,
    total_chars: Optional[int], description: str,
) -> Path:
    if total_chars is not None and total_chars < PROCESS_POOL_MIN_CHARS:
        num_workers = 1
    log.info("Tokenizing %s into %s", description or bin_path.stem, bin_path)
    start = time.perf_counter()
    dtype = token_dtype(tokenizer.vocab_size)
    temp_bin = _temp_name(bin_path)
    num_tokens = num_documents = 0
    try:
        with open(temp_bin, "wb") as f:
            for ids, documents in _encode_chunks(chunk_pieces(pieces), tokenizer, num_workers):
                f.write(ids.astype(dtype, copy=False).tobytes())
                num_tokens += len(ids)
                num_documents += documents
        os.replace(temp_bin, bin_path)
    finally:
        if temp_bin.exists():
            temp_bin.unlink()
    meta = {
        "dtype": dtype.name, "num_tokens": num_tokens, "num_documents": num_documents,
        "tokenizer": tokenizer.fingerprint, "source": description,
    }
    temp_meta = _temp_name(bin_path.with_suffix(".json"))
    temp_meta.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(temp_meta, bin_path.with_suffix(".json"))
    log.info("Tokenized %d documents into %d tokens in %.1fs", num_documents, num_tokens, time.perf_counter() - start)
    return bin_path


def open_tokens(bin_path: Path) -> np.ndarray:
    """Memory-map a cached token file (read-only)."""
    meta = json.loads(bin_path.with_suffix(".json").read_text())
    dtype = np.dtype(meta["dtype"])
    expected_bytes = meta["num_tokens"] * dtype.itemsize
    actual_bytes = bin_path.stat().st_size
    if actual_bytes != expected_bytes:
        raise ValueError(
            f"Token cache file {bin_path} has {actual_bytes} bytes, expected {expected_bytes}; "
            f"it is damaged. Delete it (and {bin_path.with_suffix('.json').name}) to re-tokenize."
        )
    if meta["num_tokens"] == 0:  # numpy cannot memory-map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(bin_path, dtype=dtype, mode="r")


def token_file_info(bin_path: Path) -> dict:
    return json.loads(bin_path.with_suffix(".json").read_text())


def document_pieces(text: str) -> Iterator[Piece]:
    """A document as one piece, or as several when it is long (one book in one row, say)."""
    if len(text) <= PIECE_CHARS:
        yield Piece(text)
    else:
        yield from split_lines(text.splitlines(keepends=True))


def split_lines(text_lines: Iterable[str]) -> Iterator[Piece]:
    """One document from its lines, cut into pieces of about PIECE_CHARS at line ends.

    NOTE: cutting only at line ends keeps words whole, so the ids match those of encoding
    the document in one go, except possibly for runs of blank lines at a cut.
    """
    buffer: list[str] = []
    size = 0
    first = True
    for line in text_lines:
        buffer.append(line)
        size += len(line)
        if size >= PIECE_CHARS:
            yield Piece("".join(buffer), starts_document=first, ends_document=False)
            buffer, size, first = [], 0, False
    yield Piece("".join(buffer), starts_document=first, ends_document=True)


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an advisory lock on `path`, so processes on a node do expensive work once.

    Correctness never depends on it (every write is atomic); it only saves repeated work.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks, only duplicated work
        yield
        return
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # some shared filesystems (Lustre without -o flock) refuse locks
            log.debug("No lock on %s; processes may duplicate work", path)
        yield


def chunk_pieces(pieces: Iterable[Piece]) -> Iterator[list[Piece]]:
    """Consecutive pieces in lists of about CHUNK_CHARS characters: the units of one batch encode."""
    chunk: list[Piece] = []
    size = 0
    for piece in pieces:
        chunk.append(piece)
        size += len(piece.text)
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _encode_chunks(
    chunks: Iterable[list[Piece]], tokenizer: Tokenizer, num_workers: int
) -> Iterator[tuple[np.ndarray, int]]:
    """(token ids, documents ended) per chunk, in input order."""
    if num_workers <= 1:
        for chunk in chunks:
            yield encode_pieces(tokenizer, chunk)
        return
    # NOTE: spawn, not fork: the parent may hold threads (torch, NCCL, tokenizers' own pool),
    # and forking a threaded process can deadlock the child.
    context = multiprocessing.get_context("spawn")
    with context.Pool(num_workers, initializer=init_tokenizer_worker, initargs=(str(tokenizer.checkpoint_dir),)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            # Bound the work in flight so memory stays flat on corpora larger than RAM.
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def encode_pieces(tokenizer: Tokenizer, pieces: list[Piece]) -> tuple[np.ndarray, int]:
    """The token ids of ``pieces`` in one array, and how many documents they end.

    The one encoding of a document, shared by the token cache and ``llmtrain prepare_data``: the
    tokenizer's default bos in front of its first piece, eos after its last.
    """
    encoded = tokenizer.encode_batch([piece.text for piece in pieces], bos=False, eos=False)
    pieces_ids: list[np.ndarray] = []
    documents = 0
    for piece, ids in zip(pieces, encoded):
        # The tokenizer's own default decides about bos, and a text that already starts with it keeps one.
        if piece.starts_document and tokenizer.add_bos and (not ids or ids[0] != tokenizer.bos_id):
            ids = [tokenizer.bos_id] + ids
        if piece.ends_document:
            if tokenizer.eos_id is None:
                raise ValueError(
                    f"The tokenizer in {tokenizer.checkpoint_dir} has no eos token, which pretraining "
                    "needs to separate documents; set eos_token in its tokenizer_config.json"
                )
            ids.append(tokenizer.eos_id)
            documents += 1
        pieces_ids.append(np.asarray(ids, dtype=np.int64))
    ids = np.concatenate(pieces_ids) if pieces_ids else np.zeros(0, dtype=np.int64)
    return ids, documents


_worker_tokenizer: Optional[Tokenizer] = None


def init_tokenizer_worker(tokenizer_dir: str) -> None:
    """A pool process's initializer: load the tokenizer once, single-threaded."""
    global _worker_tokenizer
    # One thread per worker: the pool already supplies the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = Tokenizer(tokenizer_dir)


def worker_tokenizer() -> Tokenizer:
    """The tokenizer :func:`init_tokenizer_worker` loaded in this pool process."""
    assert _worker_tokenizer is not None, "worker was started without init_tokenizer_worker"
    return _worker_tokenizer


def _encode_in_worker(chunk: list[Piece]) -> tuple[np.ndarray, int]:
    return encode_pieces(worker_tokenizer(), chunk)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
