"""The command line's own rewriting (llmtrain/cli.py), through the real parser up to the launch."""

from __future__ import annotations

from pathlib import Path

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


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pythia_dir(tmp_path_factory):
    """A model directory of pythia-14m's shape: the dry run reads its config and nothing else."""
    from llmtrain.checkpoint.layout import CONFIG_FILE
    from llmtrain.config import Config

    model_dir = tmp_path_factory.mktemp("pythia")
    Config.from_name("pythia-14m").save(model_dir / CONFIG_FILE)
    for name in ("model.safetensors", "tokenizer.json"):
        (model_dir / name).write_bytes(b"")
    return model_dir


@pytest.mark.parametrize("order", ["positional first", "config first", "--checkpoint_dir"])
def test_the_positional_model_wins_over_the_config_recipes(order, pythia_dir, tmp_path, capsys):
    """The debug LoRA recipe names out/pretrain/debug/final (absent here); the model on the command line is trained,
    whether it comes before or after --config."""
    from llmtrain.cli import main

    recipe = ["--config", str(ROOT / "config_hub/finetune/debug/lora.yaml")]
    model = {"positional first": [str(pythia_dir)], "config first": [str(pythia_dir)],
             "--checkpoint_dir": ["--checkpoint_dir", str(pythia_dir)]}[order]
    words = [*recipe, *model] if order == "config first" else [*model, *recipe]
    main(["finetune_lora", *words, "--out_dir", str(tmp_path / "o"), "--dry_run"])
    assert "model        pythia-14m:" in capsys.readouterr().out


def test_the_positional_zoo_name_wins_over_the_config_recipes(capsys):
    from llmtrain.cli import main

    main(["pretrain", "pythia-14m", "--config", str(ROOT / "config_hub/pretrain/debug.yaml"), "--dry_run"])
    assert "model        pythia-14m:" in capsys.readouterr().out  # not the recipe's llama-debug
