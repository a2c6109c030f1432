"""The command line's own rewriting (llmtrain/cli.py), through the real parser up to the launch."""

from __future__ import annotations

import pytest

from llmtrain.cli import run_cli
from llmtrain.recipes import prepare as prepare_module


def launched_config(argv: list[str], monkeypatch):
    launched = []
    monkeypatch.setattr(prepare_module, "launch", lambda fn, args, **kw: launched.append(args[0]))
    run_cli(argv)
    return launched[0].config


@pytest.mark.parametrize("model", [["llama-debug"], ["--model_name", "llama-debug"], ["--model_name=llama-debug"]])
def test_model_config_flags_after_a_zoo_name_change_only_their_fields(model, tmp_path, monkeypatch):
    config = launched_config(["pretrain", *model, "--model_config.n_layer", "2", "--out_dir", str(tmp_path / "out"),
                              "--train.max_steps", "1"], monkeypatch)
    assert (config.name, config.n_layer, config.n_embd, config.n_query_groups, config.intermediate_size) == (
        "llama-debug", 2, 256, 2, 640)
