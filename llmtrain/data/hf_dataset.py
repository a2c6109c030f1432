"""Pretrain on anything `datasets.load_dataset` reads: local json/parquet/csv/text files, or a Hub dataset.

By default the text is tokenized once into the token cache; with ``streaming`` every rank streams its
own part and tokenizes it as training goes (`llmtrain.data.streaming`).
"""

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from llmtrain.data.base import PretrainDataModule, TokenFiles, TrainLoader, ValLoader
from llmtrain.data.streaming import StreamingLoader, StreamingValLoader, StreamPosition, stream_windows
from llmtrain.data.tokens import Piece, available_cpu_count, cache_key, document_pieces, tokenize_to_cache
from llmtrain.data.units import WorkUnit
from llmtrain.hub import HubError, dataset_fix, explain, offline_variable, reach
from llmtrain.tokenizer import Tokenizer

# load_dataset builders that read local files and so need --data.data_files.
FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas", "webdataset")


LOCAL_COPY = "pass its files with --data.path json|parquet|csv|text --data.data_files FILES"
"""How to train on a Hub dataset's files instead."""


@dataclass
class HFDataset(PretrainDataModule):
    """A Hugging Face `datasets` source; one row's text field is one document."""

    path: str
    """First argument of datasets.load_dataset: "json", "parquet", "csv", "text", a local folder, or a Hub name."""
    data_files: Optional[Union[str, list[str], dict[str, Union[str, list[str]]]]] = None
    """Files for the json/parquet/csv/text builders: a path, a glob, a list, or {split: files}."""
    name: Optional[str] = None
    """Dataset configuration name (second argument of load_dataset), if the source has several."""
    split: str = "train"
    """Split to train on; slicing works, e.g. "train[:90%]"."""
    text_field: str = "text"
    """Column that holds the text."""
    val_split: Optional[str] = None
    """Split to validate on, e.g. "validation". None: hold out the end of the training data (not when streaming)."""
    val_split_fraction: Optional[float] = None
    """Without --data.val_split: the fraction of training tokens, from the end, kept for validation. 0: no
    validation. None: 0.05, or no validation when streaming (an endless stream has no end to hold out)."""
    num_workers: int = field(default_factory=available_cpu_count)
    """Processes that tokenize in parallel (default: every available CPU core); not used when streaming."""
    streaming: bool = False
    """Stream the data instead of tokenizing it all first: for corpora too large to tokenize up front. Every
    data-parallel rank reads its own part of the rows (whole shards when their number divides by the ranks)
    and tokenizes it in a background thread as it trains, in the source's order, pass after pass, without
    shuffling. Resume is exact, on the same number of data-parallel ranks only. --train.epochs cannot size
    the run (a stream's length is unknown): use --train.max_steps or --train.max_tokens. Validation needs
    --data.val_split: its first windows, as many as --eval.max_iters asks, read by every rank."""

    def validate(self) -> None:
        if self.path in FILE_BUILDERS:
            if not self.data_files:
                raise ValueError(f"--data.path {self.path} reads local files: pass them with --data.data_files")
            for file in _local_files(self.data_files):
                if not Path(file).expanduser().exists():
                    raise FileNotFoundError(f"--data.data_files names {file}, which does not exist")
        elif _looks_local(self.path) and not Path(self.path).expanduser().exists():
            raise FileNotFoundError(f"--data.path {self.path} does not exist")
        if self.val_split_fraction is not None and not 0 <= self.val_split_fraction < 1:
            raise ValueError(f"--data.val_split_fraction must be in [0, 1), got {self.val_split_fraction}")
        if self.val_split == self.split:
            raise ValueError(f"--data.val_split {self.val_split!r} is --data.split, the training data: the model would "
                             "validate on what it trains on. Pass another split (or a slice, e.g. --data.split "
                             "'train[:95%]' --data.val_split 'train[95%:]')")
        if self.val_split is not None and self.val_split_fraction is not None:
            raise ValueError(
                f"--data.val_split_fraction {self.val_split_fraction:g} holds out the end of the training data, but "
                f"--data.val_split {self.val_split!r} is the validation data: drop one of them")
        if self.streaming and self.val_split_fraction:
            raise ValueError(
                f"--data.val_split_fraction {self.val_split_fraction:g} holds out the end of the data, which a "
                "stream (--data.streaming true) never reaches: validate on a split with --data.val_split NAME, "
                "or drop --data.val_split_fraction")
        if self.num_workers < 1:
            raise ValueError(f"--data.num_workers must be at least 1, got {self.num_workers}")
        if self._on_hub() and offline_variable() is None:  # offline, datasets may have cached it
            try:
                reach(self.path, repo_type="dataset", fix=dataset_fix(LOCAL_COPY))
            except HubError as error:
                raise HubError(f"--data.path {self.path}: {error}") from error

    def _on_hub(self) -> bool:
        """Whether --data.path names a Hub dataset (not a builder of local files, nor a local folder)."""
        return self.path not in FILE_BUILDERS and not _looks_local(self.path)

    def uses_token_cache(self) -> bool:
        return not self.streaming

    def prepare_data(self) -> None:
        tokenizer = self._require_connected()
        if self.streaming:  # nothing to tokenize ahead: open the splits, so that a wrong one fails now
            self._load(self.split, "--data.split", streaming=True)
            if self.val_split is not None:
                self._load(self.val_split, "--data.val_split", streaming=True)
            return
        train_name = f"--data.path {self.path} (split {self.split!r})"
        train = self._tokenize(self.split, "--data.split", tokenizer)
        if self.val_split is None:
            fraction = 0.05 if self.val_split_fraction is None else self.val_split_fraction
            self._files = TokenFiles(train, train_name, val_fraction=fraction)
            return
        val = self._tokenize(self.val_split, "--data.val_split", tokenizer)
        self._files = TokenFiles(train, train_name, val, f"--data.path {self.path} (split {self.val_split!r})")

    def work_units(self, split: str, unit_bytes: int) -> list[WorkUnit]:
        name, flag = (self.split, "--data.split") if split == "train" else (self.val_split, "--data.val_split")
        if name is None:
            return []
        dataset = self._load(name, flag)
        if dataset.num_rows == 0:
            return []
        size = dataset.data.nbytes
        parts = min(dataset.num_rows, max(1, math.ceil(size / unit_bytes)))
        return [DatasetRows(replace(self), name, parts, index, size // parts) for index in range(parts)]

    def _tokenize(self, split: str, flag: str, tokenizer: Tokenizer) -> Path:
        dataset = self._load(split, flag)
        # NOTE: datasets derives the fingerprint from the builder config, which hashes the data files'
        # paths and modification times (or the Hub revision), so edited data gets a new key.
        source = getattr(dataset, "_fingerprint", None) or [self.path, self.name, self.data_files, dataset.num_rows]
        key = cache_key("hf-dataset", source, split, self.text_field, tokenizer.fingerprint)
        return tokenize_to_cache(
            _documents(dataset, self.text_field), tokenizer, key, self.num_workers,
            total_chars=dataset.data.nbytes, description=f"{self.path} split {split!r} ({dataset.num_rows:,} rows)",
        )

    def setup(self, dp_rank: int = 0, dp_size: int = 1) -> None:
        if not self.streaming:
            super().setup(dp_rank, dp_size)
            return
        self._require_connected()
        self._dp_rank, self._dp_size = dp_rank, dp_size

    def train_dataloader(self) -> Union[TrainLoader, StreamingLoader]:
        if not self.streaming:
            return super().train_dataloader()
        return StreamingLoader(self._train_windows, self.micro_batch_size, self._dp_rank, self._dp_size)

    def val_dataloader(self) -> Union[ValLoader, StreamingValLoader, None]:
        if not self.streaming:
            return super().val_dataloader()
        if self.val_split is None:
            return None
        return StreamingValLoader(self._val_windows, self.micro_batch_size, self._dp_rank, self._dp_size)

    def _train_windows(self, start: StreamPosition) -> Iterator[tuple[Any, StreamPosition]]:
        """This rank's part of --data.split as windows, from ``start``."""
        from datasets.distributed import split_dataset_by_node

        source = self._load(self.split, "--data.split", streaming=True)
        name = (f"--data.path {self.path} (split {self.split!r}, data-parallel rank {self._dp_rank}'s part of "
                f"{self._dp_size})")
        return stream_windows(lambda: split_dataset_by_node(source, rank=self._dp_rank, world_size=self._dp_size),
                              self.text_field, self._require_connected(), self.max_seq_length, start, name=name)

    def _val_windows(self) -> Iterator[Any]:
        """--data.val_split whole, once, as windows (every rank reads it all)."""
        assert self.val_split is not None
        dataset = self._load(self.val_split, "--data.val_split", streaming=True)
        windows = stream_windows(lambda: dataset, self.text_field, self._require_connected(), self.max_seq_length,
                                 endless=False, name=f"--data.path {self.path} (split {self.val_split!r})")
        return (window for window, _ in windows)

    def _load(self, split: str, flag: str, streaming: bool = False) -> Any:
        import datasets
        from huggingface_hub.errors import HfHubHTTPError

        try:
            dataset = datasets.load_dataset(self.path, name=self.name, data_files=self.data_files, split=split,
                                            streaming=streaming)
        except ValueError as error:
            if "split" in str(error).lower():
                raise ValueError(f"{flag} {split!r} is not available in --data.path {self.path}: {error}") from error
            raise
        except (ConnectionError, HfHubHTTPError) as error:  # the Hub: offline, unreachable, gated, missing
            if not self._on_hub():
                raise
            raise HubError(f"--data.path {self.path}: "
                           + explain(error, self.path, repo_type="dataset", fix=dataset_fix(LOCAL_COPY))) from error
        if dataset.column_names is None:  # a stream whose columns are known only from its rows
            return dataset
        if self.text_field not in dataset.column_names:
            raise ValueError(
                f"--data.text_field {self.text_field!r} is not a column of --data.path {self.path} (split {split!r}); "
                f"its columns are {dataset.column_names}. Pass --data.text_field with one of them."
            )
        feature = dataset.features[self.text_field]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise ValueError(
                f"--data.text_field {self.text_field!r} of --data.path {self.path} holds {feature}, not text; "
                f"pass --data.text_field with a text column of {dataset.column_names}."
            )
        return dataset.select_columns([self.text_field])


@dataclass(frozen=True)
class DatasetRows(WorkUnit):
    """Part ``index`` of ``parts`` equal, contiguous row ranges of one split of an HFDataset source."""

    source: HFDataset
    split: str
    parts: int
    index: int
    size: int

    def pieces(self) -> Iterator[Piece]:
        key = repr((self.source.describe_source(), self.split))
        if key not in _loaded:  # a process prepares several parts of one split: load it once
            _loaded.clear()
            _loaded[key] = self.source._load(self.split, "--data.split")
        rows = _loaded[key].shard(self.parts, self.index, contiguous=True)
        return _documents(rows, self.source.text_field)


_loaded: dict[str, Any] = {}
"""The split this process read last, by source and split name."""


def _documents(dataset: Any, text_field: str) -> Iterator[Piece]:
    for batch in dataset.iter(batch_size=1024):
        for text in batch[text_field]:
            if text:  # empty and missing values are not documents
                yield from document_pieces(text)


def _local_files(data_files: Union[str, list, dict]) -> list[str]:
    """The plain local paths among data_files (globs and URLs are left to datasets)."""
    if isinstance(data_files, str):
        candidates = [data_files]
    elif isinstance(data_files, dict):
        candidates = [f for files in data_files.values() for f in ([files] if isinstance(files, str) else files)]
    else:
        candidates = list(data_files)
    return [f for f in candidates if "://" not in f and not any(c in f for c in "*?[")]


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or Path(path).expanduser().exists()
