"""Distributed-checkpoint (DCP) loads that never run a pickle.

torch's ``FileSystemReader`` unpickles a DCP folder's ``.metadata`` with plain ``pickle.load``, and its
``DefaultLoadPlanner`` reads every non-tensor (BYTE_IO) item, such as an optimizer's lr or betas, with
``torch.load(weights_only=False)``: a sharded checkpoint from elsewhere could run code as it loads.
:class:`SafeReader` unpickles the index with an unpickler that knows only the names an index holds, and
:class:`SafeLoadPlanner` reads each item with ``torch.load(weights_only=True)``; both refuse anything else with a
:class:`~llmtrain.checkpoint.state.DamagedCheckpointError` naming the file. Every llmtrain DCP load goes through
:func:`load`; :func:`check_dcp_files` reads the index and the items the same way before a run starts.

NOTE: imports torch.distributed.checkpoint, which takes seconds: import this module where a DCP folder is read.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from llmtrain.checkpoint import layout
from llmtrain.checkpoint.state import DamagedCheckpointError, refused_global

# What a DCP ``.metadata`` pickle may name; anything else is refused before it is looked up.
_METADATA_GLOBALS = {
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # and the classes it defines


class _Refused(pickle.UnpicklingError):
    """The index names something it never holds (the message is the name)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # NOTE: a dotted name is looked up attribute by attribute ("os.system" in the metadata module, which imports
        # os): only plain names are allowed, and of the metadata module only the classes it defines.
        allowed = "." not in name and ((module, name) in _METADATA_GLOBALS or _defined_class(module, name) or (
            module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                            torch.memory_format))))
        if not allowed:
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


def _defined_class(module: str, name: str) -> bool:
    """``name`` is a class that the DCP metadata module defines (Metadata, TensorProperties, ...)."""
    if module != _METADATA_MODULE:
        return False
    import torch.distributed.checkpoint.metadata as metadata_module

    found = getattr(metadata_module, name, None)
    return isinstance(found, type) and found.__module__ == _METADATA_MODULE


def read_metadata(path: Path) -> Metadata:
    """A DCP ``.metadata`` file, unpickled knowing only what an index holds; anything else is refused."""
    data = Path(path).read_bytes()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as error:
        raise DamagedCheckpointError(
            f"{path} names {error}, which a distributed checkpoint never holds; llmtrain will not unpickle it, as "
            "it could run code. Use a checkpoint written by llmtrain or torch.distributed.checkpoint") from None
    except Exception as error:  # a pickle cut short or garbled: the index is damaged
        raise DamagedCheckpointError(f"{path} cannot be read ({type(error).__name__}: {error}): the index of the "
                                     "distributed checkpoint is damaged or truncated") from None
    if not isinstance(metadata, Metadata):
        raise DamagedCheckpointError(f"{path} is not the index of a distributed checkpoint (it holds a "
                                     f"{type(metadata).__name__}); use a checkpoint written by llmtrain")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """torch's reader, whose ``.metadata`` is read by :func:`read_metadata` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's planner, whose non-tensor items load with ``torch.load(weights_only=True)``; ``reader`` names the file
    of a refused one."""

    def __init__(self, reader: dcp.FileSystemReader) -> None:
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = self.unpickle(read_item, value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    def unpickle(self, read_item: ReadItem, value: io.BytesIO) -> Any:
        try:
            return torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            path = Path(self.reader.path) / self.reader.storage_data[read_item.storage_index].relative_path
            raise DamagedCheckpointError(
                f"{path}: its entry {read_item.dest_index.fqn!r} holds a pickled {refused_global(error) or 'object'} "
                "where a distributed checkpoint holds only plain values; llmtrain will not unpickle it, as it could "
                "run code. Use a checkpoint written by llmtrain or torch.distributed.checkpoint") from None


class _ItemChecker(SafeLoadPlanner):
    """Reads each non-tensor item as :class:`SafeLoadPlanner` does, and keeps nothing."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.unpickle(read_item, value)


def load(state_dict: dict, dcp_dir: Path, **arguments: Any) -> None:
    """``dcp.load`` of ``dcp_dir`` into ``state_dict`` through :class:`SafeReader` and :class:`SafeLoadPlanner`.

    A refusal on any rank is raised on every rank as itself, not inside DCP's CheckpointException (a BaseException
    whose text is a traceback); ``arguments`` are dcp.load's (process_group, no_dist).
    """
    reader = SafeReader(str(dcp_dir))
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(reader), **arguments)
    except CheckpointException as error:
        refusals = [failure for failure, _ in error.failures.values() if isinstance(failure, DamagedCheckpointError)]
        if refusals:
            raise refusals[0] from None
        raise


def check_dcp_files(dcp_dir: Path) -> None:
    """Read ``dcp_dir``'s index and every non-tensor item as a load would, refusing what a load refuses.

    The items are a few plain values (each param group's settings), which every rank reads in a load anyway.
    """
    path = Path(dcp_dir) / layout.DCP_METADATA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{dcp_dir} has no {layout.DCP_METADATA_FILE} file, so it is not a complete "
                                "distributed checkpoint")
    reader = SafeReader(str(dcp_dir))
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    items = [ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size((0,)), storage_index=index,
                      storage_offsets=torch.Size((0,)), lengths=torch.Size((0,)))
             for index in metadata.storage_data
             if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)]
    reader.read_data(LoadPlan(items), _ItemChecker(reader)).wait()
