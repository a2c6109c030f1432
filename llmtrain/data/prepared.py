"""Pretrain on a prepared folder (``llmtrain prepare_data``): shards read lazily, shuffled without a global permutation.

A sample is a window of max_seq_length + 1 tokens inside one shard, so shard i holds
(tokens_i - 1) // L windows and no window crosses a file. Shards are memory-mapped on first use and
only the windows a batch needs are read. The order (:class:`ShardOrder`) costs memory per shard, not
per sample, so a corpus of trillions of tokens is as cheap to start on as a small one.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from llmtrain.data import manifest as layout
from llmtrain.data.base import Batch, DataModule, TrainLoader, ValLoader
from llmtrain.distributed.launch import is_first_process
from llmtrain.tokenizer import Tokenizer

SHARD_PERMUTATION, WINDOW_PERMUTATION, MIXTURE_PERMUTATION = 1, 2, 3
"""Tags that keep the random streams of the orders apart (the first number after the seed)."""
OPEN_SHARDS = 256
"""Memory maps kept open per reader: a batch touches a few shards, and a system allows only so many maps."""


@dataclass(frozen=True)
class Span:
    """Tokens [start, start + tokens) of one shard: a whole shard, or the part of one a validation split leaves."""

    root: Path
    shard: layout.Shard
    start: int
    tokens: int


class SpanWindows:
    """Sample i is a window of L + 1 tokens (L = max_seq_length) in one span: spans in order, windows in order."""

    def __init__(self, spans: list[Span], dtype: str, max_seq_length: int, vocab_size: int) -> None:
        self.spans, self.dtype, self.max_seq_length, self.vocab_size = spans, dtype, max_seq_length, vocab_size
        self.counts = np.array([max(0, (span.tokens - 1) // max_seq_length) for span in spans], dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(self.counts)])  # the first sample of each span, then the total
        self._open: OrderedDict[tuple[Path, str], np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return int(self.first[-1])

    def batch(self, indices: np.ndarray) -> Batch:
        length = self.max_seq_length
        span_ids = np.searchsorted(self.first, indices, side="right") - 1
        rows = []
        for index, span_id in zip(indices.tolist(), span_ids.tolist()):
            span = self.spans[span_id]
            start = span.start + (index - int(self.first[span_id])) * length
            rows.append(self._tokens(span)[start : start + length + 1])
        stacked = np.stack(rows)
        if stacked.max(initial=0) >= self.vocab_size:
            self._refuse_ids(stacked, span_ids)
        tokens = torch.from_numpy(stacked.astype(np.int64))  # (B, L + 1)
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    def _refuse_ids(self, rows: np.ndarray, span_ids: np.ndarray) -> None:
        """Stop on a row with a token id the vocabulary lacks, naming its shard (a byte flipped on disk, which a
        sampled check can miss, would otherwise fail in the embedding as an IndexError mid-run)."""
        row = int(np.argmax(rows.max(axis=1) >= self.vocab_size))
        span = self.spans[int(span_ids[row])]
        raise ValueError(f"{span.root / span.shard.name} holds token id {int(rows[row].max())}, outside the "
                         f"vocabulary of {self.vocab_size} it was prepared with: the shard is damaged. Repair: run "
                         f"the prepare_data command that made {span.root} again with --verify true: it checks every "
                         "byte and prepares the damaged shards' units again, keeping the rest")

    def _tokens(self, span: Span) -> np.ndarray:
        key = (span.root, span.shard.name)
        if key in self._open:
            self._open.move_to_end(key)
        else:
            if len(self._open) >= OPEN_SHARDS:
                self._open.popitem(last=False)
            self._open[key] = layout.open_shard(span.root, span.shard, self.dtype)
        return self._open[key]


class ShardOrder:
    """A shuffled pass over windows that live in spans, in memory O(spans + the windows of one group).

    Each epoch permutes the spans (seeded by seed, epoch), cuts that order into groups of ``group``
    spans, and permutes the windows of each group together (seeded by seed, epoch, group): a
    micro-batch mixes documents from ``group`` shards, and no permutation of every window is made.
    ``source`` keeps the streams of a mixture's sources apart.
    """

    def __init__(self, counts: np.ndarray, seed: int, group: int = 8, source: int = 0) -> None:
        if group < 1:
            raise ValueError(f"--data.shuffle_group must be at least 1, got {group}")
        self.counts = np.asarray(counts, dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(self.counts)])
        self.samples_per_epoch = int(self.first[-1])
        self.seed, self.group, self.source = seed, group, source
        digest = hashlib.sha256(self.counts.tobytes()).hexdigest()[:16]
        self.identity = f"shards(group={group}, windows={digest})"
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._groups: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def indices(self, positions: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(positions, self.samples_per_epoch)
        indices = np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():
            in_epoch = epochs == epoch
            _, group_first = self._epoch(epoch)
            groups = np.searchsorted(group_first, offsets[in_epoch], side="right") - 1
            found = np.empty(int(in_epoch.sum()), dtype=np.int64)
            for group in np.unique(groups).tolist():
                in_group = groups == group
                windows, spans, span_first = self._group(epoch, group)
                picked = windows[offsets[in_epoch][in_group] - group_first[group]]  # into the group's windows
                span_of = np.searchsorted(span_first, picked, side="right") - 1
                found[in_group] = self.first[spans[span_of]] + picked - span_first[span_of]
            indices[in_epoch] = found
        return indices

    def metrics(self, samples_consumed: int) -> dict[str, float]:
        return {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The spans in this epoch's order, and the first position of each group (then the epoch's size)."""
        if epoch not in self._epochs:
            self._epochs = {e: kept for e, kept in self._epochs.items() if e >= epoch - 1}
            rng = np.random.default_rng([self.seed, SHARD_PERMUTATION, self.source, epoch])
            spans = rng.permutation(len(self.counts))
            ends = np.cumsum(self.counts[spans])
            last_spans = np.minimum(np.arange(self.group, len(spans) + self.group, self.group), len(spans)) - 1
            self._epochs[epoch] = spans, np.concatenate([[0], ends[last_spans]])
        return self._epochs[epoch]

    def _group(self, epoch: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A group's window permutation, its spans, and the first window of each span within the group."""
        key = (epoch, group)
        if key not in self._groups:
            if len(self._groups) >= 4:  # a micro-step spans at most a few groups
                self._groups.popitem(last=False)
            spans = self._epoch(epoch)[0][group * self.group : (group + 1) * self.group]
            span_first = np.concatenate([[0], np.cumsum(self.counts[spans])])
            rng = np.random.default_rng([self.seed, WINDOW_PERMUTATION, self.source, epoch, group])
            self._groups[key] = rng.permutation(int(span_first[-1])), spans, span_first
        return self._groups[key]


@dataclass
class PreparedSplits:
    """A prepared folder's train and validation spans, as :func:`split_spans` cuts them."""

    train: list[Span]
    val: list[Span]
    val_name: str


def split_spans(root: Path, manifest: layout.Manifest, val_split_fraction: float, flag: str) -> PreparedSplits:
    """The folder's own val split, or, with ``val_split_fraction``, that fraction of train tokens from the end."""
    root = Path(root)
    train = [Span(root, shard, 0, shard.tokens) for shard in manifest.splits["train"].shards]
    if "val" in manifest.splits:
        if val_split_fraction > 0:
            raise ValueError(f"{flag} {root} has a validation split of its own: drop --data.val_split_fraction")
        return PreparedSplits(train, [Span(root, shard, 0, shard.tokens) for shard in manifest.splits["val"].shards],
                              f"The val split of {flag} {root}")
    total = sum(span.tokens for span in train)
    remaining = int(total * val_split_fraction)
    if val_split_fraction > 0 and remaining == 0:
        raise ValueError(f"--data.val_split_fraction {val_split_fraction:g} of the {total:,} training tokens of {flag} "
                         f"{root} holds out no token: raise it, or pass 0 to train without validation")
    val: list[Span] = []
    while remaining > 0 and train:  # NOTE: from the last shard backwards, cutting the first one it reaches
        last = train.pop()
        taken = min(remaining, last.tokens)
        val.insert(0, Span(root, last.shard, last.start + last.tokens - taken, taken))
        if taken < last.tokens:
            train.append(Span(root, last.shard, last.start, last.tokens - taken))
        remaining -= taken
    return PreparedSplits(train, val, f"The last {val_split_fraction:g} (--data.val_split_fraction) of {flag} {root}")


def check_windows(windows: SpanWindows, name: str, needed: int, why: str) -> None:
    if len(windows) < needed:
        tokens = sum(span.tokens for span in windows.spans)
        raise ValueError(f"{name} has {tokens:,} tokens in {len(windows.spans)} shards, which make {len(windows)} "
                         f"windows of {windows.max_seq_length + 1} tokens (--train.max_seq_length "
                         f"{windows.max_seq_length} + 1, within one shard), but {why}.")


@dataclass
class Prepared(DataModule):
    """A folder of token shards written by `llmtrain prepare_data`, read lazily (pass the same --tokenizer_dir)."""

    path: Path
    """The prepared folder (the one with manifest.json)."""
    val_split_fraction: float = 0.0
    """When the folder has no val split: the fraction of its training tokens, from the end, kept for validation.
    0: no validation."""
    shuffle_group: int = 8
    """Shards whose windows are shuffled together each epoch: more mixes more documents into a batch, and costs
    memory for the permutation of their windows."""
    verify: bool = False
    """Check every byte of the shards against the manifest's sha256 before training (each data-parallel rank
    hashes its share: the folder's size over the ranks, at the disk's or a core's speed). Off: sizes and two
    sampled 64 KiB blocks a shard, and every batch's token ids against the vocabulary."""

    # Runtime state: class attributes without annotations, so they are no flags.
    _manifest = None  # the folder's layout.Manifest, read once
    _splits = None  # PreparedSplits, from setup()
    _dp_rank, _dp_size = 0, 1

    def validate(self) -> None:
        if not 0 <= self.val_split_fraction < 1:
            raise ValueError(f"--data.val_split_fraction must be in [0, 1), got {self.val_split_fraction}")
        if self.shuffle_group < 1:
            raise ValueError(f"--data.shuffle_group must be at least 1, got {self.shuffle_group}")
        self._manifest = read_prepared(self.path, "--data.path")
        if self.val_split_fraction > 0 and "val" in self._manifest.splits:
            raise ValueError(f"--data.path {self.path} has a validation split of its own: drop --data.val_split_fraction")
        if self.val_split_fraction == 0 and "val" not in self._manifest.splits:
            say_no_validation(f"--data.path {self.path} has no validation split")

    def validate_tokenizer(self, tokenizer: Tokenizer) -> None:
        layout.check_tokenizer(self.path, self._read(), tokenizer.fingerprint, tokenizer.checkpoint_dir, "--data.path")

    def connect(self, tokenizer: Tokenizer, micro_batch_size: int, max_seq_length: int, seed: int = 42) -> None:
        super().connect(tokenizer, micro_batch_size, max_seq_length, seed)
        self.validate_tokenizer(tokenizer)

    def setup(self, dp_rank: int = 0, dp_size: int = 1) -> None:
        self._require_connected()
        self._splits = split_spans(Path(self.path).expanduser(), self._read(), self.val_split_fraction, "--data.path")
        self._dp_rank, self._dp_size = dp_rank, dp_size
        layout.check_shards(Path(self.path).expanduser(), self._read(), check=shard_check(self.verify),
                            rank=dp_rank, world=dp_size)
        needed = dp_size * self.micro_batch_size
        check_windows(self._windows(self._splits.train), f"--data.path {self.path}", needed,
                      f"one micro-step takes {needed} (data-parallel size {dp_size} × micro batch "
                      f"{self.micro_batch_size}). Add data, or lower --train.micro_batch_size or "
                      "--train.max_seq_length")
        if self._splits.val:
            check_windows(self._windows(self._splits.val), self._splits.val_name, dp_size,
                          f"each of the {dp_size} data-parallel ranks needs one. Raise --data.val_split_fraction, "
                          "or lower --train.max_seq_length")

    def train_dataloader(self) -> TrainLoader:
        windows = self._windows(self._setup().train)
        order = ShardOrder(windows.counts, self.seed, self.shuffle_group)
        return TrainLoader(len(windows), windows.batch, self.micro_batch_size, self._dp_rank, self._dp_size,
                           seed=self.seed, order=order)

    def val_dataloader(self) -> Optional[ValLoader]:
        if not self._setup().val:
            return None
        windows = self._windows(self._setup().val)
        return ValLoader(len(windows), windows.batch, self.micro_batch_size, self._dp_rank, self._dp_size)

    def _read(self) -> layout.Manifest:
        if self._manifest is None:
            self._manifest = read_prepared(self.path, "--data.path")
        return self._manifest

    def _windows(self, spans: list[Span]) -> SpanWindows:
        return SpanWindows(spans, self._read().dtype, self.max_seq_length, self._read().vocab_size)

    def _setup(self) -> PreparedSplits:
        if self._splits is None:
            raise RuntimeError("Prepared.setup() must be called before the dataloaders")
        return self._splits


def say_no_validation(why: str) -> None:
    """One line at the start of a run on prepared folders that will not validate, and how to make it validate.

    NOTE: said, not refused, even when --eval.interval is given: a config_hub recipe sets it for its own data, and
    the data module cannot tell a flag the user typed from a recipe's value; a run without validation still trains.
    """
    if is_first_process():
        print(f"{why}: validation is off (no validation loss). To validate, pass --data.val_split_fraction 0.05 "
              "(the last 5% of the training tokens), or prepare the folder with a validation split "
              "(prepare_data --data TextFiles --data.val_data_path DIR ...)")


def shard_check(verify: bool) -> str:
    """What setup() compares each shard of its share with (the ``check`` of llmtrain.data.manifest.damaged_shards)."""
    return "sha256" if verify else "sample"


def read_prepared(path: Path, flag: str) -> layout.Manifest:
    """A prepared folder's manifest, with training shards.

    The first process (the one that launches, or rank 0 of a launcher's) stats every shard before launch, so a
    missing or truncated one is named in one line, not in a worker's traceback; the ranks check their shares'
    sampled checksums (or sha256) in setup(), where each reads only its share.
    """
    manifest = layout.read_manifest(Path(path).expanduser(), flag)
    if "train" not in manifest.splits or not manifest.splits["train"].shards:
        raise ValueError(f"{flag} {path} has no training shards: prepare it from data that is not empty")
    if is_first_process():
        layout.check_shards(Path(path).expanduser(), manifest, flag=flag, check="size")
    return manifest
