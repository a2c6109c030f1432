"""Pretrain on a folder of plain-text files."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from llmtrain.data.base import PretrainDataModule, TokenFiles
from llmtrain.data.tokens import Piece, available_cpu_count, cache_key, split_lines, tokenize_to_cache
from llmtrain.data.units import WorkUnit, contiguous_groups
from llmtrain.tokenizer import Tokenizer


@dataclass
class TextFiles(PretrainDataModule):
    """Plain-text files (.txt, searched recursively); each file is one document, and an empty one none."""

    train_data_path: Path
    """Folder of .txt files to train on (searched recursively), or a single .txt file."""
    val_data_path: Optional[Path] = None
    """Folder (or file) of .txt files to validate on. None: hold out the end of the training data."""
    val_split_fraction: Optional[float] = None
    """Without --data.val_data_path: the fraction of training tokens, from the end, kept for validation. 0: no
    validation. None: 0.05."""
    num_workers: int = field(default_factory=available_cpu_count)
    """Processes that tokenize in parallel (default: every available CPU core)."""

    def validate(self) -> None:
        train = list_text_files(self.train_data_path, "--data.train_data_path")
        if self.val_data_path is not None:
            shared = set(train).intersection(list_text_files(self.val_data_path, "--data.val_data_path"))
            if shared:
                raise ValueError(f"--data.val_data_path {self.val_data_path} and --data.train_data_path "
                                 f"{self.train_data_path} share {len(shared)} .txt files (e.g. {min(shared)}): the "
                                 "model would validate on what it trains on. Keep the validation files outside the "
                                 "training folder")
        if self.val_split_fraction is not None and not 0 <= self.val_split_fraction < 1:
            raise ValueError(f"--data.val_split_fraction must be in [0, 1), got {self.val_split_fraction}")
        if self.val_data_path is not None and self.val_split_fraction is not None:
            raise ValueError(
                f"--data.val_split_fraction {self.val_split_fraction:g} holds out the end of the training data, but "
                f"--data.val_data_path {self.val_data_path} is the validation data: drop one of them")
        if self.num_workers < 1:
            raise ValueError(f"--data.num_workers must be at least 1, got {self.num_workers}")

    def prepare_data(self) -> None:
        tokenizer = self._require_connected()
        train_name = f"--data.train_data_path {self.train_data_path}"
        train = self._tokenize(self.train_data_path, "--data.train_data_path", tokenizer)
        if self.val_data_path is None:
            fraction = 0.05 if self.val_split_fraction is None else self.val_split_fraction
            self._files = TokenFiles(train, train_name, val_fraction=fraction)
            return
        val = self._tokenize(self.val_data_path, "--data.val_data_path", tokenizer)
        self._files = TokenFiles(train, train_name, val, f"--data.val_data_path {self.val_data_path}")

    def work_units(self, split: str, unit_bytes: int) -> list[WorkUnit]:
        path, flag = ((self.train_data_path, "--data.train_data_path") if split == "train"
                      else (self.val_data_path, "--data.val_data_path"))
        if path is None:
            return []
        files = list_text_files(path, flag)
        groups = contiguous_groups(files, [file.stat().st_size for file in files], unit_bytes)
        return [TextFileGroup(tuple(str(file) for file in group), sum(file.stat().st_size for file in group))
                for group in groups]

    def _tokenize(self, path: Path, flag: str, tokenizer: Tokenizer) -> Path:
        files = list_text_files(path, flag)
        stats = [(str(file), file.stat().st_size, file.stat().st_mtime_ns) for file in files]
        # NOTE: sizes and modification times stand in for the contents: editing a file re-tokenizes.
        key = cache_key("text-files", stats, tokenizer.fingerprint)
        return tokenize_to_cache(
            read_documents(files), tokenizer, key, self.num_workers,
            total_chars=sum(size for _, size, _ in stats), description=f"{len(files)} text files in {path}",
        )


@dataclass(frozen=True)
class TextFileGroup(WorkUnit):
    """Consecutive files of a TextFiles source: each one document."""

    files: tuple[str, ...]
    size: int

    def pieces(self) -> Iterator[Piece]:
        return read_documents([Path(file) for file in self.files])


def list_text_files(path: Path, flag: str) -> list[Path]:
    """The .txt files under `path` that are not empty, in a fixed (sorted) order; errors name the flag.

    NOTE: an empty file is no document (it would be a bos and an eos and nothing between), so it is left out.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{flag} {path} does not exist; pass a folder of .txt files")
    if path.is_file():
        files = [path.resolve()]
    else:
        files = sorted(p.resolve() for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise ValueError(f"{flag} {path} contains no .txt files (searched recursively); add some or fix the path")
    documents = [file for file in files if file.stat().st_size > 0]
    if not documents:
        raise ValueError(f"{flag} {path} holds only empty .txt files ({len(files)}): there is no text to train on; "
                         "add some or fix the path")
    return documents


def read_documents(files: list[Path]) -> Iterator[Piece]:
    """Each file as one document, streamed in pieces so that huge files never sit in memory whole."""
    for file in files:
        # NOTE: a stray invalid byte should cost one replacement character, not the whole run.
        with open(file, encoding="utf-8", errors="replace") as handle:
            yield from split_lines(handle)
