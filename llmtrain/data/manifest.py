"""The layout of a prepared data folder (``llmtrain prepare_data``), in one place.

    DIR/manifest.json                 written last and atomically: its presence means the folder is complete
    DIR/<split>/unit-UUUUU-SSSS.bin   raw token ids (``dtype``): work unit UUUUU's tokens in shards of at most
                                      ``shard_tokens``
    DIR/.progress/<split>-UUUUU.json  one record per finished work unit (its shards), what a killed
                                      preparation resumes from; the manifest gathers them
    DIR/.progress/preparation.json    what is being prepared (tokenizer, source, shard size, units): a
                                      preparation resumes only the one it names

Shards are listed in unit order, then shard order, which never depends on how many processes prepared
the folder. A document is tokenized as the token cache does (:func:`llmtrain.data.tokens.encode_pieces`):
the tokenizer's default bos in front, eos after it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

FORMAT = 1
"""Bump when the layout changes; a reader refuses other formats with a message to prepare again."""
MANIFEST = "manifest.json"
PROGRESS_DIR = ".progress"
SPLITS = ("train", "val")
TEMP_MARK = ".tmp-"
"""In the name of a file still being written (``.NAME.tmp-PID``); a killed writer's leftovers can go."""


def shard_name(split: str, unit: int, shard: int) -> str:
    """A shard's path relative to the prepared folder."""
    return f"{split}/unit-{unit:05d}-{shard:04d}.bin"


def progress_path(root: Path, split: str, unit: int) -> Path:
    return Path(root) / PROGRESS_DIR / f"{split}-{unit:05d}.json"


def preparation_path(root: Path) -> Path:
    return Path(root) / PROGRESS_DIR / "preparation.json"


@dataclass(frozen=True)
class Shard:
    name: str
    """Path relative to the prepared folder."""
    tokens: int
    sha256: str


@dataclass
class Split:
    shards: list[Shard] = field(default_factory=list)
    documents: int = 0

    @property
    def tokens(self) -> int:
        return sum(shard.tokens for shard in self.shards)


@dataclass
class Provenance:
    """What made a folder's tokens: the manifest's header, and what a preparation underway records."""

    tokenizer: str
    """The fingerprint of the tokenizer that made the tokens (``Tokenizer.fingerprint``)."""
    tokenizer_dir: str
    """Where that tokenizer was (informative: the fingerprint decides)."""
    vocab_size: int
    dtype: str
    shard_tokens: int
    source: str
    """The data module and its flags, as a person reads them."""


@dataclass
class Manifest(Provenance):
    splits: dict[str, Split] = field(default_factory=dict)
    format: int = FORMAT

    def to_json(self) -> str:
        data = asdict(self)
        for name, split in self.splits.items():
            data["splits"][name]["tokens"] = split.tokens
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        splits = {name: Split([Shard(**shard) for shard in split["shards"]], split.get("documents", 0))
                  for name, split in data.pop("splits").items()}
        return cls(**{key: value for key, value in data.items() if key in cls.__dataclass_fields__}, splits=splits)


def write_atomic(path: Path, content: Union[str, bytes]) -> None:
    """``content`` into ``path`` under a temporary name, fsynced, then renamed: a reader sees all of it or none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")
    with open(temp, "wb" if isinstance(content, bytes) else "w") as handle:
        handle.write(content)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)


def write_manifest(root: Path, manifest: Manifest) -> None:
    write_atomic(Path(root) / MANIFEST, manifest.to_json())


def is_prepared(root: Path) -> bool:
    return (Path(root) / MANIFEST).is_file()


def read_manifest(root: Path, flag: str = "--data.path") -> Manifest:
    """The manifest of a complete prepared folder; a clear error naming ``flag`` otherwise."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {root} is not a prepared data folder (no {MANIFEST}): prepare it with "
                                f"`llmtrain prepare_data ... --out_dir {root}`, or let a running preparation finish")
    try:
        manifest = Manifest.from_json(path.read_text())
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{path} is not a manifest llmtrain can read ({error}); prepare {root} again") from error
    if manifest.format != FORMAT:
        raise ValueError(f"{path} has format {manifest.format}, this llmtrain reads {FORMAT}; prepare {root} again")
    return manifest


def check_shards(root: Path, manifest: Manifest, *, checksums: bool = False) -> None:
    """Every shard present with the size its token count implies (and, with ``checksums``, its sha256)."""
    itemsize = np.dtype(manifest.dtype).itemsize
    for split in manifest.splits.values():
        for shard in split.shards:
            path = Path(root) / shard.name
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing from the prepared folder {root} (its manifest lists it): "
                                        "restore it, or prepare the folder again")
            expected = shard.tokens * itemsize
            if path.stat().st_size != expected:
                raise ValueError(f"{path} has {path.stat().st_size} bytes, but {MANIFEST} says {shard.tokens} tokens "
                                 f"({expected} bytes): it is truncated or damaged; prepare {root} again")
            if checksums and file_sha256(path) != shard.sha256:
                raise ValueError(f"{path} does not match the checksum in {MANIFEST}: it is damaged; prepare "
                                 f"{root} again")


def check_tokenizer(root: Path, manifest: Manifest, fingerprint: str, tokenizer_dir: Any, flag: str) -> None:
    if manifest.tokenizer != fingerprint:
        raise ValueError(f"{flag} {root} was prepared with the tokenizer in {manifest.tokenizer_dir}, not the run's "
                         f"({tokenizer_dir}): their files differ. Pass --tokenizer_dir {manifest.tokenizer_dir}, or "
                         "prepare the data again with this tokenizer")


def open_shard(root: Path, shard: Shard, dtype: str) -> np.ndarray:
    """A shard's tokens, memory-mapped read-only (nothing is read until used)."""
    if shard.tokens == 0:  # numpy cannot memory-map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(Path(root) / shard.name, dtype=dtype, mode="r", shape=(shard.tokens,))


def file_sha256(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def read_progress(root: Path, split: str, unit: int) -> Optional[dict]:
    """A finished unit's record ({"shards": [...], "documents": n}), or None if it must be (re)done."""
    path = progress_path(root, split, unit)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None
