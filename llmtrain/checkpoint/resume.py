"""Which checkpoint a run continues from, and whether it is intact.

A checkpoint is intact when its marker reads, every file has the size the marker recorded (DCP
shards included), its safetensors headers describe the bytes that follow them, its DCP index and
non-tensor items hold nothing a distributed checkpoint never holds, and ``training_state.pt`` loads with
``torch.load(weights_only=True)``. :func:`resolve_resume` checks this in the launching process
before any worker starts; the checkpointer checks again when it loads, and then also every file's
checksum (:func:`verify_checksums`): there the ranks share the reading, and agree on the verdict.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Literal, Optional, Union

from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.state import DamagedCheckpointError, load_training_state

CheckpointFormat = Literal["full", "sharded", "lora", "deepspeed"]


def checkpoint_format(checkpoint_dir: Path) -> CheckpointFormat:
    """``"full"``, ``"sharded"``, ``"lora"`` or ``"deepspeed"``, from the marker of a complete checkpoint."""
    fmt = files.read_marker(checkpoint_dir).get("format", "full")
    if fmt not in ("full", "sharded", "lora", "deepspeed"):
        raise ValueError(f"{Path(checkpoint_dir) / layout.MARKER_FILE}: unknown checkpoint format {fmt!r}; this "
                         "llmtrain reads `full`, `sharded`, `lora` and `deepspeed`")
    # Markers written before the LoRA format had its name say "full" beside the adapters.
    if fmt == "full" and (Path(checkpoint_dir) / layout.LORA_FILE).is_file() and not (
            Path(checkpoint_dir) / layout.MODEL_FILE).is_file():
        return "lora"
    return fmt


def verify_checkpoint(checkpoint_dir: Path, load_state: bool = True, rank: int = 0, world_size: int = 1) -> None:
    """Raise :class:`DamagedCheckpointError`, naming the file, unless ``checkpoint_dir`` is intact (module doc).

    ``load_state=False`` leaves ``training_state.pt`` to the caller, who is about to load it anyway. ``rank`` of
    ``world_size`` checks the sizes of its share of the files only (:func:`files.checksum_share`): at a thousand
    ranks, a thousand stats of every shard would load a shared filesystem's metadata servers for nothing.
    """
    checkpoint_dir = Path(checkpoint_dir)
    marker = files.read_marker(checkpoint_dir)
    if (checkpoint_dir / layout.DCP_DIR).is_dir():
        check_dcp_metadata(checkpoint_dir / layout.DCP_DIR)
    sizes = marker.get("sizes", {})
    for relative in files.checksum_share(sizes, rank, world_size):
        path, recorded = checkpoint_dir / relative, sizes[relative]
        if not path.is_file():
            raise DamagedCheckpointError(f"{path} is missing, though {layout.MARKER_FILE} lists it: the checkpoint "
                                         f"{checkpoint_dir} is damaged")
        if path.stat().st_size != recorded:
            raise DamagedCheckpointError(f"{path} has {path.stat().st_size} bytes, but {layout.MARKER_FILE} recorded "
                                         f"{recorded}: the file was truncated or changed after the save")
    for name in (layout.MODEL_FILE, layout.LORA_FILE):
        if (checkpoint_dir / name).is_file():
            check_safetensors(checkpoint_dir / name)
    if load_state and (checkpoint_dir / layout.STATE_FILE).is_file():
        load_training_state(checkpoint_dir, mmap=True)


def verify_checksums(checkpoint_dir: Path, rank: int = 0, world_size: int = 1) -> None:
    """Raise :class:`DamagedCheckpointError`, naming the file, when a file of ``rank``'s share
    (:func:`files.checksum_share`) does not have the checksum its marker recorded. A marker written before
    checksums (format 2) records none: its sizes are all there is to check."""
    checkpoint_dir = Path(checkpoint_dir)
    marker = files.read_marker(checkpoint_dir)
    if marker.get("checksum_algorithm") != files.CHECKSUM_ALGORITHM:
        return
    recorded = marker.get("checksums", {})
    for relative in files.checksum_share(recorded, rank, world_size):
        if files.checksum(checkpoint_dir / relative) != recorded[relative]:
            raise DamagedCheckpointError(
                f"{checkpoint_dir / relative} does not match the checksum {layout.MARKER_FILE} recorded: its bytes "
                "changed after the save (a disk, copy or transfer error)")


def check_safetensors(path: Path) -> None:
    """The header of a safetensors file reads and its tensors end exactly where the file does."""
    size = path.stat().st_size
    damaged = f"{path} is damaged"
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        header_size = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < header_size <= size - 8:
            raise DamagedCheckpointError(f"{damaged}: its safetensors header is unreadable")
        try:
            header = json.loads(handle.read(header_size))
            data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"),
                           default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise DamagedCheckpointError(f"{damaged}: its safetensors header is unreadable") from None
    if 8 + header_size + data_end != size:
        raise DamagedCheckpointError(f"{damaged}: its header describes {8 + header_size + data_end} bytes, the file "
                                     f"has {size} (truncated or changed after the save)")


def check_dcp_metadata(dcp_dir: Path) -> None:
    """Refuse a DCP folder whose ``.metadata`` or non-tensor items hold anything a distributed checkpoint never
    holds: torch would unpickle them as it loads (:mod:`llmtrain.checkpoint.dcp_reader`)."""
    from llmtrain.checkpoint.dcp_reader import check_dcp_files  # NOTE: slow, only for a sharded checkpoint

    check_dcp_files(dcp_dir)


# ------------------------------------------------------------------------------------------ resume
def resolve_resume(resume: Union[bool, str, Path, None], out_dir: Path,
                   initial_checkpoint_dir: Optional[Path]) -> Optional[Path]:
    """Which checkpoint to continue from, or None for a fresh run. Damaged checkpoints are never picked.

    ``auto`` and ``true`` take the newest intact checkpoint in ``out_dir``, warning about newer damaged
    ones; an explicit path that is damaged is an error naming the file.
    """
    if resume not in (False, None) and initial_checkpoint_dir is not None:
        raise ValueError("--resume and --initial_checkpoint_dir contradict each other: resume continues this run's "
                         "own checkpoint, initial_checkpoint_dir starts a new run from weights; pass only one")
    checkpoints = [path for _, path in layout.list_checkpoints(out_dir)]
    if resume is False or resume is None:
        if checkpoints:
            raise ValueError(f"--out_dir {out_dir} already holds checkpoints of a run (newest: {checkpoints[-1].name}); "
                             "pass --resume auto to continue it, or choose another --out_dir")
        return None
    if resume == "auto" or resume is True:
        flag = "--resume auto" if resume == "auto" else "--resume true"
        _warn_incomplete(out_dir, flag)
        if not checkpoints:
            if resume is True:
                raise FileNotFoundError(f"--resume true: no complete checkpoint in --out_dir {out_dir}; "
                                        "use --resume auto to start fresh when there is none")
            return None
        return newest_intact(checkpoints, flag)
    path = Path(resume)
    if not layout.is_training_checkpoint(path):
        raise FileNotFoundError(f"--resume {path} is not a complete training checkpoint "
                                f"(it needs {layout.STATE_FILE} and {layout.MARKER_FILE})")
    try:
        verify_checkpoint(path)
    except (DamagedCheckpointError, OSError) as error:
        raise DamagedCheckpointError(f"--resume {path}: {error}. Resume from an earlier checkpoint (--resume auto "
                                     "takes the newest intact one)") from None
    return path


def check_deepspeed_resume(checkpoint_dir: Path, *, deepspeed: bool, zero_stage: Optional[int] = None,
                           bf16: Optional[bool] = None) -> None:
    """A DeepSpeed checkpoint resumes only under DeepSpeed, and a DeepSpeed run resumes only a DeepSpeed checkpoint.
    Given the run's ``zero_stage`` and whether it trains in ``bf16``, the checkpoint must also have been written
    with stage 3 if and only if the run uses it, and in bf16 if and only if the run is: DeepSpeed's files differ
    between them. Any number of processes may resume it: ZeRO's files hold each saving process's partition, and
    on another number the run loads them as DeepSpeed's universal checkpoint (llmtrain_deepspeed.config.resume_config).
    Called in the launching process, before any worker starts, and again as the checkpoint loads."""
    checkpoint_dir = Path(checkpoint_dir)
    fmt = checkpoint_format(checkpoint_dir)
    if deepspeed and fmt != "deepspeed":
        raise ValueError(f"--resume {checkpoint_dir} is a {fmt} checkpoint, written without DeepSpeed: resume it with "
                         "the --strategy that wrote it, or start this DeepSpeed run from its weights with "
                         "--initial_checkpoint_dir")
    if not deepspeed and fmt == "deepspeed":
        raise ValueError(f"--resume {checkpoint_dir} was written by DeepSpeed (--strategy deepspeed_*): resume it with "
                         "the same --strategy (on any number of processes), or start a new run from its weights "
                         f"(the run's {layout.FINAL_DIR}/ directory) with --initial_checkpoint_dir")
    if deepspeed and zero_stage is not None:
        _check_deepspeed_files(checkpoint_dir, zero_stage=zero_stage, bf16=bf16)


def _check_deepspeed_files(checkpoint_dir: Path, *, zero_stage: int, bf16: Optional[bool]) -> None:
    """The stage and precision a DeepSpeed checkpoint's file names show, against the run's."""
    # NOTE: stage 3 writes each rank's parameters (zero_pp_rank_R_mp_rank_00_model_states.pt), stages 1 and 2 one
    # mp_rank_00_model_states.pt; in bf16 the optimizer files start with bf16_. DeepSpeed fails on a mismatch
    # only in the workers, with a bare AssertionError or a missing file.
    partitioned = (checkpoint_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file()
    if partitioned != (zero_stage == 3):
        written, run = ("ZeRO stage 3", f"ZeRO stage {zero_stage}") if partitioned else (
            "ZeRO stage 1 or 2", "ZeRO stage 3")
        raise ValueError(f"--resume {checkpoint_dir} was written under {written}, whose files this run's {run} "
                         f"cannot load: resume with --strategy "
                         f"{'deepspeed_stage_3' if partitioned else 'deepspeed_stage_1 or deepspeed_stage_2'} "
                         f"(with or without _offload), or start a new run from its {layout.FINAL_DIR}/ weights with "
                         "--initial_checkpoint_dir")
    written_bf16 = any(checkpoint_dir.glob("bf16_zero_pp_rank_*_optim_states.pt"))
    if bf16 is not None and written_bf16 != bf16:
        raise ValueError(f"--resume {checkpoint_dir} was written {'in' if written_bf16 else 'without'} bf16 "
                         f"(DeepSpeed names its files by it), and this run trains {'in' if bf16 else 'without'} it: "
                         f"resume with {'--precision bf16-mixed' if written_bf16 else 'the --precision that wrote it'}"
                         f", or start a new run from its {layout.FINAL_DIR}/ weights with --initial_checkpoint_dir")


def check_resume_model(checkpoint_dir: Path, config: Any) -> None:
    """Refuse to resume a checkpoint of another architecture than this run's ``config`` (a shape mismatch would
    fail deep in the load, or, for a sharded checkpoint, in DCP; a changed rope_base or norm_eps would not fail
    at all). Called in the launching process, before any worker starts."""
    from llmtrain.config import Config, architecture_differences

    path = Path(checkpoint_dir) / layout.CONFIG_FILE
    differences = architecture_differences(Config.from_file(path), config)
    if differences:
        raise ValueError(f"--resume {checkpoint_dir} holds another model than this run's (checkpoint vs run: "
                         f"{'; '.join(differences)}): resume with the architecture it was trained with "
                         f"(--model_config {path}), or start a new run from its weights with "
                         "--initial_checkpoint_dir and another --out_dir")


def check_resume_optimizer(checkpoint_dir: Path, optimizer_spec: dict) -> None:
    """Refuse to resume a checkpoint written under another optimizer class than this run's ``optimizer_spec``
    (``hparams.optimizer_spec``): its state (AdamW's moments) is not the other's, and the load failed with a
    traceback (sharded) or the first step did (full). Called in the launching process, before any worker starts."""
    saved = files.read_hyperparameters(checkpoint_dir).get("optimizer")
    if not isinstance(saved, dict) or saved.get("class_path") in (None, optimizer_spec["class_path"]):
        return
    name = saved["class_path"].rsplit(".", 1)[-1]
    raise ValueError(f"--resume {checkpoint_dir} holds the state of optimizer {saved['class_path']} (see its "
                     f"{layout.HPARAMS_FILE}), this run's is {optimizer_spec['class_path']}: resume with --optimizer "
                     f"{name}, or start a new run from its weights with another --out_dir")


LORA_SHAPE_FIELDS = ("lora_r", "lora_alpha", "lora_query", "lora_key", "lora_value", "lora_projection", "lora_mlp",
                     "lora_head")
"""The --lora_* settings that decide which adapters exist and what they add (lora_dropout only regularises)."""


def check_resume_lora(checkpoint_dir: Path, lora: Any, quantize: Optional[str] = None) -> None:
    """Refuse to resume a checkpoint whose adapters differ from this run's ``lora`` settings (None: no LoRA) or were
    trained on another base than this run's ``quantize`` gives. A whole model's state resumed by finetune_lora,
    adapters resumed by finetune_full, other layers or another rank failed in the load with a traceback; a dropped
    layer lost its trained adapter silently, another lora_alpha rescaled every adapter, and QLoRA adapters resumed
    without --quantize (or LoRA ones with it) went on training against a base they were not trained on, into whose
    merge final/ then folded them. Called in the launching process, before any worker starts."""
    path = Path(checkpoint_dir) / layout.LORA_SETTINGS_FILE  # every LoRA checkpoint has it, no other one does
    if lora is None and path.is_file():
        raise ValueError(f"--resume {checkpoint_dir} holds LoRA adapters (see {path}): resume it with finetune_lora "
                         "and those settings, or merge it (`llmtrain merge_lora`) and fine-tune the merged model "
                         "with another --out_dir")
    if lora is None:
        return
    if not path.is_file():
        raise ValueError(f"--resume {checkpoint_dir} holds a whole model's training state, not LoRA adapters (it has "
                         f"no {layout.LORA_SETTINGS_FILE}): resume it with the recipe that wrote it, or fine-tune its "
                         f"run's {layout.FINAL_DIR}/ with finetune_lora and another --out_dir")
    from llmtrain.checkpoint.lora import lora_settings

    saved, _, saved_quantize = lora_settings(path)
    differences = [f"--{name} {_flag(getattr(saved, name))} vs {_flag(getattr(lora, name))}"
                   for name in LORA_SHAPE_FIELDS if getattr(saved, name) != getattr(lora, name)]
    if saved_quantize != quantize:
        differences.append(" vs ".join(f"--quantize {mode}" if mode else "no --quantize"
                                       for mode in (saved_quantize, quantize)))
    if differences:
        raise ValueError(f"--resume {checkpoint_dir} holds other adapters than this run's (checkpoint vs run: "
                         f"{'; '.join(differences)}): resume with the --lora_* settings in {path}, or start a new "
                         "run with another --out_dir")


def _flag(value: Any) -> str:
    """A value as a command line spells it (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def resume_fallbacks(resume: Union[bool, str, Path, None], resume_from: Optional[Path]) -> tuple[Path, ...]:
    """What a run may resume from instead of ``resume_from`` when the workers find it damaged (a checksum, which
    only they check): under ``--resume auto`` or ``true``, the older checkpoints beside it, newest first."""
    if resume not in ("auto", True) or resume_from is None:
        return ()
    older = [path for _, path in layout.list_checkpoints(Path(resume_from).parent) if path.name < resume_from.name]
    return tuple(reversed(older))


def _warn_incomplete(out_dir: Path, flag: str) -> None:
    """Name, in one line, the step directories that resume passes over because they are no checkpoint."""
    skipped = layout.incomplete_step_dirs(out_dir)
    if skipped:
        warnings.warn(f"{flag}: passing over {', '.join(f'{path.name} ({_incomplete(path)})' for path in skipped)} "
                      f"in {out_dir}: no complete training checkpoint (a save that never finished, a copy in part); "
                      "delete or repair them")


def _incomplete(path: Path) -> str:
    """What a step directory that is no training checkpoint lacks."""
    try:
        return f"no {layout.MARKER_FILE}" if not (path / layout.MARKER_FILE).is_file() else f"no {layout.STATE_FILE}"
    except OSError as error:
        return f"unreadable: {error.strerror}"


def newest_intact(checkpoints: list[Path], flag: str) -> Path:
    """The newest of ``checkpoints`` (oldest first) that :func:`verify_checkpoint` accepts; warn about the others."""
    newest_problem = None
    for path in reversed(checkpoints):
        try:
            verify_checkpoint(path)
        except (DamagedCheckpointError, OSError) as error:
            newest_problem = newest_problem or error
            warnings.warn(f"{flag}: skipping {path.name}: {error}")
            continue
        return path
    raise DamagedCheckpointError(f"{flag}: no intact checkpoint among {len(checkpoints)} in "
                                 f"{checkpoints[0].parent}; the newest: {newest_problem}")
