"""Pretrain on several prepared folders at once, each in a fixed share of the samples.

The global positions are cut into blocks of ``BLOCK`` samples. Every block holds the same number of
samples of each source (the weights' shares of ``BLOCK``, rounded by largest remainder), in an order
seeded by (seed, block). A position's source, and its index among that source's samples, follow from
the position alone in O(BLOCK) work, so the mixture resumes exactly at any world size; each source
then walks through its own windows in its own :class:`ShardOrder`, epoch after epoch.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from llmtrain.data import manifest as layout
from llmtrain.data.base import DataModule, PermutationOrder, SampleOrder, TrainLoader, ValLoader
from llmtrain.data.prepared import (MIXTURE_PERMUTATION, PreparedSplits, ShardOrder, SpanWindows, check_windows,
                                    read_prepared, say_no_validation, shard_check, split_spans)
from llmtrain.tokenizer import Tokenizer

BLOCK = 10_000
"""Samples per block of the mixture: the weights hold exactly within every block, to 1 / BLOCK."""


@dataclass
class MixtureSource:
    """One source of a mixture: `{"path": DIR, "weight": 0.7}`, with an optional "name"."""

    path: Path
    """A prepared folder (`llmtrain prepare_data`)."""
    weight: float = 1.0
    """Its share of the samples, relative to the other sources' weights."""
    name: Optional[str] = None
    """What the log calls it (`data/tokens/NAME`); default: the folder's name."""

    @property
    def label(self) -> str:
        return self.name or Path(self.path).expanduser().resolve().name


class MixtureOrder:
    """Assigns each global position to a source by blocks (see the module), then asks that source's order."""

    def __init__(self, orders: list[SampleOrder], first: list[int], weights: list[float], names: list[str],
                 seed: int, tokens_per_sample: int, block: int = BLOCK) -> None:
        self.orders, self.first, self.names = orders, np.asarray(first, dtype=np.int64), names
        self.seed, self.tokens_per_sample, self.block = seed, tokens_per_sample, block
        self.per_block = block_counts(weights, block, names)
        self.samples_per_epoch = sum(order.samples_per_epoch for order in orders)
        shares = ", ".join(f"{name}={count}" for name, count in zip(names, self.per_block.tolist()))
        self.identity = f"mixture(per {block}: {shares}; {'; '.join(str(order.identity) for order in orders)})"
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def indices(self, positions: np.ndarray) -> np.ndarray:
        sources, local = self.locate(positions)
        indices = np.empty_like(positions)
        for source in np.unique(sources).tolist():
            mask = sources == source
            indices[mask] = self.first[source] + self.orders[source].indices(local[mask])
        return indices

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each position's source, and its index among that source's samples."""
        blocks, offsets = np.divmod(positions, self.block)
        sources, local = np.empty_like(positions), np.empty_like(positions)
        for block in np.unique(blocks).tolist():
            mask = blocks == block
            labels, ranks = self._cached_block(block)
            sources[mask] = labels[offsets[mask]]
            local[mask] = block * self.per_block[sources[mask]] + ranks[offsets[mask]]
        return sources, local

    def samples_before(self, position: int) -> np.ndarray:
        """Samples of each source among the first ``position`` positions."""
        full, rest = divmod(position, self.block)
        # NOTE: not from the cache: the log asks from the training thread while the prefetch thread fills it.
        labels = self._make_block(full)[0][:rest] if rest else np.zeros(0, dtype=np.int64)
        return full * self.per_block + np.bincount(labels, minlength=len(self.names))

    def metrics(self, samples_consumed: int) -> dict[str, float]:
        samples = self.samples_before(samples_consumed)
        return {f"data/tokens/{name}": int(count) * self.tokens_per_sample for name, count in zip(self.names, samples)}

    def _cached_block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        if block not in self._blocks:
            if len(self._blocks) >= 2:  # a micro-step spans at most two blocks
                self._blocks.popitem(last=False)
            self._blocks[block] = self._make_block(block)
        return self._blocks[block]

    def _make_block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """The source of each offset in the block, and its index among the block's samples of that source."""
        labels = np.repeat(np.arange(len(self.names)), self.per_block)
        labels = np.random.default_rng([self.seed, MIXTURE_PERMUTATION, block]).permutation(labels)
        by_source = np.argsort(labels, kind="stable")
        ranks = np.empty_like(labels)
        source_first = np.cumsum(self.per_block) - self.per_block  # where each source starts once sorted
        ranks[by_source] = np.arange(len(labels)) - np.repeat(source_first, self.per_block)
        return labels, ranks


def block_counts(weights: list[float], block: int, names: list[str]) -> np.ndarray:
    """Each source's samples per block: its share of ``block``, rounded by largest remainder."""
    shares = np.asarray(weights, dtype=np.float64) / sum(weights) * block
    counts = np.floor(shares).astype(np.int64)
    by_remainder = np.argsort(-(shares - counts), kind="stable")
    counts[by_remainder[: block - int(counts.sum())]] += 1
    for name, weight, count in zip(names, weights, counts.tolist()):
        if count == 0:
            raise ValueError(f"--data.sources: {name}'s weight {weight:g} is below 1/{block} of the total, too small "
                             "to give it any samples; raise it or drop the source")
    return counts


def samples_within(order: MixtureOrder, available: list[int]) -> int:
    """The most positions of ``order`` in which no source takes more than its ``available`` samples."""
    low, high = 0, int(sum(available))
    while low < high:  # samples_before grows with the position: bisect for the last one that fits
        middle = (low + high + 1) // 2
        if np.all(order.samples_before(middle) <= available):
            low = middle
        else:
            high = middle - 1
    return low


@dataclass
class Mixture(DataModule):
    """Prepared folders mixed by weight: `--data.sources '[{"path": "DIR1", "weight": 0.7}, {"path": "DIR2",
    "weight": 0.3}]'`. All must be prepared with the run's tokenizer (pass it with --tokenizer_dir)."""

    sources: list[MixtureSource] = field(default_factory=list)
    """The prepared folders and their weights, as a JSON or YAML list of {"path", "weight", "name"}."""
    val_split_fraction: float = 0.0
    """For sources without a val split: the fraction of their training tokens, from the end, kept for validation.
    0: those sources do not validate."""
    shuffle_group: int = 8
    """Shards of a source whose windows are shuffled together each epoch (see --data Prepared)."""
    verify: bool = False
    """Check every byte of every source's shards against its manifest before training (see --data Prepared)."""

    # Runtime state: class attributes without annotations, so they are no flags.
    _manifests = None  # one layout.Manifest per source, read once
    _splits = None  # one PreparedSplits per source, from setup()
    _dp_rank, _dp_size = 0, 1

    def validate(self) -> None:
        if not self.sources:
            raise ValueError('--data.sources is empty: give at least one prepared folder, e.g. --data.sources '
                             '\'[{"path": "DIR1", "weight": 0.7}, {"path": "DIR2", "weight": 0.3}]\'')
        for index, source in enumerate(self.sources):
            if not 0 < source.weight < math.inf:  # NOTE: also refuses NaN
                raise ValueError(f"--data.sources[{index}] ({source.path}) has weight {source.weight:g}: every "
                                 "weight must be a positive, finite number")
        names = [source.label for source in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"--data.sources are named {names}, not all different: give each a \"name\"")
        if not 0 <= self.val_split_fraction < 1:
            raise ValueError(f"--data.val_split_fraction must be in [0, 1), got {self.val_split_fraction}")
        if self.shuffle_group < 1:
            raise ValueError(f"--data.shuffle_group must be at least 1, got {self.shuffle_group}")
        block_counts([source.weight for source in self.sources], BLOCK, names)
        self._manifests = [read_prepared(source.path, f"--data.sources[{index}].path")
                           for index, source in enumerate(self.sources)]
        if self.val_split_fraction > 0 and all("val" in manifest.splits for manifest in self._manifests):
            raise ValueError(f"--data.val_split_fraction {self.val_split_fraction:g} holds out the end of the sources "
                             "without a val split, but every source has a val split of its own: drop "
                             "--data.val_split_fraction")
        if self.val_split_fraction == 0 and not any("val" in manifest.splits for manifest in self._manifests):
            say_no_validation("no --data.sources folder has a validation split")
        first = self._manifests[0]
        for index, manifest in enumerate(self._manifests[1:], start=1):
            if manifest.tokenizer != first.tokenizer:
                raise ValueError(f"--data.sources[0] {self.sources[0].path} and --data.sources[{index}] "
                                 f"{self.sources[index].path} were prepared with different tokenizers (from "
                                 f"{first.tokenizer_dir} and {manifest.tokenizer_dir}): prepare every source with "
                                 "the tokenizer the run uses")

    def validate_tokenizer(self, tokenizer: Tokenizer) -> None:
        for index, (source, manifest) in enumerate(zip(self.sources, self._read())):
            layout.check_tokenizer(source.path, manifest, tokenizer.fingerprint, tokenizer.checkpoint_dir,
                                   f"--data.sources[{index}].path")

    def connect(self, tokenizer: Tokenizer, micro_batch_size: int, max_seq_length: int, seed: int = 42) -> None:
        super().connect(tokenizer, micro_batch_size, max_seq_length, seed)
        self.validate_tokenizer(tokenizer)

    def setup(self, dp_rank: int = 0, dp_size: int = 1) -> None:
        self._require_connected()
        self._splits = [split_spans(Path(source.path).expanduser(), manifest,
                                    0.0 if "val" in manifest.splits else self.val_split_fraction,
                                    f"--data.sources[{index}].path")
                        for index, (source, manifest) in enumerate(zip(self.sources, self._read()))]
        self._dp_rank, self._dp_size = dp_rank, dp_size
        for index, (source, manifest) in enumerate(zip(self.sources, self._read())):
            layout.check_shards(Path(source.path).expanduser(), manifest, flag=f"--data.sources[{index}].path",
                                check=shard_check(self.verify), rank=dp_rank, world=dp_size)
        for source, split in zip(self.sources, self._splits):
            # Each source repeats on its own once used up, so one window each is enough to train.
            check_windows(self._windows(split.train), f"--data.sources path {source.path}", 1,
                          "a source needs at least one. Lower --train.max_seq_length, or drop the source")
        val = self._val()
        if val is not None and val[2] < dp_size:
            raise ValueError(f"The sources' validation data make {val[2]} mixed windows, but each of the {dp_size} "
                             "data-parallel ranks needs one. Raise --data.val_split_fraction, or lower "
                             "--train.max_seq_length")

    def train_dataloader(self) -> TrainLoader:
        splits = self._setup()
        windows = self._windows([span for split in splits for span in split.train])
        counts = [len(self._windows(split.train)) for split in splits]
        orders: list[SampleOrder] = [ShardOrder(self._windows(split.train).counts, self.seed, self.shuffle_group,
                                                source=index) for index, split in enumerate(splits)]
        order = MixtureOrder(orders, list(np.cumsum([0, *counts[:-1]])), [s.weight for s in self.sources],
                             [s.label for s in self.sources], self.seed, self.max_seq_length)
        return TrainLoader(len(windows), windows.batch, self.micro_batch_size, self._dp_rank, self._dp_size,
                           seed=self.seed, order=order)

    def val_dataloader(self) -> Optional[ValLoader]:
        val = self._val()
        if val is None:
            return None
        windows, order, num_samples = val
        return ValLoader(num_samples, lambda positions: windows.batch(order.indices(positions)),
                         self.micro_batch_size, self._dp_rank, self._dp_size)

    def _val(self) -> Optional[tuple[SpanWindows, MixtureOrder, int]]:
        """The validation windows of the sources that have them, mixed by weight in order, and how many fit."""
        chosen = [(source, split) for source, split in zip(self.sources, self._setup()) if split.val]
        if not chosen:
            return None
        counts = [len(self._windows(split.val)) for _, split in chosen]
        windows = self._windows([span for _, split in chosen for span in split.val])
        order = MixtureOrder([PermutationOrder(max(1, count), self.seed, shuffle=False) for count in counts],
                             list(np.cumsum([0, *counts[:-1]])), [source.weight for source, _ in chosen],
                             [source.label for source, _ in chosen], self.seed, self.max_seq_length)
        return windows, order, samples_within(order, counts)

    def _read(self) -> list[layout.Manifest]:
        if self._manifests is None:
            self.validate()
        return self._manifests

    def _windows(self, spans: list) -> SpanWindows:
        return SpanWindows(spans, self._read()[0].dtype, self.max_seq_length, self._read()[0].vocab_size)

    def _setup(self) -> list[PreparedSplits]:
        if self._splits is None:
            raise RuntimeError("Mixture.setup() must be called before the dataloaders")
        return self._splits
