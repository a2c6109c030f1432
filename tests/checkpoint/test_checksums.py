"""Checkpoint checksums (issue 42, deliverable 3; cases 15 and 16).

The marker records every file's checksum; resume checks them, each rank the files it reads, and falls back
to the previous checkpoint when one was changed after the save, so the run goes on exactly as if the damaged
checkpoint had never been written. Step directories that are no checkpoint (no marker, or unreadable) are
named and passed over.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
from safetensors.torch import load_file

from llmtrain.checkpoint import layout
from llmtrain.checkpoint.resume import resolve_resume, verify_checksums
from llmtrain.checkpoint.state import DamagedCheckpointError

from runs import assert_same_weights, launcher, losses, model_file, pretrain_args, shared_cache  # noqa: F401 (fixtures)

STEPS, INTERVAL = 8, 4
FLIPPED = 64


def flip(path: Path, offset: int) -> None:
    """Invert ``FLIPPED`` bytes of ``path`` from ``offset``: its size stays what the marker recorded."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        data = bytes(byte ^ 0xFF for byte in handle.read(FLIPPED))
        handle.seek(offset)
        handle.write(data)


def tensor_data_offset(path: Path) -> int:
    """Where the bytes of the largest tensor in ``path`` start, a little way in: not its header, nor its index."""
    if path.suffix == ".safetensors":
        header_size = int.from_bytes(path.read_bytes()[:8], "little")
        return 8 + header_size + (path.stat().st_size - 8 - header_size) // 2
    if path.suffix == ".pt":  # a zip of stored (uncompressed) entries, one per tensor storage
        with zipfile.ZipFile(path) as archive:
            entry = max((info for info in archive.infolist() if "/data/" in info.filename), key=lambda i: i.file_size)
        local_header = path.read_bytes()[entry.header_offset:entry.header_offset + 30]
        name_length, extra_length = (int.from_bytes(local_header[at:at + 2], "little") for at in (26, 28))
        return entry.header_offset + 30 + name_length + extra_length + entry.file_size // 2
    return path.stat().st_size // 2  # a DCP shard: nothing but tensor bytes


_TRAINED: dict[str, Path] = {}


@pytest.fixture
def trained(tmp_path_factory, tiny_model_file) -> Path:
    """A finished single-process run with checkpoints at steps 4 and 8 (made once; copy it before changing it)."""
    if "full" not in _TRAINED:
        from llmtrain.cli import main

        out_dir = tmp_path_factory.mktemp("checksums") / "run"
        main(pretrain_args(tiny_model_file, out_dir, "--train.max_steps", str(STEPS), "--train.save_interval",
                       str(INTERVAL)))
        _TRAINED["full"] = out_dir
    return _TRAINED["full"]


def copy_run(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, symlinks=True)
    return target


@pytest.mark.parametrize("name", [layout.MODEL_FILE, layout.STATE_FILE])
def test_flipped_bytes_fall_back_to_the_previous_checkpoint_with_identical_losses(trained, tiny_model_file, tmp_path,
                                                                                 capsys, name):
    """64 bytes of tensor data flipped in step-8 (same size): resume warns in one line naming the file, continues from
    step-4, and steps 5-8 repeat the reference's losses exactly, ending in its weights. Before, step-8 resumed: from
    corrupt weights, or with a corrupt optimizer state."""
    from llmtrain.cli import main

    out_dir = copy_run(trained, tmp_path / "run")
    damaged = out_dir / layout.step_dir_name(STEPS) / name
    flip(damaged, tensor_data_offset(damaged))
    assert resolve_resume("auto", out_dir, None) == damaged.parent  # its size and header are as recorded
    reference = load_file(str(trained / layout.FINAL_DIR / layout.MODEL_FILE))
    shutil.rmtree(out_dir / layout.FINAL_DIR)

    with pytest.warns(UserWarning) as warned:
        main(pretrain_args(tiny_model_file, out_dir, "--train.max_steps", str(STEPS), "--train.save_interval",
                       str(INTERVAL), "--resume", "auto"))
    mismatch = [str(w.message) for w in warned if "checksum" in str(w.message)]
    assert len(mismatch) == 1 and str(damaged) in mismatch[0] and "\n" not in mismatch[0], mismatch
    assert f"resumed from {out_dir / layout.step_dir_name(INTERVAL)}" in capsys.readouterr().out
    assert losses(out_dir) == losses(trained)
    assert_same_weights(out_dir, reference)


def test_a_named_damaged_checkpoint_or_none_intact_left_is_an_error_naming_the_file(trained, tiny_model_file, tmp_path):
    """--resume PATH never falls back; --resume auto with every checkpoint damaged starts no fresh run either."""
    from llmtrain.cli import main

    out_dir = copy_run(trained, tmp_path / "run")
    damaged = [out_dir / layout.step_dir_name(step) / layout.MODEL_FILE for step in (INTERVAL, STEPS)]
    for path in damaged:
        flip(path, tensor_data_offset(path))
    shutil.rmtree(out_dir / layout.FINAL_DIR)
    run = pretrain_args(tiny_model_file, out_dir, "--train.max_steps", str(STEPS), "--train.save_interval", str(INTERVAL))
    with pytest.raises(DamagedCheckpointError, match=f"--resume {damaged[1].parent}: {damaged[1]} does not match"):
        main([*run, "--resume", str(damaged[1].parent)])
    with pytest.warns(UserWarning) as warned:
        with pytest.raises(DamagedCheckpointError, match="no intact checkpoint"):
            main([*run, "--resume", "auto"])
    assert [str(path) in str(w.message) for w in warned for path in damaged].count(True) == 2
    assert not (out_dir / layout.FINAL_DIR).exists()


def test_a_marker_without_checksums_is_checked_by_sizes_only(trained, tmp_path):
    """Checkpoints written before checksums (marker format 2) still resume; a recorded checksum is checked."""
    checkpoint = copy_run(trained, tmp_path / "run") / layout.step_dir_name(STEPS)
    weights = checkpoint / layout.MODEL_FILE
    flip(weights, tensor_data_offset(weights))
    with pytest.raises(DamagedCheckpointError, match=f"{weights} does not match the checksum"):
        verify_checksums(checkpoint)
    marker = json.loads((checkpoint / layout.MARKER_FILE).read_text())
    for field in ("checksum_algorithm", "checksums"):
        del marker[field]
    (checkpoint / layout.MARKER_FILE).write_text(json.dumps({**marker, "format_version": 2}))
    verify_checksums(checkpoint)


def test_a_step_directory_without_marker_is_named_once(trained, tmp_path):
    """Case 15: a step directory without its marker was passed over without a word."""
    out_dir = copy_run(trained, tmp_path / "run")
    for step in (12, 16):  # e.g. copied in part from another machine
        shutil.copytree(out_dir / layout.step_dir_name(STEPS), out_dir / layout.step_dir_name(step))
        (out_dir / layout.step_dir_name(step) / layout.MARKER_FILE).unlink()
    with pytest.warns(UserWarning) as warned:
        assert resolve_resume("auto", out_dir, None) == out_dir / layout.step_dir_name(STEPS)
    named = [str(w.message) for w in warned if "step-00000012" in str(w.message)]
    assert len(named) == 1 and "step-00000016" in named[0] and layout.MARKER_FILE in named[0], named


def test_an_unreadable_newest_step_directory_is_skipped(trained, tmp_path, monkeypatch):
    """Case 16: a newest step directory this process may not read (chmod 000) aborted the resume with a
    PermissionError; now it is named and resume falls back to the previous checkpoint."""
    out_dir = copy_run(trained, tmp_path / "run")
    unreadable = out_dir / layout.step_dir_name(STEPS)
    unreadable.chmod(0)
    if os.geteuid() == 0:  # root reads it anyway: every look inside fails as it would for anyone else
        real_stat = Path.stat

        def stat(path, *args, **kwargs):
            if str(path).startswith(f"{unreadable}{os.sep}"):
                raise PermissionError(13, "Permission denied", str(path))
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(Path, "stat", stat)
    try:
        with pytest.warns(UserWarning, match=f"passing over {unreadable.name}"):
            assert resolve_resume("auto", out_dir, None) == out_dir / layout.step_dir_name(INTERVAL)
    finally:
        unreadable.chmod(0o755)


@pytest.mark.multiproc
def test_a_flipped_dcp_shard_is_caught_by_its_rank_and_every_rank_falls_back(launcher, tmp_path):  # noqa: F811
    """Two ranks, sharded checkpoints: rank 1's shard of the newest checkpoint has flipped bytes. Rank 1 finds it
    (rank 0 hashes only its own shard), both ranks fall back to the previous checkpoint together, and the run ends
    with the losses and weights of a run that never saw the damage."""
    sharded = ("--fsdp.state_dict_type", "sharded", "--train.max_steps", str(STEPS), "--train.save_interval",
               str(INTERVAL), "--resume", "auto")
    reference = tmp_path / "reference"
    launcher.complete(reference, *sharded)
    out_dir = tmp_path / "run"
    shutil.copytree(reference, out_dir)
    shutil.rmtree(out_dir / layout.FINAL_DIR)
    shard = out_dir / layout.step_dir_name(STEPS) / layout.DCP_DIR / "__1_0.distcp"
    flip(shard, tensor_data_offset(shard))

    run = launcher.complete(out_dir, *sharded)
    warned = [line for line in run.output.splitlines() if "does not match the checksum" in line]
    assert len(warned) == 1 and str(shard) in warned[0], run.output
    assert f"resumed from {out_dir / layout.step_dir_name(INTERVAL)}" in run.output
    assert losses(out_dir) == losses(reference)
    assert_same_weights(out_dir, load_file(str(reference / layout.FINAL_DIR / layout.MODEL_FILE)))
