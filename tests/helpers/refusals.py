"""What a refused command must look like: one llmtrain error line, the expected one, and no traceback."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEBUG = ["pretrain", "--config", str(ROOT / "config_hub/pretrain/debug.yaml"), "--train.max_steps", "1"]
HANG_GUARD_S = 300  # a bad flag is refused in a few seconds; this only stops a hang


def assert_one_message(output: str, expected: str) -> None:
    """Exactly one llmtrain error, the expected one, and no traceback through llmtrain's code."""
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    assert expected in errors[0], output
    assert not re.search(r'File ".*llmtrain/', output), output
    assert "Traceback" not in output.split("torch.distributed.elastic")[0] or "ChildFailedError" in output, output
