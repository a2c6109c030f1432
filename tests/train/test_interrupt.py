"""Ctrl-C (SIGINT) ends a run as documented (llmtrain.signals): exit 130, one line, no traceback."""

from __future__ import annotations

import signal
import subprocess
import sys

from llmtrain.checkpoint.lock import hold

from runs import pretrain_args


def test_ctrl_c_ends_a_run_with_130_and_one_line(tmp_path, tiny_model_file):
    """Issue 42, case 14: a KeyboardInterrupt traceback ended the run before; and the out_dir's lock goes with the
    process."""
    out_dir = tmp_path / "run"
    # NOTE: a suite started in the background inherits SIGINT ignored; a user at a terminal has it at its default.
    run = subprocess.Popen([sys.executable, "-m", "llmtrain", *pretrain_args(tiny_model_file, out_dir,
                                                                          "--train.max_steps", "100000")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in run.stdout:  # hang guard: the run's own log, a line per step
        if line.startswith("step "):
            break
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 130, stderr
    assert "interrupted (Ctrl-C)" in stderr and "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    with hold(out_dir):
        pass
