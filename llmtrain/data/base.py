"""The DataModule lifecycle, and the resumable loaders every module shares.

The training loop calls, in order:

    validate() → default_tokenizer() → connect(...) → prepare_data() → setup(dp_rank, dp_size)
    → train_dataloader() / val_dataloader()

A batch is ``{"input_ids": LongTensor (B, T), "labels": LongTensor (B, T)}``; labels are the
inputs shifted by one, and -100 marks positions that must not count in the loss. A padded batch also
has ``"real_tokens"``: a LongTensor () counting its input tokens that are not padding (what MFU counts:
:func:`llmtrain.flops.real_tokens`).
"""

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import MISSING, Field, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol

import numpy as np
import torch

from llmtrain.data.tokens import open_tokens
from llmtrain.loss import IGNORE_INDEX  # the label value the loss skips
from llmtrain.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llmtrain.data.units import WorkUnit

Batch = dict[str, torch.Tensor]

NOT_SOURCE_FLAGS = ("num_workers", "val_split_fraction")
"""Data module flags that change how the data is tokenized or split at training time, not its documents."""


class DataModule:
    """Base of every data module. Subclasses are dataclasses whose fields are the `--data.*` flags."""

    # Runtime state, set by connect(); class attributes so dataclass subclasses need no __init__ glue.
    tokenizer: Optional[Tokenizer] = None
    micro_batch_size: int = 1
    max_seq_length: int = -1
    seed: int = 42

    def validate(self) -> None:
        """Cheap checks (paths exist, folders not empty) before anything expensive is built."""

    def validate_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Cheap checks of the run's tokenizer against the data (a prepared folder's), before anything is launched."""

    def default_tokenizer(self) -> Optional[Tokenizer]:
        """The tokenizer this data ships with, or None if the user must pass --tokenizer_dir."""
        return None

    def connect(self, tokenizer: Tokenizer, micro_batch_size: int, max_seq_length: int, seed: int = 42) -> None:
        if micro_batch_size < 1 or max_seq_length < 1:
            raise ValueError(
                f"micro_batch_size ({micro_batch_size}) and max_seq_length ({max_seq_length}) must be at least 1"
            )
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        self.max_seq_length = max_seq_length
        self.seed = seed

    def prepare_data(self) -> None:
        """Expensive, cached work (tokenization). Idempotent; safe to run from several processes."""

    def uses_token_cache(self) -> bool:
        """Whether prepare_data() tokenizes into the token cache (``cache_dir()``), which nodes then must share."""
        return False

    def setup(self, dp_rank: int = 0, dp_size: int = 1) -> None:
        raise NotImplementedError

    def train_dataloader(self) -> "TrainLoader":
        raise NotImplementedError

    def val_dataloader(self) -> Optional["ValLoader"]:
        return None

    def _require_connected(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RuntimeError(f"{type(self).__name__}.connect(tokenizer, ...) must be called first")
        return self.tokenizer


class TokenWindows:
    """Sample i is tokens[i*L : i*L + L + 1] (L = max_seq_length): the inputs and, shifted, the labels."""

    def __init__(self, tokens: np.ndarray, max_seq_length: int) -> None:
        self.tokens = tokens
        self.max_seq_length = max_seq_length

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.max_seq_length)

    def batch(self, indices: np.ndarray) -> Batch:
        length = self.max_seq_length
        rows = np.stack([self.tokens[i * length : i * length + length + 1] for i in indices.tolist()])
        rows = torch.from_numpy(rows.astype(np.int64))  # (B, L + 1)
        return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}


class SampleOrder(Protocol):
    """Which sample each global position takes: a pure function of the position, so resuming needs only it."""

    samples_per_epoch: int
    identity: Optional[str]
    """Says what the order depends on beyond seed and size (kept in checkpoints and compared on resume); None for
    the plain permutation, whose checkpoints predate it."""

    def indices(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices at global positions (which may span an epoch boundary)."""

    def metrics(self, samples_consumed: int) -> dict[str, float]:
        """Numbers for the log about the first ``samples_consumed`` positions (none for most orders)."""


class PermutationOrder:
    """One permutation of every sample per epoch, seeded by (seed, epoch); in order without ``shuffle``.

    Memory is one index per sample: right for data that fits a cache file, not for billions of windows
    (:class:`llmtrain.data.prepared.ShardOrder` is).
    """

    identity = None

    def __init__(self, samples_per_epoch: int, seed: int, shuffle: bool = True) -> None:
        self.samples_per_epoch, self.seed, self.shuffle = samples_per_epoch, seed, shuffle
        self._orders: dict[int, np.ndarray] = {}

    def indices(self, positions: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(positions, self.samples_per_epoch)
        if not self.shuffle:
            return offsets
        indices = np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():
            mask = epochs == epoch
            indices[mask] = self._order(epoch)[offsets[mask]]
        return indices

    def metrics(self, samples_consumed: int) -> dict[str, float]:
        return {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            # Keep only the epochs a micro-step can still touch: the permutation of a big dataset is large.
            self._orders = {e: order for e, order in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.samples_per_epoch)
        return self._orders[epoch]


class TrainLoader:
    """Infinite, resumable iterator over this rank's training micro-batches.

    The position is one global counter, `samples_consumed`. Each micro-step takes the next
    dp_size × micro_batch_size samples of the global order; rank r gets the contiguous slice
    [r*B, (r+1)*B) of them. The global order maps each position to a sample (``order``, a
    :class:`SampleOrder`; by default one permutation of the samples per epoch, seeded by
    (seed, epoch)), and epochs follow one another without a seam. So the position means the
    same thing at any number of ranks, and a restored loader continues exactly.

    A background thread makes the next ``prefetch`` micro-batches while the current ones train
    (pinned when ``pin_memory`` is set, for an asynchronous copy to the GPU). A batch is a function of
    its position alone and ``samples_consumed`` counts only the batches handed out, so prefetching
    never moves the position a checkpoint saves.
    """

    prefetch = 2
    """Micro-batches made ahead (0: make each one when asked)."""
    pin_memory = False
    """Pin prefetched batches in page-locked memory; the training loop sets it when it trains on CUDA."""

    def __init__(
        self,
        num_samples: int,
        make_batch: Callable[[np.ndarray], Batch],
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 42,
        shuffle: bool = True,
        order: Optional["SampleOrder"] = None,
    ) -> None:
        if num_samples < 1:
            raise ValueError("TrainLoader needs at least one sample")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        self.samples_per_epoch = num_samples
        self.make_batch = make_batch
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.order = order if order is not None else PermutationOrder(num_samples, seed, shuffle)
        if self.order.samples_per_epoch != num_samples:
            raise ValueError(f"the order has {self.order.samples_per_epoch} samples per epoch, the data {num_samples}")
        self.samples_consumed = 0
        self._ahead: deque[tuple[int, Future]] = deque()  # (position, batch being made), in order
        self._worker: Optional[ThreadPoolExecutor] = None

    @property
    def epoch(self) -> float:
        """Passes over the data so far, fractional."""
        return self.samples_consumed / self.samples_per_epoch

    def __iter__(self) -> "TrainLoader":
        return self

    def __next__(self) -> Batch:
        if not self.prefetch:
            batch = self._batch_at(self.samples_consumed)
            self.samples_consumed += self.dp_size * self.micro_batch_size
            return batch
        if self._worker is None:
            # NOTE: one thread makes every batch, so the orders' caches need no lock.
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmtrain-prefetch")
        while self._ahead and self._ahead[0][0] != self.samples_consumed:  # made for a position since left
            self._ahead.popleft()[1].cancel()
        if not self._ahead:
            self._ahead.append((self.samples_consumed, self._worker.submit(self._batch_at, self.samples_consumed)))
        step = self.dp_size * self.micro_batch_size
        while len(self._ahead) <= self.prefetch:
            position = self._ahead[-1][0] + step
            self._ahead.append((position, self._worker.submit(self._batch_at, position)))
        batch = self._ahead.popleft()[1].result()
        self.samples_consumed += step
        return batch

    def _batch_at(self, position: int) -> Batch:
        start = position + self.dp_rank * self.micro_batch_size
        batch = self.make_batch(self.order.indices(np.arange(start, start + self.micro_batch_size)))
        if self.pin_memory:
            batch = {key: value.pin_memory() for key, value in batch.items()}
        return batch

    def metrics(self) -> dict[str, float]:
        """What the order says about the data seen so far, for the log (a mixture: tokens per source)."""
        return self.order.metrics(self.samples_consumed)

    def state_dict(self) -> dict:
        state = {
            "samples_consumed": self.samples_consumed,
            "samples_per_epoch": self.samples_per_epoch,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
        }
        if self.order.identity is not None:  # NOTE: absent for the permutation, so its checkpoints stay as they were
            state["order"] = self.order.identity
        return state

    def load_state_dict(self, state: dict) -> None:
        if "per_rank" in state:  # every rank's position of a streaming loader (llmtrain.data.streaming)
            raise ValueError("Cannot resume the data position: the checkpoint was written by a run that streamed its "
                             "data, this one does not. Resume with the data flags that wrote it (--data.streaming "
                             "true), or start without resuming.")
        for key, current in (("samples_per_epoch", self.samples_per_epoch), ("seed", self.seed),
                             ("shuffle", int(self.shuffle))):
            if key in state and state[key] != current:
                raise ValueError(
                    f"Cannot resume the data position: the checkpoint's {key} is {state[key]}, this run's is "
                    f"{current}. The dataset, --train.max_seq_length or the seed changed since the checkpoint "
                    "was written; restore them, or start without resuming."
                )
        saved, current = state.get("order"), self.order.identity
        if saved != current:
            raise ValueError(
                f"Cannot resume the data position: the checkpoint's sample order is {saved or 'a permutation'}, this "
                f"run's is {current or 'a permutation'}. The data module, its shards or its mixture weights changed "
                "since the checkpoint was written; restore them, or start without resuming."
            )
        self.samples_consumed = int(state["samples_consumed"])

class ValLoader:
    """Deterministic validation batches; every `iter()` starts over.

    Rank r takes samples r, r + dp_size, r + 2·dp_size, … in order. The tail that does not
    divide evenly is dropped so that every rank runs the same number of forward passes,
    which sharded models need (each forward is a collective).
    """

    def __init__(
        self, num_samples: int, make_batch: Callable[[np.ndarray], Batch], micro_batch_size: int,
        dp_rank: int = 0, dp_size: int = 1,
    ) -> None:
        per_rank = num_samples // dp_size
        self.indices = np.arange(per_rank) * dp_size + dp_rank
        self.make_batch = make_batch
        self.micro_batch_size = micro_batch_size

    def __len__(self) -> int:
        return -(-len(self.indices) // self.micro_batch_size)

    def __iter__(self) -> Iterator[Batch]:
        for start in range(0, len(self.indices), self.micro_batch_size):
            yield self.make_batch(self.indices[start : start + self.micro_batch_size])


class PretrainDataModule(DataModule):
    """Shared machinery for modules that pretrain on one long token stream.

    Subclasses implement `prepare_data()`: tokenize into the cache (or find the cached
    tokens) and set `self._files` to say where they are and what to call them in messages.
    """

    _files: Optional["TokenFiles"] = None

    def uses_token_cache(self) -> bool:
        return True
    _train_tokens: Optional[np.ndarray] = None
    _val_tokens: Optional[np.ndarray] = None
    _dp_rank: int = 0
    _dp_size: int = 1

    def connect(self, tokenizer: Tokenizer, micro_batch_size: int, max_seq_length: int, seed: int = 42) -> None:
        super().connect(tokenizer, micro_batch_size, max_seq_length, seed)
        self._files = None  # token files belong to one tokenizer; find them again

    def work_units(self, split: str, unit_bytes: int) -> list["WorkUnit"]:
        """The documents of ``split`` ("train" or "val") as units of work of about ``unit_bytes`` of text each for
        ``llmtrain prepare_data``, in the order the token cache holds them; [] when the module has no such split.

        A held-out fraction (``--data.val_split_fraction``) is no split of its own: it stays in "train", and
        whoever reads the prepared folder holds it out.
        """
        raise NotImplementedError(f"--data {type(self).__name__} cannot be prepared by llmtrain prepare_data")

    def describe_source(self) -> str:
        """The module and the flags that decide its documents, as a person reads them (the manifest's source).

        Flags that only say how to tokenize or where to hold out validation data (``NOT_SOURCE_FLAGS``) are
        left out; paths are made absolute, so the same data reads the same from any folder.
        """
        flags = []
        for spec in fields(self):  # type: ignore[arg-type]  (subclasses are dataclasses)
            value = getattr(self, spec.name)
            if spec.name in NOT_SOURCE_FLAGS or value == _field_default(spec):
                continue
            if isinstance(value, Path):
                value = value.expanduser().resolve()
            flags.append(f"--data.{spec.name} {value}")
        return " ".join([type(self).__name__, *flags])

    def setup(self, dp_rank: int = 0, dp_size: int = 1) -> None:
        self._require_connected()
        if self._files is None:  # prepare_data is idempotent: on a cache hit it only finds the files
            self.prepare_data()
        files = self._files
        assert files is not None, f"{type(self).__name__}.prepare_data() must set self._files"
        train = open_tokens(files.train)
        val, val_name = (open_tokens(files.val), files.val_name) if files.val is not None else (None, "")
        if val is None and files.val_fraction > 0:
            # The held-out tail of the one stream: deterministic and free of overlap with train.
            num_val = int(len(train) * files.val_fraction)
            train, val = train[: len(train) - num_val], train[len(train) - num_val :]
            val_name = f"The last {files.val_fraction:g} (--data.val_split_fraction) of {files.train_name}"
        self._dp_rank, self._dp_size = dp_rank, dp_size
        self._train_tokens, self._val_tokens = train, val
        needed = dp_size * self.micro_batch_size
        self._check_size(train, files.train_name, needed,
                         f"one micro-step takes {needed} (data-parallel size {dp_size} × micro batch "
                         f"{self.micro_batch_size}). Add data, or lower --train.micro_batch_size or --train.max_seq_length")
        if val is not None:
            self._check_size(val, val_name, dp_size,
                             f"each of the {dp_size} data-parallel ranks needs one. Add validation data "
                             "(or raise --data.val_split_fraction), or lower --train.max_seq_length")

    def train_dataloader(self) -> TrainLoader:
        windows = TokenWindows(self._opened(self._train_tokens), self.max_seq_length)
        return TrainLoader(len(windows), windows.batch, self.micro_batch_size, self._dp_rank, self._dp_size,
                           seed=self.seed)

    def val_dataloader(self) -> Optional[ValLoader]:
        if self._val_tokens is None:
            return None
        windows = TokenWindows(self._val_tokens, self.max_seq_length)
        return ValLoader(len(windows), windows.batch, self.micro_batch_size, self._dp_rank, self._dp_size)

    def _opened(self, tokens: Optional[np.ndarray]) -> np.ndarray:
        if tokens is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must be called before the dataloaders")
        return tokens

    def _check_size(self, tokens: np.ndarray, name: str, needed: int, why: str) -> None:
        windows = len(TokenWindows(tokens, self.max_seq_length))
        if windows < needed:
            raise ValueError(
                f"{name} has {len(tokens):,} tokens, which make {windows} windows of {self.max_seq_length + 1} "
                f"tokens (--train.max_seq_length {self.max_seq_length} + 1), but {why}."
            )


def _field_default(spec: Field) -> Any:
    if spec.default is not MISSING:
        return spec.default
    return spec.default_factory() if spec.default_factory is not MISSING else MISSING


@dataclass
class TokenFiles:
    """Where a module's tokens are cached, and how to name them in messages."""

    train: Path
    """Cached token file of the training data (or of all data, when val_fraction splits off its tail)."""
    train_name: str
    """The training data as the user named it, e.g. "--data.train_data_path /data/books"."""
    val: Optional[Path] = None
    """Cached token file of the validation data, if it has its own."""
    val_name: str = "The validation data"
    """The validation data as the user named it."""
    val_fraction: float = 0.0
    """Without `val`: the fraction at the end of the train tokens held out for validation."""
