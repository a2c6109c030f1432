"""Sharded checkpoints through torch.distributed.checkpoint (DCP), and full-weight loading under FSDP.

A sharded training checkpoint ``step-NNNNNNNN/`` holds::

    dcp/                     model + optimizer, every rank's shards (loads at any world size)
    training_state.pt        counters, data position, every rank's RNG, loss scaler, world size
    model_config.yaml, hyperparameters.yaml, tokenizer files
    checkpoint.json          written last, ``"format": "sharded"``

``final/`` is always a full model directory (``model.safetensors``), whatever the format of the steps.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from llmtrain import checkpoint as layout
from llmtrain.distributed.runtime import Runtime
from llmtrain.train.loop import TrainState

CheckpointFormat = Literal["full", "sharded"]
DCP_DIR = "dcp"


def checkpoint_format(checkpoint_dir: Path) -> CheckpointFormat:
    """``"full"`` or ``"sharded"``, from the marker of a complete checkpoint (markers without a format are full)."""
    marker = Path(checkpoint_dir) / layout.MARKER_FILE
    if not marker.is_file():
        raise FileNotFoundError(f"{checkpoint_dir} is not a complete checkpoint: it has no {layout.MARKER_FILE}")
    fmt = json.loads(marker.read_text()).get("format", "full")
    if fmt not in ("full", "sharded"):
        raise ValueError(f"{marker}: unknown checkpoint format {fmt!r}; this llmtrain reads `full` and `sharded`")
    return fmt


def _is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _single_process_quietly():
    """DCP warns whenever it runs without a process group; for a single process that is the plan."""
    with warnings.catch_warnings():
        if not _is_distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# What a DCP ``.metadata`` pickle may name. torch's FileSystemReader unpickles that file with plain
# ``pickle.load``, so a sharded checkpoint from elsewhere could run code; we read it first with an unpickler
# that knows only these names and refuse anything else.
_DCP_METADATA_GLOBALS = {
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
}
_DCP_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)


def check_dcp_metadata(dcp_dir: Path) -> None:
    """Refuse a DCP folder whose ``.metadata`` pickle names anything a distributed checkpoint never holds."""
    import io
    import pickle

    class _Allowlist(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            allowed = (module, name) in _DCP_METADATA_GLOBALS or module in _DCP_METADATA_MODULES or (
                module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                                torch.memory_format)))
            if not allowed:
                raise pickle.UnpicklingError(f"{module}.{name}")
            return super().find_class(module, name)

    path = Path(dcp_dir) / ".metadata"
    if not path.is_file():
        raise FileNotFoundError(f"{dcp_dir} has no .metadata file, so it is not a complete distributed checkpoint")
    try:
        _Allowlist(io.BytesIO(path.read_bytes())).load()
    except Exception as error:  # any failure means we will not hand the file to pickle.load
        raise ValueError(f"{path} names {error}, which a distributed checkpoint never holds; llmtrain will not "
                         "unpickle it, as it could run code. Use a checkpoint written by llmtrain or "
                         "torch.distributed.checkpoint") from error


def gather_full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on CPU on rank 0, an empty dict elsewhere. A collective under FSDP."""
    if not _is_distributed():
        return {k: v.detach().cpu() for k, v in get_model_state_dict(model).items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_model_state(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load full weights into a plain, DDP or FSDP model. Distributed, only rank 0's ``state_dict`` is read.

    Rank 0 broadcasts each tensor and every rank keeps its shard, so only one process needs to read
    the file. Tied weights stored once (``lm_head.weight`` is ``wte.weight``) are filled in from their twin.
    """
    state_dict = _with_tied_names(model, state_dict)
    if not _is_distributed():
        set_model_state_dict(model, state_dict, options=StateDictOptions(strict=strict))
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(model, state_dict if torch.distributed.get_rank() == 0 else {}, options=options)


def load_full_weights(model: torch.nn.Module, checkpoint_dir: Path, strict: bool = True) -> None:
    """Load ``model.safetensors`` of a model directory into a plain, DDP or FSDP model (rank 0 reads it)."""
    from safetensors.torch import load_file

    path = Path(checkpoint_dir) / layout.MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a model directory needs {layout.MODEL_FILE}")
    rank = torch.distributed.get_rank() if _is_distributed() else 0
    load_full_model_state(model, load_file(str(path)) if rank == 0 else {}, strict=strict)


def _with_tied_names(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the second name of each tied parameter (safetensors stores it once)."""
    if not state_dict:
        return state_dict
    from torch.nn.parallel import DistributedDataParallel

    module = model.module if isinstance(model, DistributedDataParallel) else model
    first_name: dict[int, str] = {}
    out = dict(state_dict)
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            twin = first_name[id(param)]
            if name not in out and twin in out:
                out[name] = out[twin]
        else:
            first_name[id(param)] = name
    return out


class ShardedCheckpointer:
    """Every rank writes its own shards of model and optimizer with DCP; loads at any world size.

    Same interface as :class:`llmtrain.train.checkpointer.FullCheckpointer`; every rank calls
    :meth:`save`, :meth:`save_final`, :meth:`load` and :meth:`wait` together. The checkpoint directory
    must be on a file system that every rank sees.

    ``async_save`` (``--fsdp.async_save``): :meth:`save` returns once the shards are copied to host
    memory; a background thread writes them. The checkpoint becomes complete (marker, rename) only in
    :meth:`wait`, after every rank's write finished, which the next save, ``save_final`` and a stop call
    first; a process killed before then leaves only a temporary directory that resume never picks.
    """

    def __init__(self, *, runtime: Runtime, out_dir: Path, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, train_loader: Any, model_config: Any, tokenizer: Any,
                 hyperparameters: dict, scaler: Optional[torch.amp.GradScaler] = None,
                 write_extras: Optional[Callable[[Path], None]] = None, keep_last: Optional[int] = None,
                 async_save: bool = False) -> None:
        self.async_save = async_save
        self._pending: Optional[tuple] = None  # (future, temporary dir, target, marker) of an unfinished async save
        self._async_group: Any = None
        self._stager: Any = None  # keeps its host copies between saves: no fresh allocation per save
        self.runtime = runtime
        self.write_extras = write_extras
        self.keep_last = keep_last
        self.out_dir = Path(out_dir)
        self.model = model
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.hyperparameters = hyperparameters
        self.scaler = scaler
        self.last_saved: Optional[Path] = None

    def save(self, state: TrainState) -> Path:
        """Write ``out_dir/step-NNNNNNNN/`` atomically: all ranks fill one temporary directory, rank 0 renames it."""
        target = self.out_dir / layout.step_dir_name(state.step)
        layout.check_finite_weights(self.model, self.runtime, target)
        self.wait()  # one write at a time; the previous one becomes a checkpoint first
        # Same name on every rank: the shards of all ranks meet in one directory.
        tmp = self.out_dir / f".{target.name}.tmp"
        if self.runtime.is_main:
            layout.remove_leftovers(self.out_dir)  # of saves that were killed, this step's included
            tmp.mkdir(parents=True)
        self.runtime.barrier()

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        states = {"model": model_state, "optimizer": optimizer_state}
        future = None
        with _single_process_quietly():
            if self.async_save:
                # NOTE: the background write's collectives get a group of their own (gloo), so they never
                # interleave with the training's collectives on the default group.
                if self._async_group is None and _is_distributed():
                    self._async_group = torch.distributed.new_group(backend="gloo")
                future = dcp.async_save(states, checkpoint_id=str(tmp / DCP_DIR), process_group=self._async_group,
                                        async_stager=self._host_stager(), no_dist=not _is_distributed())
            else:
                dcp.save(states, checkpoint_id=str(tmp / DCP_DIR), no_dist=not _is_distributed())
        rng_states = self.runtime.all_gather_object(layout.capture_rng_state())
        if self.runtime.is_main:
            training_state = {
                "train_state": state.state_dict(),
                "data": self.train_loader.state_dict(),
                "rng": rng_states,
                "scaler": self.scaler.state_dict() if self.scaler else None,
                "world_size": self.runtime.world_size,
                "optimizer_param_groups": param_group_settings(optimizer_state),
            }
            torch.save(training_state, tmp / layout.STATE_FILE)
            self._write_metadata_files(tmp)
        marker = {"kind": "training", "format": "sharded", "step": state.step, "tokens": state.tokens,
                  "world_size": self.runtime.world_size}
        self._pending = (future, tmp, target, marker)
        if future is None:
            self.wait()
        return target

    def wait(self) -> None:
        """Finish the pending save, if any: wait for its write on every rank, then mark it complete and install it."""
        if self._pending is None:
            return
        future, tmp, target, marker = self._pending
        self._pending = None
        if future is not None:
            future.result()  # this rank's shards are written (rank 0's also wrote .metadata: all ranks are)
            self.runtime.barrier()
        if self.runtime.is_main:
            layout.pause_during_save()
            _write_marker(tmp, marker)
            layout.install_dir(tmp, target)
        self.runtime.barrier()
        self.last_saved = target
        if self.runtime.is_main:
            layout.prune_checkpoints(self.out_dir, self.keep_last, keep=target)

    def _host_stager(self) -> Any:
        """Copies the state to host memory before save() returns, into the same buffers at every save.

        Pinned on CUDA for a fast copy. NOTE: the copy itself is synchronous: staging in a background
        thread would race the next optimizer step, which updates the weights in place.
        """
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = self.runtime.device.type == "cuda"
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
        return self._stager

    def save_final(self, state: TrainState) -> Path:
        """``final/`` is a full model directory (model.safetensors), gathered from the shards on rank 0."""
        self.wait()
        if self._stager is not None:  # training is over: give the host copies back
            self._stager.close()
            self._stager = None
        target = self.out_dir / "final"
        layout.check_finite_weights(self.model, self.runtime, target)
        model_state = gather_full_model_state(self.model)
        if self.runtime.is_main:
            layout.remove_leftovers(self.out_dir)
            layout.write_model_dir(target, state_dict=model_state, model_config=self.model_config,
                                   hyperparameters=self.hyperparameters, tokenizer=self.tokenizer,
                                   marker={"kind": "final", "format": "full", "step": state.step,
                                           "tokens": state.tokens}, write_extras=self.write_extras)
        self.runtime.barrier()
        return target

    def load(self, checkpoint_dir: Path, state: TrainState) -> None:
        """Restore model, optimizer, counters, data position and this rank's RNG, at any world size.

        A full checkpoint is handed to ``FullCheckpointer.load``, so a run can switch formats on resume.
        """
        checkpoint_dir = Path(checkpoint_dir)
        if checkpoint_format(checkpoint_dir) == "full":
            from llmtrain.train.checkpointer import FullCheckpointer

            FullCheckpointer(**self._arguments()).load(checkpoint_dir, state)
            self.last_saved = checkpoint_dir
            return
        training_state = layout.load_training_state(checkpoint_dir)
        # The current (possibly differently sharded) state dicts are the templates DCP reads into;
        # it reshards the saved shards to whatever this world's layout is.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        states = {"model": model_state, "optimizer": optimizer_state}
        check_dcp_metadata(checkpoint_dir / DCP_DIR)
        with _single_process_quietly():
            dcp.load(states, checkpoint_id=str(checkpoint_dir / DCP_DIR), no_dist=not _is_distributed())
        set_state_dict(self.model, self.optimizer, model_state_dict=states["model"],
                       optim_state_dict=states["optimizer"])
        restore_training_state(training_state, state, self.train_loader, self.scaler, self.runtime.rank,
                               optimizer=self.optimizer)
        self.last_saved = checkpoint_dir

    def _arguments(self) -> dict:
        return dict(runtime=self.runtime, out_dir=self.out_dir, model=self.model, optimizer=self.optimizer,
                    train_loader=self.train_loader, model_config=self.model_config, tokenizer=self.tokenizer,
                    hyperparameters=self.hyperparameters, scaler=self.scaler, write_extras=self.write_extras,
                    keep_last=self.keep_last)

    def _write_metadata_files(self, directory: Path) -> None:
        self.model_config.save(directory / layout.CONFIG_FILE)
        if self.hyperparameters is not None:
            (directory / layout.HPARAMS_FILE).write_text(yaml.safe_dump(self.hyperparameters, sort_keys=False))
        if self.tokenizer is not None:
            self.tokenizer.save(directory)
        if self.write_extras is not None:
            self.write_extras(directory)


def param_group_settings(optimizer_state: dict) -> list[dict]:
    """The hyperparameters of each param group (lr, betas, the schedule's initial_lr, ...), without the params."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer_state["param_groups"]]


def restore_training_state(training_state: dict, state: TrainState, train_loader: Any,
                           scaler: Optional[torch.amp.GradScaler], rank: int,
                           optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Counters, data position, loss scaler, param-group settings and this rank's RNG from ``training_state.pt``.

    NOTE: loading an optimizer through a template state dict (DCP, or a broadcast from rank 0) keeps
    only the keys the fresh optimizer already has, so group entries added later, such as the LR
    schedule's ``initial_lr``, would be lost (or restored on rank 0 only). Every rank sets them here.
    """
    if optimizer is not None:
        saved_groups = training_state.get("optimizer_param_groups")
        if saved_groups is None and "optimizer" in training_state:
            saved_groups = param_group_settings(training_state["optimizer"])
        if saved_groups is not None:
            if len(saved_groups) != len(optimizer.param_groups):
                raise ValueError(f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this run's "
                                 f"has {len(optimizer.param_groups)}; resume with the same optimizer setup")
            for group, saved in zip(optimizer.param_groups, saved_groups):
                group.update(saved)
    state.load_state_dict(training_state["train_state"])
    train_loader.load_state_dict(training_state["data"])
    if scaler is not None and training_state.get("scaler"):
        scaler.load_state_dict(training_state["scaler"])
    rng_states = training_state["rng"]
    # NOTE: at a larger world size than saved, the new ranks take rank 0's RNG state.
    layout.restore_rng_state(rng_states[rank] if rank < len(rng_states) else rng_states[0])


def build_checkpointer(state_dict_type: CheckpointFormat, async_save: bool = False, **arguments: Any):
    """The checkpointer that writes ``state_dict_type`` checkpoints (resume with :func:`load_checkpoint`).

    ``arguments`` are FullCheckpointer's: runtime, out_dir, model, optimizer, train_loader,
    model_config, tokenizer, hyperparameters, scaler. ``async_save`` needs the sharded format.
    """
    if state_dict_type == "sharded":
        return ShardedCheckpointer(**arguments, async_save=async_save)
    if async_save:
        raise ValueError("--fsdp.async_save true needs --fsdp.state_dict_type sharded (a full checkpoint is "
                         "gathered and written by rank 0 alone)")
    if state_dict_type == "full":
        from llmtrain.train.checkpointer import FullCheckpointer

        return FullCheckpointer(**arguments)
    raise ValueError(f"--fsdp.state_dict_type {state_dict_type!r} must be `full` or `sharded`")


def load_checkpoint(checkpointer: Any, checkpoint_dir: Path, state: TrainState) -> None:
    """Resume from ``checkpoint_dir`` whatever its format, into ``checkpointer``'s model, optimizer and loader.

    A run may resume a checkpoint of the other format (e.g. after changing --fsdp.state_dict_type).
    """
    if isinstance(checkpointer, ShardedCheckpointer):
        checkpointer.load(checkpoint_dir, state)
        return
    fmt = checkpoint_format(checkpoint_dir)
    if fmt == "full":
        checkpointer.load(checkpoint_dir, state)
        return
    ShardedCheckpointer(runtime=checkpointer.runtime, out_dir=checkpointer.out_dir, model=checkpointer.model,
                        optimizer=checkpointer.optimizer, train_loader=checkpointer.train_loader,
                        model_config=checkpointer.model_config, tokenizer=checkpointer.tokenizer,
                        hyperparameters=checkpointer.hyperparameters, scaler=checkpointer.scaler,
                        ).load(checkpoint_dir, state)
    # A sharded step directory has no model.safetensors for a full-format final/ to link to.
    checkpointer.last_saved = None


# ------------------------------------------------------------------------------------- writing
def _write_marker(directory: Path, fields: dict) -> None:
    """The marker goes last; everything before it is fsynced first, so the marker means complete."""
    layout.fsync_tree(directory)
    meta = {"format_version": layout.FORMAT_VERSION, "written_at": time.time(),
            "files": sorted(p.name for p in directory.iterdir()), **fields}
    marker = directory / layout.MARKER_FILE
    with open(marker, "w") as handle:
        handle.write(json.dumps(meta, indent=2))
        handle.flush()
        os.fsync(handle.fileno())
    layout.fsync_dir(directory)
