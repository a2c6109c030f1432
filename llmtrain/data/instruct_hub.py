"""Well-known instruction datasets: loaded with `datasets.load_dataset` from the Hub, or from a local copy.

Each module maps its dataset's rows to the records `llmtrain.data.instruct` reads. Without internet
access, download the dataset elsewhere and pass the file or folder with --data.path.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

from llmtrain.hub import HubError, dataset_fix, explain, offline_variable, reach
from llmtrain.data.instruct import Conversation, InstructDataModule, record_to_conversation, split_records

# load_dataset builders for local files, by suffix.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


@dataclass(kw_only=True)
class HubInstruct(InstructDataModule):
    """Shared loading of Hub instruction sets; subclasses name the dataset and map one row to a record."""

    path: Optional[str] = None
    """A local copy (a .json/.jsonl/.parquet/.csv file or a folder of them), or a Hub name. None: the usual Hub name."""
    val_split_fraction: float = 0.05
    """Fraction of rows, drawn at random, held out for validation. 0: no validation."""
    split_seed: int = 42
    """Seed of the train/validation split (the training order follows --seed)."""

    hub_name: ClassVar[str] = ""
    """The dataset's name on the Hugging Face Hub."""
    columns: ClassVar[tuple[str, ...]] = ()
    """Columns a row must have."""

    def row_to_record(self, row: dict[str, Any]) -> dict[str, Any]:
        """An Alpaca-style or chat record (see llmtrain.data.instruct) from one row."""
        raise NotImplementedError

    def validate(self) -> None:
        super().validate()
        if self.path is not None and _looks_local(self.path) and not Path(self.path).expanduser().exists():
            raise FileNotFoundError(f"--data.path {self.path} does not exist")
        if not 0 <= self.val_split_fraction < 1:
            raise ValueError(f"--data.val_split_fraction must be in [0, 1), got {self.val_split_fraction}")
        if not self._local_copy() and offline_variable() is None:  # offline, datasets may have cached it
            try:
                reach(self._source(), repo_type="dataset", fix=self._offline_fix())
            except HubError as error:
                raise HubError(f"--data {type(self).__name__}: {error}") from error

    def load_conversations(self) -> tuple[list[Conversation], Optional[list[Conversation]], str]:
        dataset, name = self._load()
        conversations = [record_to_conversation(self.row_to_record(row), f"{name} row {index}")
                         for index, row in enumerate(dataset)]
        train, val = split_records(conversations, self.val_split_fraction, self.split_seed)
        return train, val, name

    def _load(self) -> tuple[Any, str]:
        import datasets

        local = self._local_copy()
        if local is not None:
            name = f"--data.path {self.path}"
            if local.is_file():
                builder = FILE_BUILDERS.get(local.suffix)
                if builder is None:
                    raise ValueError(f"{name}: cannot read {local.suffix} files; use one of {sorted(FILE_BUILDERS)}")
                dataset = datasets.load_dataset(builder, data_files=str(local), split="train")
            else:
                dataset = datasets.load_dataset(str(local), split="train")
        else:
            source = self._source()
            name = f"{type(self).__name__} ({source})"
            try:
                dataset = datasets.load_dataset(source, split="train")
            except Exception as error:  # offline, gated, or misspelled: the error types vary by cause
                raise HubError(f"--data {type(self).__name__}: "
                               + explain(error, source, repo_type="dataset", fix=self._offline_fix())) from error
        missing = [column for column in self.columns if column not in dataset.column_names]
        if missing:
            raise ValueError(f"{name} has columns {dataset.column_names}, but {type(self).__name__} needs "
                             f"{list(self.columns)} (missing: {missing})")
        return dataset, name

    def _source(self) -> str:
        return self.path or self.hub_name

    def _local_copy(self) -> Optional[Path]:
        local = Path(self.path).expanduser() if self.path is not None else None
        return local if local is not None and local.exists() else None

    def _offline_fix(self) -> str:
        return dataset_fix("pass the file or folder with --data.path")


@dataclass(kw_only=True)
class Alpaca(HubInstruct):
    """Alpaca, cleaned: 52K instructions with optional input and a response (yahma/alpaca-cleaned)."""

    hub_name: ClassVar[str] = "yahma/alpaca-cleaned"
    columns: ClassVar[tuple[str, ...]] = ("instruction", "input", "output")

    def row_to_record(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"instruction": row["instruction"], "input": row["input"], "output": row["output"]}


@dataclass(kw_only=True)
class Alpaca2k(Alpaca):
    """A 2,000-row sample of Alpaca for quick runs (mhenrichsen/alpaca_2k_test)."""

    hub_name: ClassVar[str] = "mhenrichsen/alpaca_2k_test"


@dataclass(kw_only=True)
class Dolly(HubInstruct):
    """Databricks Dolly: 15K human-written instructions with optional context (databricks/databricks-dolly-15k)."""

    hub_name: ClassVar[str] = "databricks/databricks-dolly-15k"
    columns: ClassVar[tuple[str, ...]] = ("instruction", "context", "response")

    def row_to_record(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"instruction": row["instruction"], "input": row["context"], "output": row["response"]}


@dataclass(kw_only=True)
class LIMA(HubInstruct):
    """LIMA: 1,000 curated conversations (GAIR/lima, gated: accept its terms on the Hub first)."""

    hub_name: ClassVar[str] = "GAIR/lima"
    columns: ClassVar[tuple[str, ...]] = ("conversations",)

    def row_to_record(self, row: dict[str, Any]) -> dict[str, Any]:
        texts = list(row["conversations"] or [])
        if len(texts) % 2:  # a closing question without an answer teaches nothing
            texts = texts[:-1]
        roles = ("user", "assistant")
        return {"messages": [{"role": roles[i % 2], "content": text} for i, text in enumerate(texts)]}


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or Path(path).suffix in FILE_BUILDERS
