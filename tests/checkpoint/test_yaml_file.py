"""A checkpoint's YAML files with a Python tag, or cut short, are refused in one line naming the file, and never run
(llmtrain.yaml_file; issue 42, case 10)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.checkpoint import layout
from llmtrain.checkpoint.files import read_hyperparameters
from llmtrain.checkpoint.lora import read_lora_settings
from llmtrain.config import Config
from llmtrain.prompts import load_prompt_style


def payload(marker: Path) -> str:
    """YAML that would create ``marker`` if a loader constructed Python objects."""
    return f'name: !!python/object/apply:os.system ["touch {marker}"]\n'


READERS = {
    layout.CONFIG_FILE: lambda directory: Config.from_file(directory / layout.CONFIG_FILE),
    layout.HPARAMS_FILE: read_hyperparameters,
    layout.PROMPT_STYLE_FILE: load_prompt_style,
    layout.LORA_SETTINGS_FILE: read_lora_settings,
}


@pytest.mark.parametrize("name", sorted(READERS))
@pytest.mark.parametrize("content", ["tag", "cut short"])
def test_a_checkpoint_yaml_with_a_python_tag_or_cut_short_is_named_in_one_line(tmp_path, name, content):
    marker = tmp_path / "ran"
    for needed in (layout.LORA_FILE, layout.CONFIG_FILE):  # read_lora_settings looks for its siblings first
        (tmp_path / needed).write_text("n_layer: 1\n")
    (tmp_path / name).write_text(payload(marker) if content == "tag" else "name: [alpaca,\n  other: {")
    with pytest.raises(ValueError) as refused:
        READERS[name](tmp_path)
    message = str(refused.value)
    assert message.startswith(str(tmp_path / name)) and "is not a YAML file llmtrain can read" in message
    assert "\n" not in message
    assert not marker.exists()


def test_generate_names_a_checkpoints_model_config_with_a_python_tag_and_exits_2(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / layout.CONFIG_FILE).write_text(payload(marker))
    (tmp_path / layout.MODEL_FILE).write_bytes(b"")
    (tmp_path / layout.TOKENIZER_FILE).write_text("{}")
    done = subprocess.run([sys.executable, "-m", "llmtrain", "generate", str(tmp_path), "--prompt", "hi"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert f"{tmp_path / layout.CONFIG_FILE} (line 1) is not a YAML file llmtrain can read" in done.stderr
    assert "Traceback" not in done.stderr and not marker.exists()
