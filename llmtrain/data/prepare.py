"""Tokenize a pretraining data module once, in parallel, into a prepared folder (``llmtrain prepare_data``).

The folder's layout is :mod:`llmtrain.data.manifest`'s. The work is the module's list of work units
(:meth:`~llmtrain.data.base.PretrainDataModule.work_units`, train then val): rank r of W takes units r, r + W,
..., and hands them to a pool of processes, each of which tokenizes a unit into its own shards (written under a
temporary name, then renamed) and then writes the unit's progress record. When every record exists, rank 0
gathers them into the manifest, written last. A killed preparation therefore resumes unit by unit: a unit with
a record is done, any other is done again and overwrites what it left. Nothing depends on the number of ranks or
processes, so the folder is the same byte for byte however it was prepared.
"""

from __future__ import annotations

import json
import hashlib
import multiprocessing
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from llmtrain.data import manifest as layout
from llmtrain.data.manifest import Manifest, Provenance, Shard, Split
from llmtrain.data.tokens import (chunk_pieces, encode_pieces, init_tokenizer_worker, token_dtype,
                                  worker_tokenizer)
from llmtrain.data.units import UNIT_BYTES, WorkUnit
from llmtrain.tokenizer import Tokenizer

PROGRESS_INTERVAL_S = 10.0
"""Rank 0 reports its progress at most this often (and when it is done)."""
KILL_AFTER_UNITS_ENV = "LLMTRAIN_TEST_KILL_AFTER_UNITS"
"""Tests: a rank kills itself (SIGKILL) once it has finished this many units, as a crash would."""


@dataclass
class Preparation(Provenance):
    """What a prepared folder will hold: the same on every rank, and what a resumed preparation must match."""

    units: dict[str, int] = field(default_factory=dict)
    """Work units per split."""


@dataclass(frozen=True)
class Task:
    """One work unit of one split, where the folder is, and how to cut its tokens."""

    root: Path
    split: str
    index: int
    unit: WorkUnit
    shard_tokens: int
    dtype: str


@dataclass(frozen=True)
class Done:
    """What a finished task reports back."""

    split: str
    index: int
    tokens: int
    documents: int


def plan(data: Any, tokenizer: Tokenizer, shard_tokens: int,
         unit_bytes: int = UNIT_BYTES) -> tuple[Preparation, dict[str, list[WorkUnit]]]:
    """The preparation of ``data`` with ``tokenizer``, and its work units by split; ValueError for an empty source."""
    if shard_tokens < 1:
        raise ValueError(f"--shard_tokens {shard_tokens} must be at least 1 (default 2**23 = 8388608)")
    if unit_bytes < 1:
        raise ValueError(f"--unit_bytes {unit_bytes} must be at least 1 (default {UNIT_BYTES})")
    units = {split: data.work_units(split, unit_bytes) for split in layout.SPLITS}
    source = data.describe_source()
    if not units["train"]:
        raise ValueError(f"--data {source} has no training documents: there is nothing to prepare")
    summary = "; ".join(f"{split}: {len(found)} unit{'s' * (len(found) != 1)}, "
                        f"{sum(unit.size for unit in found) / 1e6:.1f} MB" for split, found in units.items() if found)
    preparation = Preparation(
        tokenizer=tokenizer.fingerprint, tokenizer_dir=str(Path(tokenizer.checkpoint_dir).resolve()),
        vocab_size=tokenizer.vocab_size, dtype=token_dtype(tokenizer.vocab_size).name, shard_tokens=shard_tokens,
        source=f"{source} ({summary})", units={split: len(found) for split, found in units.items() if found})
    return preparation, units


def finished(root: Path, preparation: Preparation) -> Optional[Manifest]:
    """The manifest of ``root`` if it holds this preparation already; None if it holds nothing finished.

    A folder prepared (or being prepared) from another source, with another tokenizer or another --shard_tokens
    is a ValueError that names both: the user picked the wrong folder, and overwriting it would destroy data.
    """
    root = Path(root)
    if layout.is_prepared(root):
        manifest = layout.read_manifest(root, "--out_dir")
        if (manifest.tokenizer, manifest.source, manifest.shard_tokens) == (
                preparation.tokenizer, preparation.source, preparation.shard_tokens):
            return manifest
        raise ValueError(f"--out_dir {root} holds data prepared {_difference(manifest, preparation)}; pass another "
                         "--out_dir, or delete the folder to prepare it again")
    underway = _read_preparation(root)
    if underway is not None and underway != preparation:
        raise ValueError(f"--out_dir {root} holds a preparation left unfinished {_difference(underway, preparation)}; "
                         "resume it with the same flags, or pass another --out_dir (or delete the folder)")
    return None


def _difference(found: Any, wanted: Preparation) -> str:
    if found.tokenizer != wanted.tokenizer:
        return f"with the tokenizer in {found.tokenizer_dir}, not the one in {wanted.tokenizer_dir}"
    if found.source != wanted.source:
        return f"from {found.source}, not from {wanted.source}"
    return f"with --shard_tokens {found.shard_tokens}, not {wanted.shard_tokens}"


def forget_damaged(root: Path, damaged: list[Shard]) -> None:
    """Delete the damaged shards and the manifest: the preparation that follows (:func:`prepare_rank`) finds their
    units' records without their shards, and prepares those units again and nothing else."""
    for shard in damaged:
        (Path(root) / shard.name).unlink(missing_ok=True)
    (Path(root) / layout.MANIFEST).unlink(missing_ok=True)


def check_writable(root: Path) -> None:
    """Create ``root`` if needed and write a file there, before any work; a ValueError says why not."""
    probe = Path(root) / layout.PROGRESS_DIR / f".writable{layout.TEMP_MARK}{os.getpid()}"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"--out_dir {root} cannot be written ({error.strerror or error}); pass a folder you may "
                         "write to") from error


def prepare_rank(preparation: Preparation, units: dict[str, list[WorkUnit]], root: Path, num_workers: int,
                 runtime: Any) -> Optional[Manifest]:
    """This rank's share of the work; rank 0 then writes the manifest and returns it (the others return None)."""
    root = Path(root)
    say: Callable[..., None] = print if runtime.is_main else (lambda *args, **kwargs: None)
    if runtime.is_main:
        _start_folder(root, preparation)
    _check_shared(root, runtime)
    tasks = [task for number, task in enumerate(_tasks(root, preparation, units))
             if number % runtime.world_size == runtime.rank and layout.read_progress(root, task.split, task.index) is None]
    total = sum(preparation.units.values())
    say(f"prepare_data: {preparation.source} into {root}: {total - _count_done(root, preparation)} of {total} units "
        f"to do, on {runtime.world_size} rank(s) × {num_workers} process(es)")
    started = said = time.perf_counter()
    tokens = 0
    kill_after = int(os.environ.get(KILL_AFTER_UNITS_ENV) or 0)
    for number, done in enumerate(_run_tasks(tasks, preparation.tokenizer_dir, num_workers), start=1):
        tokens += done.tokens
        now = time.perf_counter()
        if now - said >= PROGRESS_INTERVAL_S or number == len(tasks):
            said, elapsed = now, now - started
            say(f"prepare_data: rank 0 has done {number} of its {len(tasks)} units, {tokens:,} tokens in {elapsed:.0f}s: "
                f"{tokens / elapsed / 1e6:.2f}M tokens/s, about {elapsed / number * (len(tasks) - number):.0f}s to go")
        if number == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    runtime.barrier()  # every unit's record is written (a wait as long as the slowest rank's work)
    tokens = sum(runtime.all_gather_object(tokens))
    if not runtime.is_main:
        return None
    manifest = gather(root, preparation)
    if manifest.splits["train"].tokens == 0:
        raise ValueError(f"--data {preparation.source} has no training tokens (every document is empty): there is "
                         "nothing to prepare")
    layout.write_manifest(root, manifest)
    elapsed = time.perf_counter() - started
    summary = ", ".join(f"{name} {split.tokens:,} tokens ({split.documents:,} documents, {len(split.shards)} shards)"
                        for name, split in manifest.splits.items())
    say(f"prepare_data: prepared {root}: {summary}; this run tokenized {tokens:,} tokens in {elapsed:.1f}s, "
        f"{tokens / max(elapsed, 1e-9) / 1e6:.2f}M tokens/s")
    return manifest


def gather(root: Path, preparation: Preparation) -> Manifest:
    """The manifest from the units' progress records, in unit order."""
    splits = {}
    for split, count in preparation.units.items():
        gathered = Split()
        for index in range(count):
            record = layout.read_progress(root, split, index)
            if record is None:
                raise RuntimeError(f"unit {index} of {split} in {root} has no progress record after every rank "
                                   "finished: a rank skipped it")
            gathered.shards += [Shard(**shard) for shard in record["shards"]]
            gathered.documents += record["documents"]
        splits[split] = gathered
    provenance = {name: getattr(preparation, name) for name in Provenance.__dataclass_fields__}
    return Manifest(**provenance, splits=splits)


def write_unit(task: Task, tokenizer: Tokenizer) -> Done:
    """Tokenize one unit into its shards, then write its progress record (the unit counts as done from then)."""
    dtype = np.dtype(task.dtype)
    shards: list[Shard] = []
    pending: list[np.ndarray] = []
    buffered = documents = 0

    def write_shard(tokens: np.ndarray) -> None:
        name = layout.shard_name(task.split, task.index, len(shards))
        data = tokens.tobytes()
        layout.write_atomic(Path(task.root) / name, data)
        sha256 = hashlib.sha256(data).hexdigest()
        sample = layout.sample_digest(lambda offset, length: data[offset:offset + length], len(data), sha256)
        shards.append(Shard(name, len(tokens), sha256, sample))

    for chunk in chunk_pieces(task.unit.pieces()):
        ids, ended = encode_pieces(tokenizer, chunk)
        pending.append(ids.astype(dtype))
        buffered += len(ids)
        documents += ended
        if buffered >= task.shard_tokens:
            tokens = np.concatenate(pending)
            full = len(tokens) // task.shard_tokens * task.shard_tokens
            for start in range(0, full, task.shard_tokens):
                write_shard(tokens[start:start + task.shard_tokens])
            pending, buffered = [tokens[full:]], len(tokens) - full
    if buffered:
        write_shard(np.concatenate(pending))
    record = {"shards": [asdict(shard) for shard in shards], "documents": documents}
    layout.write_atomic(layout.progress_path(task.root, task.split, task.index), json.dumps(record) + "\n")
    return Done(task.split, task.index, sum(shard.tokens for shard in shards), documents)


def _tasks(root: Path, preparation: Preparation, units: dict[str, list[WorkUnit]]) -> Iterator[Task]:
    for split in preparation.units:
        for index, unit in enumerate(units[split]):
            yield Task(root, split, index, unit, preparation.shard_tokens, preparation.dtype)


def _run_tasks(tasks: list[Task], tokenizer_dir: str, num_workers: int) -> Iterator[Done]:
    """Run ``tasks`` here (one process: the tokenizer's own threads use the cores) or in a pool, as they finish."""
    processes = min(num_workers, len(tasks))
    if processes <= 1:
        tokenizer = Tokenizer(tokenizer_dir)
        for task in tasks:
            yield write_unit(task, tokenizer)
        return
    # NOTE: spawn, not fork: the rank holds threads (torch, gloo), and forking a threaded process can deadlock.
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes, initializer=init_tokenizer_worker, initargs=(tokenizer_dir,)) as pool:
        yield from pool.imap_unordered(_write_unit_in_worker, tasks)


def _write_unit_in_worker(task: Task) -> Done:
    return write_unit(task, worker_tokenizer())


def _start_folder(root: Path, preparation: Preparation) -> None:
    """Rank 0, before the others start: name the preparation, clear a killed one's leftovers, and forget records
    whose shards are gone (their units are done again)."""
    known = _read_preparation(root)
    progress = root / layout.PROGRESS_DIR
    if known is None:  # records without a named preparation may belong to any: trust none
        for record in progress.glob("*.json"):
            record.unlink()
        layout.write_atomic(layout.preparation_path(root), json.dumps(asdict(preparation), indent=2) + "\n")
    for folder in (progress, *(root / split for split in preparation.units)):
        for leftover in folder.glob(f".*{layout.TEMP_MARK}*"):
            leftover.unlink(missing_ok=True)
    itemsize = np.dtype(preparation.dtype).itemsize
    for split, count in preparation.units.items():
        for index in range(count):
            record = layout.read_progress(root, split, index)
            if record is not None and not all(_intact(root / shard["name"], shard["tokens"] * itemsize)
                                              for shard in record["shards"]):
                layout.progress_path(root, split, index).unlink()


def _intact(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size


def _check_shared(root: Path, runtime: Any) -> None:
    """Every rank must see the folder rank 0 prepares into."""
    blind = runtime.ranks_not_seeing(root / layout.PROGRESS_DIR)
    if blind:
        raise ValueError(f"--out_dir {root} is not the same folder on every node: rank(s) {blind} do not see what "
                         "rank 0 wrote there. Put it on a filesystem every node shares, or prepare on each node "
                         "separately (--num_nodes 1) into a folder of its own")


def _count_done(root: Path, preparation: Preparation) -> int:
    return sum(layout.read_progress(root, split, index) is not None
               for split, count in preparation.units.items() for index in range(count))


def _read_preparation(root: Path) -> Optional[Preparation]:
    path = layout.preparation_path(root)
    if not path.is_file():
        return None
    try:
        return Preparation(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None
