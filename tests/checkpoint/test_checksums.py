"""Checkpoint checksums (issue 42, deliverable 3; cases 15 and 16).

The marker records every file's checksum; resume checks them, each rank the files it reads, and falls back
to the previous checkpoint when one was changed after the save, so the run goes on exactly as if the damaged
checkpoint had never been written. Step directories that are no checkpoint (no marker, or unreadable) are
named and passed over. (Two ranks, a flipped DCP shard found by its rank: tests/train/test_reliability.py's sharded
kill -9 test, which ends in the run it damages.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from llmtrain.checkpoint import layout
from llmtrain.checkpoint.resume import resolve_resume, verify_checksums
from llmtrain.checkpoint.state import DamagedCheckpointError

from faults import flip, tensor_data_offset
from runs import assert_same_weights, losses, pretrain_args, shared_cache  # noqa: F401 (fixtures)

STEPS, INTERVAL = 8, 4
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
