"""A built-in corpus of real text that needs no download: the running interpreter's standard library.

Every file is one document: the `.py` source of the modules that `sys.stdlib_module_names` lists, found under
``sysconfig.get_paths()["stdlib"]``. That rule leaves out site-packages, the build-time `_sysconfigdata`
module and the `test` package; the test folders inside other packages (``tests/``, ``idle_test/``) are left
out too unless --data.include_tests. What remains is about 12 MB of source on Python 3.11.

The split into training and validation files hashes each file's path, so it is the same on every run and
machine, and a file that two Python versions share lands on the same side in both. The corpus is this
interpreter's own library, so another Python version gives a slightly different corpus; its file list is
part of every cache key, so each interpreter tokenizes (and trains its tokenizer) once for itself.
"""

import functools
import hashlib
import logging
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from llmtrain.checkpoint.layout import TOKENIZER_FILE
from llmtrain.data.base import PretrainDataModule, TokenFiles
from llmtrain.data.tokens import (Piece, available_cpu_count, cache_dir, cache_key, document_pieces,
                                  exclusive_lock, tokenize_to_cache)
from llmtrain.data.units import WorkUnit, contiguous_groups
from llmtrain.tokenizer import Tokenizer, train_bpe_tokenizer

log = logging.getLogger(__name__)

CORPUS_VERSION = 1
"""Bump whenever the selection or reading of files changes, so cached tokens and tokenizers are rebuilt."""
TOKENIZER_TRAINING_BYTES = 4_000_000
"""Bytes of training files the tokenizer learns from (a third of the library, about a second of work)."""
TEST_FOLDERS = frozenset({"test", "tests", "idle_test"})
"""Names of the folders (and modules) that hold a package's tests rather than the library."""


@dataclass(frozen=True)
class SourceFile:
    relative: str
    """Path below the standard library's folder, with forward slashes: the file's name in every hash."""
    path: Path
    size: int
    """In bytes; with `relative`, what the cache keys know of the file."""


@dataclass
class PythonStdlib(PretrainDataModule):
    """The .py source of this interpreter's standard library, split by file, with its own tokenizer; no download."""

    val_fraction: float = 0.05
    """Fraction of the files held out for validation, picked by a hash of each path (the same every run). 0: none."""
    max_bytes: Optional[int] = None
    """Use at most this many bytes of source (a fixed sample of whole files), for quick runs. None: all of it."""
    include_tests: bool = False
    """Also train on the library's test suites (test/, tests/, idle_test/: about 19 MB more on Python 3.11)."""
    vocab_size: int = 4096
    """Upper bound on the size of the BPE vocabulary trained on the library."""

    def validate(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_bytes is not None and self.max_bytes < 1000:
            raise ValueError(f"--data.max_bytes must be at least 1000 (or None: the whole library), "
                             f"got {self.max_bytes}")
        if self.vocab_size < 300:  # 256 bytes + special tokens + a few merges
            raise ValueError(f"--data.vocab_size must be at least 300, got {self.vocab_size}")
        list_stdlib_files(self.include_tests)  # says so now if this interpreter ships without its source

    def default_tokenizer(self) -> Optional[Tokenizer]:
        """A byte-level BPE trained once on part of the training files (whatever --data.max_bytes), then cached."""
        train, _ = split_files(list_stdlib_files(include_tests=False), self.val_fraction)
        files, size = [], 0
        for file in train:
            if size >= TOKENIZER_TRAINING_BYTES:
                break
            files.append(file)
            size += file.size
        key = cache_key("python-stdlib-tokenizer", CORPUS_VERSION, python_version(), self.vocab_size,
                        [(file.relative, file.size) for file in files])
        directory = cache_dir() / "tokenizers" / f"python-stdlib-{key}"
        with exclusive_lock(directory.with_name(directory.name + ".lock")):
            if (directory / TOKENIZER_FILE).is_file():
                return Tokenizer(directory)
            log.info("Training a %d-token BPE on %d files (%.1f MB) of the Python %s standard library",
                     self.vocab_size, len(files), size / 1e6, python_version())
            return train_bpe_tokenizer((read_source(file) for file in files), self.vocab_size, directory)

    def prepare_data(self) -> None:
        tokenizer = self._require_connected()
        train, val = self.files()
        limit = f", --data.max_bytes {self.max_bytes}" if self.max_bytes is not None else ""
        if not train:
            raise ValueError(f"--data.max_bytes {self.max_bytes} leaves no training file; raise it")
        train_name = f"PythonStdlib ({len(train)} training files{limit})"
        if self.val_fraction == 0:
            self._files = TokenFiles(self._tokenize("train", train, tokenizer), train_name)
            return
        if not val:
            raise ValueError(f"--data.max_bytes {self.max_bytes} with --data.val_fraction {self.val_fraction} leaves "
                             "no validation file; raise either, or pass --data.val_fraction 0 for no validation")
        val_name = f"PythonStdlib ({len(val)} validation files, --data.val_fraction {self.val_fraction}{limit})"
        self._files = TokenFiles(self._tokenize("train", train, tokenizer), train_name,
                                 self._tokenize("val", val, tokenizer), val_name)

    def files(self) -> tuple[list[SourceFile], list[SourceFile]]:
        """(training files, validation files), each in its fixed sample order and within --data.max_bytes."""
        train, val = split_files(list_stdlib_files(self.include_tests), self.val_fraction)
        if self.max_bytes is None:
            return train, val
        # Each split gets its share of the budget, so a small limit still validates on held-out files.
        val_budget = int(self.max_bytes * self.val_fraction)
        return take_within(train, self.max_bytes - val_budget), take_within(val, val_budget)

    def work_units(self, split: str, unit_bytes: int) -> list[WorkUnit]:
        train, val = self.files()
        if split == "val" and self.val_fraction == 0:
            return []
        files = train if split == "train" else val
        return [SourceFileGroup(tuple(group)) for group in contiguous_groups(files, [file.size for file in files], unit_bytes)]

    def _tokenize(self, split: str, files: list[SourceFile], tokenizer: Tokenizer) -> Path:
        stats = [(file.relative, file.size) for file in files]
        key = cache_key("python-stdlib", CORPUS_VERSION, python_version(), split, stats, tokenizer.fingerprint)
        size = sum(file.size for file in files)
        return tokenize_to_cache(
            read_documents(files), tokenizer, key, available_cpu_count(), total_chars=size,
            description=f"{len(files)} {split} files ({size / 1e6:.1f} MB) of the Python {python_version()} library",
        )


@dataclass(frozen=True)
class SourceFileGroup(WorkUnit):
    """Consecutive files of a split, in its sample order: each one document."""

    files: tuple[SourceFile, ...]

    @property
    def size(self) -> int:
        return sum(file.size for file in self.files)

    def pieces(self) -> Iterator[Piece]:
        return read_documents(list(self.files))


def python_version() -> str:
    """"3.11.7", or "3.11.7 PyPy": the interpreter whose library this is."""
    version = ".".join(map(str, sys.version_info[:3]))
    return version if sys.implementation.name == "cpython" else f"{version} {sys.implementation.name}"


@functools.lru_cache(maxsize=2)
def list_stdlib_files(include_tests: bool) -> tuple[SourceFile, ...]:
    """The non-empty .py files of the standard library, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, names in os.walk(root):
        parts = Path(folder).relative_to(root).parts
        # Prune while walking: site-packages and test/ hold more files than the library itself.
        subfolders[:] = sorted(name for name in subfolders if is_library_path((*parts, name), include_tests))
        for name in names:
            path = Path(folder) / name
            if name.endswith(".py") and is_library_path((*parts, name), include_tests):
                size = path.stat().st_size
                if size:  # an empty __init__.py would be a document of nothing but bos and eos
                    found.append(SourceFile("/".join((*parts, name)), path, size))
    if not found:
        raise ValueError(
            f"--data PythonStdlib found no .py files of the standard library under {root}: this Python ships "
            "without its source (an embedded or stripped build). Use --data BuiltinStories or --data TextFiles."
        )
    return tuple(sorted(found, key=lambda file: file.relative))


def is_library_path(parts: tuple[str, ...], include_tests: bool) -> bool:
    """Whether a file or folder (its path parts below the library's folder) belongs to the corpus."""
    module = parts[0].removesuffix(".py")
    # NOTE: this one rule leaves out site-packages, config-3.x/ and _sysconfigdata_*.py (not modules of the
    # library), and the `test` package, which is the library's test suite rather than one of its modules.
    if module not in sys.stdlib_module_names and not (include_tests and module == "test"):
        return False
    return include_tests or not TEST_FOLDERS.intersection(part.removesuffix(".py") for part in parts)


def split_files(files: tuple[SourceFile, ...], val_fraction: float) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, val) by a hash of each path, each in a fixed pseudo-random order (the order samples are taken in)."""
    train, val = [], []
    for file in sorted(files, key=lambda file: path_hash("order", file.relative)):
        (val if path_hash("split", file.relative) < val_fraction else train).append(file)
    return train, val


def path_hash(purpose: str, relative: str) -> float:
    """A number in [0, 1) that depends only on the purpose and the path: the same on every machine and run."""
    digest = hashlib.sha256(f"python-stdlib:{purpose}:{relative}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def take_within(files: list[SourceFile], budget: int) -> list[SourceFile]:
    """The files, in order, that fit in `budget` bytes together; a file too large for what is left is skipped."""
    taken = []
    for file in files:
        if file.size <= budget:
            taken.append(file)
            budget -= file.size
    return taken


def read_source(file: SourceFile) -> str:
    # NOTE: the library is UTF-8, but a stray byte in a patched file should cost one character, not the run.
    return file.path.read_text(encoding="utf-8", errors="replace")


def read_documents(files: list[SourceFile]) -> Iterator[Piece]:
    for file in files:
        yield from document_pieces(read_source(file))
