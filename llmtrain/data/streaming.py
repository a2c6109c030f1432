"""Train on a Hugging Face dataset as it streams: each rank reads its own part and tokenizes as it goes.

Nothing is tokenized up front. A background thread reads this rank's rows, encodes them in chunks of
about STREAM_CHUNK_CHARS characters exactly as the token cache does (`llmtrain.data.tokens`), and packs
the token stream into windows of max_seq_length + 1 tokens, each sharing its first token with the end of
the one before, as `TokenWindows` cuts a cached stream. Memory holds one chunk and a few micro-batches.

The position is exact. A chunk starts at a state of the source (the IterableDataset's ``state_dict()``:
the shard and the row within it), so a window is named by that state, the tokens carried over from before
the chunk (fewer than a window's) and how many windows of the chunk came before it. A restored stream
re-reads and re-encodes at most one chunk, then hands out the very next window. Each rank's position is
its own: the loader says so (`state_per_rank`), and the checkpointer saves every rank's.

Rows come in the source's order, pass after pass, with no shuffling: a shuffle buffer's contents would be
lost at a resume. Shuffle the shards when they are written.
"""

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from llmtrain.data.base import Batch
from llmtrain.data.tokens import Piece, document_pieces, encode_pieces
from llmtrain.tokenizer import Tokenizer

STREAM_CHUNK_CHARS = 1_000_000
"""Characters encoded at a time: what a resume re-encodes at most, and the latency of the first window."""


@dataclass(frozen=True)
class StreamPosition:
    """Where a rank's stream stands: the next window is the one after these."""

    source: Optional[dict] = None
    """The source's state_dict() where the current chunk begins; None: at the start of a pass."""
    carry: tuple[int, ...] = ()
    """Tokens from before the chunk that no finished window has used up (the next window starts with them)."""
    windows: int = 0
    """Windows of (carry + the chunk's tokens) handed out already."""
    passes: int = 0
    """Complete passes over this rank's part."""

    def to_dict(self) -> dict:
        """Plain values only: ``torch.load(weights_only=True)`` reads them back."""
        return {"source": self.source, "carry": list(self.carry), "windows": self.windows, "passes": self.passes}

    @classmethod
    def from_dict(cls, state: dict) -> "StreamPosition":
        return cls(state["source"], tuple(int(t) for t in state["carry"]), int(state["windows"]), int(state["passes"]))


def stream_windows(open_part: Callable[[], Any], text_field: str, tokenizer: Tokenizer, max_seq_length: int,
                   start: StreamPosition = StreamPosition(), endless: bool = True,
                   name: str = "the stream") -> Iterator[tuple[np.ndarray, StreamPosition]]:
    """(window of max_seq_length + 1 token ids, the position after it) from the IterableDataset that
    ``open_part()`` returns.

    ``endless``: start another pass at the end of one (the windows run on across the seam, as epochs of a
    cached stream do); otherwise stop after the pass ``start`` is in. ``name`` says what the part is in errors.
    """
    length = max_seq_length
    position = start
    while True:
        # NOTE: a fresh dataset object per pass, in its epoch 0: set_epoch() reorders the shards even unshuffled,
        # and a state restored into an object would apply again to its next pass.
        part = open_part()
        if position.source is not None:
            part.load_state_dict(position.source)
        carry = np.asarray(position.carry, dtype=np.int64)
        skip, found_text = position.windows, False
        for chunk_start, chunk in _chunks(part, text_field, position.source, name):
            found_text = True
            tokens = np.concatenate([carry, encode_pieces(tokenizer, chunk)[0]])
            count = max(0, (len(tokens) - 1) // length)
            carried = tuple(carry.tolist())
            for index in range(skip, count):
                yield tokens[index * length : index * length + length + 1], \
                    StreamPosition(chunk_start, carried, index + 1, position.passes)
            carry, skip = tokens[count * length :], 0
        if position.source is None and not found_text:
            raise ValueError(f"{name} has no text: it holds no rows, or only empty ones. Check --data.path, "
                             "--data.data_files and --data.text_field, or use fewer data-parallel ranks than the "
                             "source has rows")
        position = StreamPosition(None, tuple(carry.tolist()), 0, position.passes + 1)
        if not endless:
            return


def _chunks(part: Any, text_field: str, first_state: Optional[dict],
            name: str) -> Iterator[tuple[Optional[dict], list[Piece]]]:
    """(the source's state where a chunk begins, the chunk's pieces), chunks of about STREAM_CHUNK_CHARS
    characters that end with a document. The first chunk begins at ``first_state``."""
    chunk: list[Piece] = []
    size = 0
    chunk_start = first_state
    for row in part:
        if text_field not in row:
            raise ValueError(f"--data.text_field {text_field!r} is not a column of {name}; its columns are "
                             f"{sorted(row)}. Pass --data.text_field with one of them.")
        text = row[text_field]
        if text:  # empty and missing values are not documents
            for piece in document_pieces(text):
                chunk.append(piece)
                size += len(piece.text)
        if size >= STREAM_CHUNK_CHARS:
            yield chunk_start, chunk
            chunk, size = [], 0
            chunk_start = part.state_dict()  # after the chunk's last row: where the next chunk begins
    if chunk:
        yield chunk_start, chunk


def windows_batch(windows: list[np.ndarray]) -> Batch:
    rows = torch.from_numpy(np.stack(windows).astype(np.int64))  # (B, L + 1)
    return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}


class _Failed:
    """An error of the producing thread, to raise where the batches are taken."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class StreamingLoader:
    """Infinite, resumable iterator over this rank's micro-batches of a streamed dataset.

    ``open_windows(position)`` gives this rank's windows from ``position`` (`stream_windows`). A thread
    makes the next ``prefetch`` micro-batches; the position a checkpoint saves is that after the last
    window handed out, never after those made ahead. ``samples_consumed`` counts global samples, as
    `TrainLoader`'s does, but the position is each rank's own, and the number of samples in a pass is
    unknown (``samples_per_epoch`` None: --train.epochs cannot size the run).
    """

    state_per_rank = True
    """Every rank's state_dict() differs: the checkpointer gathers them all (see `load_state_dict`)."""
    samples_per_epoch = None
    prefetch = 4
    """Micro-batches made ahead."""
    pin_memory = False
    """Pin made batches in page-locked memory; the training loop sets it when it trains on CUDA."""

    def __init__(self, open_windows: Callable[[StreamPosition], Iterator[tuple[np.ndarray, StreamPosition]]],
                 micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        self.open_windows = open_windows
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.samples_consumed = 0
        self.position = StreamPosition()
        self._made: Optional[queue.Queue] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def epoch(self) -> float:
        """Complete passes over this rank's part (a pass's length is unknown until it ends)."""
        return float(self.position.passes)

    def __iter__(self) -> "StreamingLoader":
        return self

    def __next__(self) -> Batch:
        if self._thread is None:
            self._start()
        assert self._made is not None
        item = self._made.get()
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        batch, self.position = item
        self.samples_consumed += self.dp_size * self.micro_batch_size
        return batch

    def _start(self) -> None:
        self._stop = threading.Event()
        self._made = queue.Queue(maxsize=max(1, self.prefetch))
        # NOTE: the thread holds no reference to the loader, so a loader that is dropped unclosed is collected,
        # and __del__ stops its thread.
        self._thread = threading.Thread(
            target=_make_batches, name="llmtrain-stream", daemon=True,
            args=(self.open_windows(self.position), self.micro_batch_size, self.pin_memory, self._made, self._stop))
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (it finishes the chunk it encodes) and drop the batches made ahead."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=60)
        self._thread, self._made = None, None

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is not None:  # not after an __init__ that raised
            self._stop.set()

    def state_dict(self) -> dict:
        return {"streaming": 1, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "samples_consumed": self.samples_consumed, "position": self.position.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        """This rank's entry of a checkpoint's ``{"per_rank": [state_dict() of every rank]}``."""
        check_stream_resume(state, streaming=True, data_parallel_size=self.dp_size)
        mine = next(entry for entry in state["per_rank"] if entry["dp_rank"] == self.dp_rank)
        self.close()
        self.samples_consumed = int(mine["samples_consumed"])
        self.position = StreamPosition.from_dict(mine["position"])


def check_stream_resume(data_state: dict, *, streaming: bool, data_parallel_size: int,
                        checkpoint: str = "the checkpoint") -> None:
    """That a run streaming its data or not (``streaming``) on ``data_parallel_size`` ranks can continue from a
    checkpoint's data position (``training_state.pt``'s ``data``). Called before the workers start, and again
    as the position loads."""
    saved_streaming = "per_rank" in data_state
    if saved_streaming != streaming:
        raise ValueError(
            f"Cannot resume the data position: {checkpoint} was written by a run that "
            f"{'streamed' if saved_streaming else 'did not stream'} its data, this one "
            f"{'does' if streaming else 'does not'}. Resume with the data flags that wrote it "
            f"(--data.streaming {str(saved_streaming).lower()}), or start without resuming.")
    if not streaming:
        return
    saved_size = data_state["per_rank"][0]["dp_size"]
    if saved_size != data_parallel_size:
        raise ValueError(
            f"Cannot resume the data position: {checkpoint} streamed on {saved_size} data-parallel ranks, this "
            f"run has {data_parallel_size}. Each rank's place in its own part of the stream is saved, and the "
            f"parts change with their number: resume on {saved_size} data-parallel ranks (--devices, --num_nodes), "
            "or start without resuming.")


def _make_batches(windows: Iterator[tuple[np.ndarray, StreamPosition]], micro_batch_size: int, pin_memory: bool,
                  made: queue.Queue, stop: threading.Event) -> None:
    """The loader's thread: (micro-batch, the position after it) into ``made`` until ``stop`` is set."""
    try:
        rows: list[np.ndarray] = []
        for window, position in windows:
            rows.append(window)
            if len(rows) < micro_batch_size:
                continue
            batch = windows_batch(rows)
            if pin_memory:
                batch = {key: value.pin_memory() for key, value in batch.items()}
            rows = []
            if not _put(made, (batch, position), stop):
                return
    except BaseException as error:  # noqa: BLE001 - handed to the training thread, which raises it
        _put(made, _Failed(error), stop)


def _put(made: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item`` once there is room; False if the loader was closed first."""
    while not stop.is_set():
        try:
            made.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


class StreamingValLoader:
    """The first windows of a streamed validation split; every `iter()` starts over.

    Every rank reads the same split from its start; rank r takes windows r, r + dp_size, r + 2·dp_size, …,
    so all ranks agree where the split ends and run the same number of forward passes. Windows are read
    only as far as the evaluation asks (--eval.max_iters micro-batches) and kept for the next evaluation.
    """

    def __init__(self, open_windows: Callable[[], Iterator[np.ndarray]], micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1) -> None:
        self.open_windows = open_windows
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self._mine: list[np.ndarray] = []
        self._stream: Optional[Iterator[np.ndarray]] = None
        self._ended = False

    def __iter__(self) -> Iterator[Batch]:
        index = 0
        while True:
            windows = []
            while len(windows) < self.micro_batch_size and self._has(index):
                windows.append(self._mine[index])
                index += 1
            if windows:
                yield windows_batch(windows)
            if len(windows) < self.micro_batch_size:
                return

    def _has(self, index: int) -> bool:
        """Whether this rank has an ``index``-th window, reading one more round of windows if needed."""
        if index < len(self._mine):
            return True
        if self._ended:
            return False
        if self._stream is None:
            self._stream = self.open_windows()
        round_of_windows = [window for _, window in zip(range(self.dp_size), self._stream)]
        if len(round_of_windows) < self.dp_size:  # the tail that would leave some rank without one
            self._ended, self._stream = True, None
            return False
        self._mine.append(round_of_windows[self.dp_rank])
        return True
