"""One writer per out_dir (llmtrain.checkpoint.lock): a second run into a folder in use stops at once, in one line, and
a lock left by a killed run blocks nothing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmtrain.checkpoint import layout
from llmtrain.checkpoint.lock import OutDirInUse, hold
from llmtrain.cli import main

from runs import pretrain_args

# A process that holds the lock until it is killed; it prints "held" once it has it.
_HOLDER = """
import sys, time
from llmtrain.checkpoint.lock import hold
with hold(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def start_holder(out_dir: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"  # hang guard: the child sleeps 600 s at most
    return holder


def test_a_second_process_is_refused_with_the_holder_and_a_killed_holder_blocks_nothing(tmp_path):
    out_dir = tmp_path / "run"
    holder = start_holder(out_dir)
    try:
        with pytest.raises(OutDirInUse, match=f"--out_dir {out_dir} is in use by another llmtrain run "
                                              f"\\(pid {holder.pid} on {socket.gethostname()}, since "):
            with hold(out_dir):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with hold(out_dir):  # the kernel dropped the dead holder's lock
        assert f"pid {os.getpid()} on " in (out_dir / layout.LOCK_FILE).read_text()
    with hold(out_dir):  # and this process's own, when its run ended
        pass


def test_a_run_into_a_folder_in_use_exits_2_before_touching_it(tmp_path, tiny_model_file):
    out_dir = tmp_path / "run"
    holder = start_holder(out_dir)
    try:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "llmtrain", *pretrain_args(tiny_model_file, out_dir,
                                                                              "--train.max_steps", "2")],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr
        assert f"is in use by another llmtrain run (pid {holder.pid} on" in done.stderr
        assert "Traceback" not in done.stderr
        assert time.monotonic() - started < 120  # at once, not after a wait (a hang guard, 10x the usual)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert sorted(path.name for path in out_dir.iterdir()) == [layout.LOCK_FILE]  # nothing written beside it
    main(pretrain_args(tiny_model_file, out_dir, "--train.max_steps", "2"))  # the folder is free again: the run goes on
    assert (out_dir / layout.FINAL_DIR / layout.MODEL_FILE).is_file()

