"""The checkpointer: one object that saves a run's step checkpoints, loads any of them, and writes final/.

Three formats share one save path (temporary directory → tensors → training state → metadata files
→ marker → rename) and differ only in how the tensors are written:

    full     rank 0 gathers the model and optimizer and writes model.safetensors (optimizer in training_state.pt);
             under pipeline parallelism each stage's first rank sends rank 0 its tensors, one at a time
    sharded  every rank writes its own shards of model and optimizer into dcp/ (torch.distributed.checkpoint);
             loads at any world size; ``async_save`` writes in the background
    lora     like full, but only the adapters (lora.safetensors) and their optimizer state
    deepspeed  DeepSpeed's own files, written by its engine (llmtrain_deepspeed.checkpoint, a subclass)

``final/`` is always a full model directory: the last step's files (full, hard-linked), the gathered
shards (sharded), or the merged model beside the adapters (lora). :meth:`Checkpointer.load` reads
whatever format the checkpoint has, so a run may switch formats on resume. Every rank calls
:meth:`~Checkpointer.save`, :meth:`~Checkpointer.wait`, :meth:`~Checkpointer.save_final` and
:meth:`~Checkpointer.load` together; the checkpoint directory must be on a file system every rank sees.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Optional, Union

import torch

from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.lora import iter_merged_weights, merged_state_dict
from llmtrain.checkpoint.resume import CheckpointFormat, checkpoint_format, verify_checkpoint, verify_checksums
from llmtrain.checkpoint.size import disk_full_said
from llmtrain.checkpoint.state import (
    DamagedCheckpointError,
    Stateful,
    build_training_state,
    capture_rng_state,
    data_state,
    load_training_state,
    optimizer_settings,
    restore_training_state,
)
from llmtrain.checkpoint.weights import gather_full_model_state, is_distributed, load_full_model_state, load_weights
from llmtrain.distributed.parallelize import unwrap
from llmtrain.distributed.pipeline import PipelineParts
from llmtrain.distributed.runtime import Runtime, host_barrier, host_group
from llmtrain.lora import is_lora_parameter, lora_state_dict


class NonFiniteWeightsError(RuntimeError):
    """The weights hold NaN or inf; no checkpoint was written."""


@dataclass
class _PendingSave:
    """A save whose tensors are written (or being written, ``future``) but which is not yet a checkpoint."""

    future: Any
    tmp: Path
    target: Path
    marker: dict
    good: Optional[Path]
    checksums: dict[str, str]
    """Of the files this rank hashed as it wrote them."""


class Checkpointer:
    """Saves and loads the step checkpoints of one run in ``out_dir`` (see the module doc for the formats)."""

    def __init__(self, *, runtime: Runtime, out_dir: Path, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, train_loader: Stateful, model_config: Any, tokenizer: Any,
                 hyperparameters: Optional[dict], scaler: Optional[torch.amp.GradScaler] = None,
                 write_extras: Optional[Callable[[Path], None]] = None, keep_last: Optional[int] = None,
                 format: CheckpointFormat = "full", async_save: bool = False) -> None:
        if format not in ("full", "sharded", "lora", "deepspeed"):
            raise ValueError(f"--fsdp.state_dict_type {format!r} must be `full` or `sharded`")
        if async_save and format == "lora":
            raise ValueError("--fsdp.async_save is for sharded checkpoints; LoRA checkpoints hold only the "
                             "adapters and are written by rank 0: drop --fsdp.async_save")
        if async_save and format == "full":
            raise ValueError("--fsdp.async_save true needs --fsdp.state_dict_type sharded (a full checkpoint is "
                             "gathered and written by rank 0 alone)")
        self.runtime = runtime
        self.out_dir = Path(out_dir)
        self.model = model
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.hyperparameters = hyperparameters
        self.scaler = scaler
        self.write_extras = write_extras
        self.keep_last = keep_last
        self.format = format
        self.lora = format == "lora"
        """The run trains LoRA adapters: final/ holds the merged model and the adapters beside it."""
        self.async_save = async_save
        self.last_saved: Optional[Path] = None
        self._pending: Optional[_PendingSave] = None
        self._stager: Any = None  # keeps its host copies between async saves: no fresh allocation per save

    # ------------------------------------------------------------------------------------- saving
    def save(self, state: Any, good: Optional[Path] = None) -> Path:
        """Write ``out_dir/step-NNNNNNNN/`` atomically: every rank's part goes into one temporary directory,
        which rank 0 marks complete and renames (at once, or in :meth:`wait` after an async write).

        ``good``: the run's last good checkpoint, which --train.keep_last then spares (llmtrain.train.nonfinite.Rewind).
        """
        target = self.out_dir / layout.step_dir_name(state.step)
        # NOTE: before the check, which may refuse this save: the previous one, written in the background, is the
        # checkpoint that the refusal tells the user to resume from.
        self.wait()  # one write at a time; the previous one becomes a checkpoint first
        check_finite_weights(self.model, self.runtime, target)
        tmp = layout.temporary_dir(target)  # the same name on every rank: the shards of all ranks meet in it
        if self.runtime.is_main:
            files.remove_leftovers(self.out_dir)  # of saves that were killed, this step's included
            tmp.mkdir(parents=True)
        self.runtime.barrier()
        # NOTE: before the writes: rank 0 writes the full weights alone, and a collective after them would wait
        # for its disk within the collective timeout (NCCL's watchdog). The writes change no generator.
        rng_states = self.runtime.all_gather_object(capture_rng_state(self.runtime.device))
        data = data_state(self.train_loader, self.runtime.all_gather_object)
        checksums: dict[str, str] = {}
        with disk_full_said(tmp):
            future, optimizer_state = self._write_tensors(tmp, checksums)
            if self.runtime.is_main:
                training_state = build_training_state(
                    state=state, data=data, scaler=self.scaler, rng_states=rng_states,
                    world_size=self.runtime.world_size, optimizer_state=optimizer_state,
                    include_optimizer=self.format in ("full", "lora"))
                checksums[layout.STATE_FILE] = files.save_checksummed(training_state, tmp / layout.STATE_FILE)
                files.write_metadata_files(tmp, model_config=self.model_config,
                                           hyperparameters=self.hyperparameters, tokenizer=self.tokenizer,
                                           write_extras=self.write_extras)
        marker = {"kind": "training", "format": self.format, "step": state.step, "tokens": state.tokens,
                  "world_size": self.runtime.world_size}
        self._pending = _PendingSave(future, tmp, target, marker, good, checksums)
        if future is None:
            self.wait()
        return target

    def _write_tensors(self, directory: Path, checksums: Optional[dict[str, str]] = None) -> tuple[Any, dict]:
        """Model and optimizer state into ``directory``: (the async write's future or None, the optimizer state).
        The checksums of the files hashed as they were written go into ``checksums``."""
        # NOTE: torch.distributed.checkpoint takes seconds to import; every `llmtrain` command imports this module.
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.format == "sharded":
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            return self._write_shards(directory / layout.DCP_DIR, {"model": model_state, "optimizer": optimizer_state}), \
                optimizer_state
        model_state, optimizer_state = full_states(self.model, self.optimizer, lora=self.format == "lora")
        if self.runtime.is_main:
            weights_file = layout.LORA_FILE if self.format == "lora" else layout.MODEL_FILE
            digest = files.save_weights_checksummed(model_state, directory / weights_file)
            if checksums is not None:
                checksums[weights_file] = digest
        return None, optimizer_state

    def _write_shards(self, dcp_dir: Path, states: dict) -> Any:
        import torch.distributed.checkpoint as dcp  # NOTE: slow, as in _write_tensors

        # NOTE: DCP's collectives wait for the slowest rank's writes, host work that the collective timeout
        # must not bound: they go over a gloo group with the long timeout (host_group). A background
        # write's collectives then also never interleave with the training's on the default group.
        group = host_group() if is_distributed() else None
        with _single_process_quietly():
            if not self.async_save:
                dcp.save(states, checkpoint_id=str(dcp_dir), process_group=group, no_dist=not is_distributed())
                return None
            return dcp.async_save(states, checkpoint_id=str(dcp_dir), process_group=group,
                                  async_stager=self._host_stager(), no_dist=not is_distributed())

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

    def wait(self) -> None:
        """Finish the pending save, if any: wait for its write on every rank, then mark it complete and install it.

        A process killed before then leaves only a temporary directory, which resume never picks.
        """
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        checksums = pending.checksums
        with disk_full_said(pending.tmp):
            if pending.future is not None:
                pending.future.result()  # this rank's shards are written (rank 0's wrote .metadata: all ranks are)
                self.runtime.barrier()
            if self.format in ("sharded", "deepspeed"):  # every rank wrote files: each hashes its own
                checksums = self._checksums_of_shares(pending.tmp, checksums)
            if self.runtime.is_main:
                files.write_marker(pending.tmp, pending.marker, checksums)
                files.install_dir(pending.tmp, pending.target)
        self.runtime.barrier()
        self.last_saved = pending.target
        if self.runtime.is_main:
            files.prune_checkpoints(self.out_dir, self.keep_last, keep=pending.target, good=pending.good)

    def prune(self, good: Path) -> None:
        """Delete the checkpoints --train.keep_last no longer keeps, now that ``good``, the newest, is known to be
        good (llmtrain.train.nonfinite.Rewind); rank 0 deletes."""
        if self.runtime.is_main:
            files.prune_checkpoints(self.out_dir, self.keep_last, keep=good)

    def _checksums_of_shares(self, directory: Path, known: dict[str, str]) -> dict[str, str]:
        """The checksum of every file in ``directory`` (every rank's writes done), each computed by the rank that
        wrote it while its pages are likely still cached (:func:`files.checksum_share`), unless it is ``known``
        already; gathered on every rank."""
        self.runtime.barrier()  # every rank's files are in place
        share = files.checksum_share(files.relative_files(directory), self.runtime.rank, self.runtime.world_size)
        mine = {**files.file_checksums(directory, [relative for relative in share if relative not in known]), **known}
        return {relative: digest for gathered in _host_all_gather(self.runtime, mine)
                for relative, digest in gathered.items()}

    def save_final(self, state: Any) -> Path:
        """``out_dir/final/``: a full model directory of the model at ``state``, whatever the step format."""
        self.wait()
        if self._stager is not None:  # training is over: give the host copies back
            self._stager.close()
            self._stager = None
        target = self.out_dir / layout.FINAL_DIR
        if self.format != "sharded" and self.last_saved != self.out_dir / layout.step_dir_name(state.step):
            self.save(state)  # full links its files, LoRA copies its adapters
        if self.format == "full":
            if self.runtime.is_main:
                files.remove_leftovers(self.out_dir)
                files.link_model_dir(self.last_saved, target)
            self.runtime.barrier()
            return target
        check_finite_weights(self.model, self.runtime, target)
        weights = self._final_weights()
        if self.runtime.is_main:
            files.remove_leftovers(self.out_dir)
            marker = {"kind": "final", "format": "full", "step": state.step, "tokens": state.tokens}
            if self.lora:
                marker["lora_merged"] = True
            files.write_model_dir(target, state_dict=weights, model_config=self.model_config,
                                  hyperparameters=self.hyperparameters, tokenizer=self.tokenizer, marker=marker,
                                  write_extras=self._final_extras)
        self.runtime.barrier()
        return target

    def _final_weights(self) -> Union[dict[str, torch.Tensor], Iterator[tuple[str, torch.Tensor]]]:
        """The full weights on rank 0's CPU (LoRA: merged); an empty dict on the other ranks.

        One process merges LoRA layer by layer as the file is written: the merged model never exists whole.
        """
        if self.format == "sharded":
            return gather_full_model_state(self.model)
        if not self.runtime.is_distributed:
            return iter_merged_weights(self.model)
        # Merged on rank 0 from the gathered full weights: no rank ever holds a second model.
        full = gather_full_model_state(self.model)
        return merged_state_dict(self.model, full) if self.runtime.is_main else {}

    def _final_extras(self, directory: Path) -> None:
        if self.lora:  # the adapters stay usable on their own beside the merged model
            shutil.copy2(self.last_saved / layout.LORA_FILE, directory / layout.LORA_FILE)
        if self.write_extras is not None:
            self.write_extras(directory)

    # ------------------------------------------------------------------------------------ loading
    def resume(self, checkpoint_dir: Path, fallbacks: tuple[Path, ...], state: Any) -> Path:
        """Load ``checkpoint_dir``, or when it is damaged the first intact one of ``fallbacks`` (each skipped one
        named in a warning); return the one loaded. Every rank calls it, and all load the same one."""
        for candidate in (checkpoint_dir, *fallbacks):
            problem = self.damage(candidate)
            if problem is None:
                self.load(candidate, state, checked=True)
                return candidate
            if not fallbacks:
                raise DamagedCheckpointError(f"--resume {candidate}: {problem}. Resume from an earlier checkpoint "
                                             "(--resume auto takes the newest intact one)")
            if self.runtime.is_main:
                warnings.warn(f"--resume: skipping {candidate.name}: {problem}")
        raise DamagedCheckpointError(f"--resume: no intact checkpoint in {checkpoint_dir.parent} (all "
                                     f"{1 + len(fallbacks)} are damaged, see the warnings)")

    def damage(self, checkpoint_dir: Path) -> Optional[str]:
        """What is wrong with ``checkpoint_dir`` (:func:`verify_checkpoint`; :func:`verify_checksums`, each rank
        for its share of the files), the same on every rank; None when it is intact. Every rank calls it: one
        all-reduce of a flag agrees, so all ranks load or fall back together; only a damaged checkpoint's messages
        are gathered, to name the file."""
        try:
            verify_checkpoint(checkpoint_dir, False, self.runtime.rank, self.runtime.world_size)
            verify_checksums(checkpoint_dir, self.runtime.rank, self.runtime.world_size)
            problem = None
        except (ValueError, OSError) as error:
            problem = str(error)
        if not self.runtime.is_distributed:
            return problem
        import torch.distributed as dist

        damaged = torch.tensor([int(problem is not None)])
        dist.all_reduce(damaged, op=dist.ReduceOp.MAX, group=host_group())  # host work came first: no device wait
        if not damaged.item():
            return None
        return next(found for found in _host_all_gather(self.runtime, problem) if found is not None)

    def load(self, checkpoint_dir: Path, state: Any, checked: bool = False) -> None:
        """Restore model, optimizer, counters, data position and this rank's RNG from a checkpoint of any format.

        Under DDP or FSDP only rank 0 reads full weights and optimizer state and broadcasts them; a pipeline
        rank reads its own stages' from the files, and nothing is sent; DCP reshards sharded ones to this
        world's layout. Either way the checkpoint loads at any world size.
        ``training_state.pt`` is memory-mapped: a rank reads only the tensors it uses (the full format's
        optimizer state on rank 0 alone, a page at a time as it is broadcast), so eight ranks of a node
        never hold eight copies of the optimizer.
        """
        checkpoint_dir = Path(checkpoint_dir)
        self.check(checkpoint_dir, checked)
        fmt = checkpoint_format(checkpoint_dir)
        if fmt == "deepspeed":
            raise ValueError(f"{checkpoint_dir} was written by DeepSpeed (--strategy deepspeed_*): resume it with the "
                             "same --strategy on the same number of processes, or start a new run from its weights "
                             f"(the run's {layout.FINAL_DIR}/ directory) with --initial_checkpoint_dir")
        training_state = load_training_state(checkpoint_dir, mmap=True)
        settings = optimizer_settings(self.optimizer)  # from this run's flags, before the load overwrites them
        if fmt == "sharded":
            self._load_shards(checkpoint_dir / layout.DCP_DIR)
        else:
            self._load_full(checkpoint_dir, fmt, training_state["optimizer"])
        restore_training_state(training_state, state=state, train_loader=self.train_loader, scaler=self.scaler,
                               rank=self.runtime.rank, optimizer=self.optimizer, device=self.runtime.device,
                               settings=settings)
        # A step directory of another format has no files for this format's final/ to reuse.
        self.last_saved = checkpoint_dir if fmt == self.format else None

    def check(self, checkpoint_dir: Path, checked: bool) -> None:
        """Raise :class:`DamagedCheckpointError` on every rank unless ``checkpoint_dir`` is intact (:meth:`damage`),
        or ``checked`` already."""
        problem = None if checked else self.damage(checkpoint_dir)
        if problem is not None:
            raise DamagedCheckpointError(problem)

    def _load_full(self, checkpoint_dir: Path, fmt: CheckpointFormat, optimizer_state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict  # NOTE: slow

        if fmt == "lora":
            from safetensors.torch import load_file  # NOTE: lazy, as in every CLI path that may not load

            adapters = load_file(str(checkpoint_dir / layout.LORA_FILE)) if self.runtime.is_main else {}
            load_full_model_state(self.model, adapters, strict=False)
        else:
            load_weights(self.model, checkpoint_dir)
        if isinstance(self.model, PipelineParts):
            # NOTE: every rank has training_state.pt memory-mapped: each reads its own stages' entries, as it read
            # their weights from model.safetensors, and none is sent; then the ranks wait for the slowest reader
            # here, not in the next collective (bound by the collective timeout).
            self.model.load_full_optimizer_state(self.optimizer, optimizer_state)
            host_barrier()
            return
        options = None
        # NOTE: a process group, not a world above one: one-rank FSDP (--strategy fsdp --devices 1) keeps DTensor
        # moments too, which a plain optimizer state dict would mix with tensors.
        if is_distributed():
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            optimizer_state = optimizer_state if self.runtime.is_main else {}
        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=options)

    def _load_shards(self, dcp_dir: Path) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # NOTE: slow, as above

        from llmtrain.checkpoint import dcp_reader  # the shards' pickles are read without running code

        # The current (possibly differently sharded) state dicts are the templates DCP reads into;
        # it reshards the saved shards to whatever this world's layout is.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        states = {"model": model_state, "optimizer": optimizer_state}
        # NOTE: over the long-waiting gloo group, as _write_shards saves: DCP's last collective waits for the slowest
        # rank's reads from a shared filesystem, host work that the collective timeout (NCCL's watchdog) must not bound.
        group = host_group() if is_distributed() else None
        with _single_process_quietly():
            dcp_reader.load(states, dcp_dir, process_group=group, no_dist=not is_distributed())
        set_state_dict(self.model, self.optimizer, model_state_dict=states["model"],
                       optim_state_dict=states["optimizer"])


def build_checkpointer(state_dict_type: Literal["full", "sharded"], async_save: bool = False, lora: bool = False,
                       **arguments: Any) -> Checkpointer:
    """The checkpointer a recipe's flags ask for: ``--fsdp.state_dict_type``, ``--fsdp.async_save``, LoRA or not.

    ``arguments`` are :class:`Checkpointer`'s: runtime, out_dir, model, optimizer, train_loader,
    model_config, tokenizer, hyperparameters, scaler, write_extras, keep_last.
    """
    if async_save and (lora or state_dict_type != "sharded"):  # before anything is built
        raise ValueError("--fsdp.async_save true needs --fsdp.state_dict_type sharded (a full or LoRA checkpoint is "
                         "written by rank 0 alone)")
    return Checkpointer(**arguments, format="lora" if lora else state_dict_type, async_save=async_save)


def full_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, lora: bool) -> tuple[dict, dict]:
    """(weights, optimizer state) of the whole model on rank 0's CPU, as a full checkpoint holds them (``lora``: the
    adapters and their optimizer state); empty dicts on the other ranks. Every rank calls it (a collective).

    NOTE: rank 0 gets one tensor at a time, one copy of each: gathered over FSDP's ranks by torch, or under pipeline
    parallelism sent by each stage's first rank (:meth:`PipelineParts.full_state_dict`).
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,  # NOTE: slow
                                                         get_optimizer_state_dict)

    if isinstance(model, PipelineParts):
        return model.full_state_dict(), model.full_optimizer_state(optimizer)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora)
    if lora and not is_distributed():
        # One process (as QLoRA always is): the adapters by name. The model's state dict would carry
        # bitsandbytes' quantization state too, and an 8-bit layer's (SCB) does not map to a parameter at all.
        weights = {name: tensor.cpu() for name, tensor in lora_state_dict(unwrap(model)).items()}
        return weights, get_optimizer_state_dict(model, optimizer, options=options)
    weights = get_model_state_dict(model, options=options)
    if lora:  # ignore_frozen_params keeps the persistent buffers (a mixture of experts' expert_bias): adapters only
        weights = {name: tensor for name, tensor in weights.items() if is_lora_parameter(name)}
    return weights, get_optimizer_state_dict(model, optimizer, options=options)


def check_finite_weights(model: torch.nn.Module, runtime: Runtime, target: Path) -> None:
    """Refuse to write ``target`` when any weight holds NaN or inf. Every rank calls it (a collective).

    Each rank checks its own shards; one all-reduce of the count makes the verdict the same everywhere,
    so all ranks raise together instead of leaving the others waiting in the save.
    """
    from torch.distributed.tensor import DTensor  # NOTE: slow to import, as torch.distributed.checkpoint

    named = [(name, param.to_local() if isinstance(param, DTensor) else param)
             for name, param in model.named_parameters()]
    if not named:
        return
    finite = torch.stack([torch.isfinite(tensor.detach()).all().to(runtime.device) for _, tensor in named])
    bad_count = (~finite).sum().double().reshape(1)
    if runtime.all_reduce(bad_count).item() == 0:
        return
    local_bad = [name for (name, _), ok in zip(named, finite.tolist()) if not ok]
    names = sorted({name for names in runtime.all_gather_object(local_bad) for name in names})
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise NonFiniteWeightsError(
        f"refusing to write {target}: {len(names)} weight tensor(s) hold NaN or inf ({shown}). The run has "
        "diverged; resume from an earlier checkpoint (--resume PATH) with a lower learning rate, a longer "
        "warmup or stronger clipping (--train.max_norm)")


def _host_all_gather(runtime: Runtime, obj: Any) -> list[Any]:
    """``obj`` of every rank, gathered over the gloo group that waits for host work (:func:`host_group`): the ranks
    get here after reading or writing files, which the collective timeout must not bound."""
    if not runtime.is_distributed:
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(gathered, obj, group=host_group())
    return gathered


@contextlib.contextmanager
def _single_process_quietly():
    """DCP warns whenever it runs without a process group; for a single process that is the plan."""
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
