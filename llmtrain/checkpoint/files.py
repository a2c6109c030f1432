"""Writing checkpoint directories so that a crash leaves either a complete one or none.

Every directory is written under a temporary name (``layout.temporary_dir``), fsynced and renamed
into place; its marker (``checkpoint.json``) goes last and records every file's size and checksum, which
resume checks (:mod:`llmtrain.checkpoint.resume`). Resume looks only at complete ``step-*`` directories;
the next save deletes what a killed save left behind. ``--train.keep_last N`` deletes older step
checkpoints only once a newer one is complete (:func:`prune_checkpoints`).
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch
import yaml

from llmtrain.checkpoint import layout
from llmtrain.checkpoint.size import disk_full_said
from llmtrain import callbacks
from llmtrain.yaml_file import read_yaml


# ----------------------------------------------------------------------------------- housekeeping
def remove_leftovers(out_dir: Path) -> list[Path]:
    """Delete the temporary directories of saves that were killed (never a complete checkpoint).

    Call on one rank, before a save starts, while no other save writes into ``out_dir``.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    removed = [child for child in out_dir.iterdir() if layout.LEFTOVER_DIR.match(child.name) and child.is_dir()]
    for child in removed:
        shutil.rmtree(child, ignore_errors=True)
    return removed


def prune_checkpoints(out_dir: Path, keep_last: Optional[int], keep: Optional[Path] = None,
                      good: Optional[Path] = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete step checkpoints; never ``keep`` (the one just written) nor
    ``good`` (the run's last good one, while a newer one is not known to be: llmtrain.train.nonfinite.Rewind).

    Each goes in two moves: a rename to a leftover name (atomic), then the deletion, so a crash in
    between never leaves a half-deleted directory that still looks complete.
    """
    if keep_last is None:
        return []
    spared = {Path(path).resolve() for path in (keep, good) if path is not None}
    checkpoints = [path for _, path in layout.list_checkpoints(out_dir)]
    doomed = [path for path in checkpoints[:-keep_last] if path.resolve() not in spared]
    for path in doomed:
        trash = layout.trash_dir(path, os.getpid())
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def set_aside_newer(out_dir: Path, resumed: Optional[Path]) -> list[Path]:
    """Move the checkpoints in ``out_dir`` newer than ``resumed`` (a run resumed from an older one: a rewind; a
    diverged run going back to its last good one, None: all of them) into ``out_dir/rewound/``, where
    ``--resume auto`` does not look; returns where they went.

    NOTE: left in place, the abandoned branch's newest checkpoint would be what ``--resume auto`` picks after a
    crash, before this run had saved past it. Nothing is deleted: each move is one rename.
    """
    out_dir = Path(out_dir)
    resumed_step = 0
    if resumed is not None:
        resumed = Path(resumed)
        if resumed.resolve().parent != out_dir.resolve() or not layout.STEP_DIR.match(resumed.name):
            return []
        resumed_step = int(layout.STEP_DIR.match(resumed.name).group(1))
    moved = []
    for step, path in layout.list_checkpoints(out_dir):
        if step > resumed_step:
            target = out_dir / layout.REWOUND_DIR / path.name
            target.parent.mkdir(exist_ok=True)
            copy = 1
            while target.exists():  # rewound twice past the same step
                target, copy = target.with_name(f"{path.name}.{copy}"), copy + 1
            os.replace(path, target)
            moved.append(target)
    return moved


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file and directory under ``path`` to disk (before the rename that publishes it)."""
    for file in sorted(path.rglob("*")):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
        elif file.is_dir():
            fsync_dir(file)
    fsync_dir(path)


def check_output_dir(output_dir: Path) -> None:
    """Refuse an output folder that holds anything: a conversion or merge writes a new one, never over a run."""
    output_dir = Path(output_dir)
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise FileExistsError(f"{output_dir} already exists and is not empty; remove it or choose another one")


def install_dir(tmp: Path, target: Path) -> None:
    """Rename the complete, fsynced directory ``tmp`` to ``target``, replacing an older ``target``.

    NOTE: a directory cannot replace a non-empty one in one rename. The old copy first moves to a
    leftover name and is deleted only once the new one is in place; a crash in between leaves no
    ``target`` and a leftover that the next save deletes (the step checkpoints are still there).
    """
    if target.exists():
        trash = layout.trash_dir(target, os.getpid())
        os.replace(target, trash)
        os.replace(tmp, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, target)
    fsync_dir(target.parent)


# ---------------------------------------------------------------------------------------- marker
def file_sizes(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` (DCP shards included) as relative path -> bytes; the marker excluded."""
    directory = Path(directory)
    return {relative: (directory / relative).stat().st_size for relative in relative_files(directory)}


def relative_files(directory: Path) -> list[str]:
    """The relative paths of the files under ``directory``, the marker excluded, sorted, from directory listings
    alone: a thousand ranks that each look for their own files must not stat every rank's (a shared filesystem's
    metadata servers would serve a million stats)."""
    found = []
    for root, _, names in os.walk(directory):
        prefix = Path(root).relative_to(directory)
        found += [(prefix / name).as_posix() for name in names if name != layout.MARKER_FILE]
    return sorted(found)


CHECKSUM_ALGORITHM = "xxh3_128"
"""What the marker's checksums are. NOTE: xxh3 hashes at memory speed (about 10 GB/s on one core, blake2b under
1 GB/s): a save pays about 0.15 s per GiB hashed as it is written and 0.5 s per GiB read back, some 1.7 s for a
TinyLlama-1.1B step checkpoint in bf16 (BENCHMARKS.md). It finds any changed byte, not a forger, which a checksum
beside the file could not stop anyway."""
_CHUNK_BYTES = 16 << 20


def checksum(path: Path) -> str:
    """The hex digest of the file at ``path`` (:data:`CHECKSUM_ALGORITHM`), read in chunks: no file is held whole."""
    import xxhash  # NOTE: lazy, as every module a CLI path may not need

    digest = xxhash.xxh3_128()
    buffer = memoryview(bytearray(_CHUNK_BYTES))
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(buffer[:count])
    return digest.hexdigest()


class _HashingWriter(io.RawIOBase):
    """Passes what is written on to ``handle`` and into ``digest``, in order; a large piece is hashed on a thread
    while it is written (xxhash and the write both release the GIL), so hashing adds little to a save.

    NOTE: the hash of a piece ends before its write() returns: torch.save hands buffers that it may reuse after.
    """

    _OVERLAP_BYTES = 1 << 20
    """Smaller pieces (torch.save's zip records) are hashed in line: a thread's handoff would cost more."""

    def __init__(self, handle: Any, digest: Any) -> None:
        super().__init__()
        self.handle, self.digest = handle, digest
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmtrain-checksum")

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.nbytes < self._OVERLAP_BYTES:
            self.digest.update(view)
            return self.handle.write(view)
        hashed = self._hasher.submit(self.digest.update, view)
        try:
            return self.handle.write(view)
        finally:
            hashed.result()

    def close(self) -> None:
        self._hasher.shutdown()
        super().close()


def save_checksummed(obj: Any, path: Path) -> str:
    """``torch.save(obj, path)``; returns the file's :func:`checksum`, computed as the bytes go out, not read back.

    NOTE: torch.save writes a file object from start to end without seeking (its zip's index comes last), so the
    running hash is the file's. Reading a 1.1B model's optimizer state back cost more than hashing it.
    """
    import xxhash  # NOTE: lazy, as in checksum

    digest = xxhash.xxh3_128()
    with open(path, "wb") as handle, _HashingWriter(handle, digest) as writer:
        torch.save(obj, writer)
    return digest.hexdigest()


def file_checksums(directory: Path, relative_paths: Iterable[str]) -> dict[str, str]:
    """``relative_paths`` (inside ``directory``) -> :func:`checksum`."""
    return {relative: checksum(Path(directory) / relative) for relative in relative_paths}


def checksum_share(relative_paths: Iterable[str], rank: int, world_size: int) -> list[str]:
    """The files whose checksums ``rank`` computes, on save and on resume: each rank those it wrote and reads on
    its own (its DCP shards, its ZeRO partitions; ``layout.writer_rank``), rank 0 the rest (it writes and reads the
    full weights and the training state). No rank hashes the whole of a sharded checkpoint."""
    return [relative for relative in relative_paths
            if (layout.writer_rank(relative) or 0) % world_size == rank]


def write_marker(directory: Path, fields: dict, checksums: Optional[dict[str, str]] = None) -> None:
    """Mark ``directory`` complete: flush everything in it, then write the marker with every file's size and
    checksum. ``checksums``: those already known (computed by the ranks that wrote the files); this process
    computes the others.

    The one place a marker is written. It goes last, so its presence means the rest is on disk.
    """
    directory = Path(directory)
    callbacks.active().on_checkpoint_written(directory)  # e.g. a test that kills the run mid-save
    fsync_tree(directory)
    sizes = file_sizes(directory)
    known = checksums or {}
    digests = {**file_checksums(directory, [relative for relative in sizes if relative not in known]), **known}
    meta = {"format_version": layout.FORMAT_VERSION, "written_at": time.time(),
            "files": sorted(p.name for p in directory.iterdir() if p.name != layout.MARKER_FILE),
            "sizes": sizes, "checksum_algorithm": CHECKSUM_ALGORITHM,
            "checksums": {relative: digests[relative] for relative in sizes}, **fields}
    with open(directory / layout.MARKER_FILE, "w") as handle:
        handle.write(json.dumps(meta, indent=2))
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(directory)


def read_marker(directory: Path) -> dict:
    """The marker of a complete checkpoint; a missing or unreadable one is an error that names it."""
    path = Path(directory) / layout.MARKER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a complete checkpoint: it has no {layout.MARKER_FILE}")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}): the checkpoint is damaged; resume from an "
                         "earlier one (--resume PATH) or delete it") from error
    if not isinstance(meta, dict):
        raise ValueError(f"{path} must hold a JSON object; the checkpoint is damaged")
    return meta


# --------------------------------------------------------------------------------------- writing
def model_weights_for_saving(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the second name of tied tensors (safetensors stores each storage once) and make contiguous."""
    seen: dict[tuple[int, int], str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if tensor.numel() and key in seen:
            continue
        seen[key] = name
        out[name] = tensor.detach().contiguous()
    return out


def save_weights(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    save_safetensors(model_weights_for_saving(state_dict), path)


def save_weights_checksummed(state_dict: dict[str, torch.Tensor], path: Path) -> str:
    """:func:`save_weights`, returning the file's :func:`checksum` computed as the bytes go out (as
    :func:`save_checksummed`): reading a 1.1B model's weights back to hash them cost a step checkpoint's save 4%.

    NOTE: safetensors' own writer hands no bytes to Python, so this one writes the format itself, as
    :func:`stream_weights` does: the header (here known before the data) then each tensor's bytes in its order.
    """
    import xxhash  # NOTE: lazy, as in checksum

    tensors = model_weights_for_saving(state_dict)
    header: dict[str, Any] = {"__metadata__": SAFETENSORS_METADATA}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text = text.ljust(-(-len(text) // 8) * 8, b" ")  # the data starts 8-byte aligned, as safetensors writes it
    digest = xxhash.xxh3_128()
    with open(path, "wb") as handle, _HashingWriter(handle, digest) as writer:
        writer.write(len(text).to_bytes(8, "little"))
        writer.write(text)
        for tensor in tensors.values():
            writer.write(memoryview(tensor.cpu().reshape(-1).view(torch.uint8).numpy()))
    _readable_as_umask(path)
    return digest.hexdigest()


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``tensors`` as a safetensors file, readable by whom the process's umask lets read its other files.

    NOTE: safetensors (0.8) writes its files with mode 0600 whatever the umask, so a checkpoint's weights were
    private while its JSON and YAML files beside them were not: a colleague on a shared cluster could read the
    folder but not load the model.
    """
    from safetensors.torch import save_file  # NOTE: lazy, as in every CLI path that may not save at all

    save_file(tensors, str(path), metadata=SAFETENSORS_METADATA)
    _readable_as_umask(path)


def _readable_as_umask(path: Path) -> None:
    """Open ``path`` to whom the process's umask lets read its files (:func:`save_safetensors`)."""
    umask = _umask()
    if umask is None:
        return  # NOTE: left private, as safetensors wrote it, rather than opened wider than the umask may allow
    try:
        os.chmod(path, 0o666 & ~umask)
    except OSError:
        pass  # NOTE: a mount that keeps no modes (SMB, FUSE object stores) refuses chmod; the weights are written


def _umask() -> Optional[int]:
    """This process's umask, read without changing it (os.umask sets it, racing with threads that create files);
    None where the system does not say (no /proc: macOS, BSD)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    line = next((line for line in status.splitlines() if line.startswith("Umask:")), None)
    return int(line.split()[1], 8) if line is not None else None


SAFETENSORS_METADATA = {"format": "pt"}
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def stream_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], path: Path,
                   shapes: dict[str, tuple[int, ...]]) -> None:
    """Write a safetensors file from (name, tensor) pairs as they come, so that the caller can free each tensor
    once it is written and the whole state dict never exists. ``shapes``: every tensor the file must hold.

    A safetensors file is an 8-byte header length, a JSON header (each tensor's dtype, shape and byte range)
    and the data. The header goes first but is known last: room for its longest possible form is reserved
    from ``shapes``, the data written after it, and the header written into the room, padded with spaces
    (which the format allows).
    """
    longest = {name: {"dtype": "F8_E4M3", "shape": list(shape), "data_offsets": [2**64, 2**64]}
               for name, shape in shapes.items()}
    room = -(-len(json.dumps({"__metadata__": SAFETENSORS_METADATA, **longest}).encode()) // 8) * 8
    header: dict[str, Any] = {"__metadata__": SAFETENSORS_METADATA}
    offset = 0
    with open(path, "wb") as handle:
        handle.seek(8 + room)
        for name, tensor in named_tensors:
            if name in header or shapes.get(name) != tuple(tensor.shape):
                raise ValueError(f"{path}: {name!r} of shape {tuple(tensor.shape)} is not a tensor this file holds "
                                 f"once (expected: {shapes.get(name, 'no such name')})")
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            handle.write(memoryview(data))
            header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                            "data_offsets": [offset, offset + data.nbytes]}
            offset += data.nbytes
        missing = [name for name in shapes if name not in header]
        if missing:
            raise ValueError(f"{path}: the weights lack {len(missing)} tensors, e.g. {missing[:3]}")
        handle.seek(0)
        handle.write(room.to_bytes(8, "little"))
        handle.write(json.dumps(header).encode().ljust(room, b" "))


def stored_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor a model directory of ``config`` stores (a tied output layer is the embedding)."""
    from llmtrain.model import GPT

    with torch.device("meta"):
        model = GPT(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if config.tie_embeddings:
        del shapes["lm_head.weight"]
    return shapes


def write_metadata_files(directory: Path, *, model_config: Any, hyperparameters: Optional[dict], tokenizer: Any,
                         write_extras: Optional[Callable[[Path], None]] = None) -> None:
    """What every checkpoint holds besides tensors: architecture, run config, tokenizer and extras."""
    model_config.save(directory / layout.CONFIG_FILE)
    if hyperparameters is not None:
        (directory / layout.HPARAMS_FILE).write_text(yaml.safe_dump(hyperparameters, sort_keys=False))
    if tokenizer is not None:
        tokenizer.save(directory)
    if write_extras is not None:
        write_extras(directory)


def write_model_dir(target: Path, *, state_dict: Union[dict[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                    model_config: Any, hyperparameters: Optional[dict], tokenizer: Any, marker: Optional[dict] = None,
                    write_extras: Optional[Callable[[Path], None]] = None) -> Path:
    """Write a complete model directory atomically at ``target`` (replacing an older one only once complete).

    ``state_dict``: a dict, or (name, tensor) pairs, which are written as they come (:func:`stream_weights`:
    every tensor of ``model_config``'s model, a tied output layer's second name skipped).
    ``write_extras(directory)`` adds any other files (the prompt style, LoRA settings) before the marker.
    """
    target = Path(target)
    tmp = layout.temporary_dir(target, os.getpid())
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        with disk_full_said(tmp):
            if isinstance(state_dict, dict):
                save_weights(state_dict, tmp / layout.MODEL_FILE)
            else:
                shapes = stored_shapes(model_config)
                tied_head = "lm_head.weight" not in shapes  # stored once, as the embedding
                stream_weights(((name, tensor) for name, tensor in state_dict
                                if not (tied_head and name == "lm_head.weight")), tmp / layout.MODEL_FILE, shapes)
            write_metadata_files(tmp, model_config=model_config, hyperparameters=hyperparameters,
                                 tokenizer=tokenizer, write_extras=write_extras)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_marker(tmp, marker or {})
    install_dir(tmp, target)
    return target


def link_model_dir(source: Path, target: Path) -> Path:
    """Make ``target`` a model directory with the same model files as ``source`` (hard links where possible)."""
    source, target = Path(source), Path(target)
    tmp = layout.temporary_dir(target, os.getpid())
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        if not file.is_file() or file.name in (layout.STATE_FILE, layout.MARKER_FILE):
            continue
        try:
            os.link(file, tmp / file.name)
        except OSError:
            shutil.copy2(file, tmp / file.name)
    meta = read_marker(source)
    fields = {key: value for key, value in meta.items() if key not in ("format_version", "written_at", "files",
                                                                       "sizes", "checksum_algorithm", "checksums")}
    linked = {relative: digest for relative, digest in meta.get("checksums", {}).items() if (tmp / relative).is_file()}
    write_marker(tmp, {**fields, "source": source.name, "kind": "model"},
                 checksums=linked if meta.get("checksum_algorithm") == CHECKSUM_ALGORITHM else None)
    install_dir(tmp, target)
    return target


def read_hyperparameters(checkpoint_dir: Path) -> dict:
    path = Path(checkpoint_dir) / layout.HPARAMS_FILE
    return read_yaml(path) if path.is_file() else {}
