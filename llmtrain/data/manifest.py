"""The layout of a prepared data folder (``llmtrain prepare_data``), in one place.

    DIR/manifest.json                 written last and atomically: its presence means the folder is complete
    DIR/<split>/unit-UUUUU-SSSS.bin   raw token ids (``dtype``): work unit UUUUU's tokens in shards of at most
                                      ``shard_tokens``
    DIR/.progress/<split>-UUUUU.json  one record per finished work unit (its shards), what a killed
                                      preparation resumes from; the manifest gathers them
    DIR/.progress/preparation.json    what is being prepared (tokenizer, source, shard size, units): a
                                      preparation resumes only the one it names

Each shard is listed with its sha256 and a sampled checksum (:func:`sample_digest`: two 64 KiB blocks and the
sha256). A run checks its share of the shards' sizes and sampled checksums (a stat and 128 KiB a shard), or with
--data.verify true their sha256 (every byte; about 540 MB/s a core here); every batch's ids are checked against the
vocabulary, which catches the flipped bytes a sample misses where they make an impossible id.

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
from typing import Any, Callable, Optional, Union

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


SAMPLE_BLOCK = 1 << 16
"""Bytes of each block a shard's sampled check reads (:func:`sample_ranges`)."""


@dataclass(frozen=True)
class Shard:
    name: str
    """Path relative to the prepared folder."""
    tokens: int
    sha256: str
    sample: str = ""
    """:func:`sample_digest` of the shard: what a run checks without reading it all ("": a folder prepared before
    it was written, whose runs check sizes only)."""


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
    except RecursionError:
        raise ValueError(f"{path} is nested too deeply to be a manifest; prepare {root} again") from None
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{path} is not a manifest llmtrain can read ({error}); prepare {root} again") from error
    if manifest.format != FORMAT:
        raise ValueError(f"{path} has format {manifest.format}, this llmtrain reads {FORMAT}; prepare {root} again")
    return manifest


def check_shards(root: Path, manifest: Manifest, *, flag: str = "--data.path", check: str = "sample", rank: int = 0,
                 world: int = 1) -> None:
    """Shards ``rank``, ``rank + world``, ... of the folder present and intact, else one error naming the damaged
    ones and the repair. Each of ``world`` ranks checking its share checks every shard once, whatever the count."""
    damaged = damaged_shards(root, manifest, check=check, rank=rank, world=world)
    if damaged:
        verify = " with --verify true" if check == "sha256" else ""
        raise ValueError(f"{flag} {root}: {describe_damage(damaged)}. Repair: run the prepare_data command that "
                         f"made the folder again{verify} (its source: {manifest.source}): it finds the damaged "
                         "shards and prepares their units again, keeping the rest")


def damaged_shards(root: Path, manifest: Manifest, *, check: str = "sample", rank: int = 0,
                   world: int = 1) -> list[tuple[Shard, str]]:
    """Shards ``rank``, ``rank + world``, ... that are missing, of another size than their token count, or at odds
    with the manifest's :func:`sample_digest` (``check`` "sample": reads 2 blocks of SAMPLE_BLOCK bytes) or sha256
    ("sha256": reads all of each), each with what is wrong. ``check`` "size" stats them only."""
    itemsize = np.dtype(manifest.dtype).itemsize
    shards = [shard for split in manifest.splits.values() for shard in split.shards][rank::world]
    return [(shard, problem) for shard in shards if (problem := shard_problem(Path(root), shard, itemsize, check))]


def describe_damage(damaged: list[tuple[Shard, str]], shown: int = 3) -> str:
    """The first few problems of :func:`damaged_shards`, and how many more there are."""
    more = f"; and {len(damaged) - shown} more" if len(damaged) > shown else ""
    return "; ".join(problem for _, problem in damaged[:shown]) + more


def shard_problem(root: Path, shard: Shard, itemsize: int, check: str) -> str:
    """Why one shard is damaged ("" when it is not)."""
    path = root / shard.name
    if not path.is_file():
        return f"{path} is missing"
    size, expected = path.stat().st_size, shard.tokens * itemsize
    if size != expected:
        return (f"{path} has {size} bytes, not the {expected} of its {shard.tokens} tokens in {MANIFEST}: it is "
                f"{'truncated' if size < expected else 'damaged'}")
    if check == "sha256" and file_sha256(path) != shard.sha256:
        return f"{path} does not match its sha256 in {MANIFEST}"
    if check == "sample" and shard.sample and read_sample_digest(path, shard.sha256) != shard.sample:
        return f"{path} does not match its sampled checksum in {MANIFEST}"
    return ""


def sample_ranges(size: int, sha256: str) -> list[tuple[int, int]]:
    """The (offset, length) blocks a shard's sampled check reads: its first, and one its sha256 picks (another
    place in every shard), each of SAMPLE_BLOCK bytes or what the file holds."""
    blocks = max(1, -(-size // SAMPLE_BLOCK))
    picked = int.from_bytes(hashlib.sha256(sha256.encode()).digest()[:8], "big") % blocks
    return [(block * SAMPLE_BLOCK, min(SAMPLE_BLOCK, size - block * SAMPLE_BLOCK)) for block in sorted({0, picked})]


def sample_digest(read: Callable[[int, int], bytes], size: int, sha256: str) -> str:
    """The sampled checksum of a shard of ``size`` bytes, whose blocks ``read(offset, length)`` returns. It covers
    the manifest's sha256 too, so an edited sha256 fails the sampled check as well as the full one."""
    digest = hashlib.sha256(sha256.encode())
    for offset, length in sample_ranges(size, sha256):
        digest.update(read(offset, length))
    return digest.hexdigest()


def read_sample_digest(path: Path, sha256: str) -> str:
    """:func:`sample_digest` of the file at ``path``, reading only its sampled blocks."""
    with open(path, "rb") as handle:
        return sample_digest(lambda offset, length: os.pread(handle.fileno(), length, offset),
                             os.fstat(handle.fileno()).st_size, sha256)


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
