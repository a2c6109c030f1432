"""The command line's own rewriting (llmtrain/cli.py), through the real parser up to the launch."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtrain.cli import CommandLineError, run_cli
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


@pytest.mark.parametrize("argv, meant", [
    (["pretrain", "llama-debug", "--train.max_step", "3"], "--train.max_steps"),  # a flag group's field
    (["pretrain", "llama-debug", "--dry_run.simulat", "true"], "--dry_run.simulate"),  # a subcommand's flag
    (["pretrain", "llama-debug", "--optimizer", "AdamW", "--optimizer.weight_dec", "0.1"], "--optimizer.weight_decay"),
    (["pretrain", "llama-debug", "--data", "TextFiles", "--data.train_data_pat", "x"], "--data.train_data_path"),
    (["convert", "to_hf", "a", "b", "--dtyp", "float32"], "--dtype"),  # a subcommand's subcommand
    (["--conf=x.yaml", "pretrain", "--model_name", "llama-debug"], "--config"),  # the top level
])
def test_a_flag_is_never_abbreviated_and_a_misspelled_one_is_named_with_the_flag_meant(argv, meant, tmp_path):
    with pytest.raises(CommandLineError) as refused:
        run_cli([*argv, "--out_dir", str(tmp_path / "out"), "--dry_run"] if "pretrain" in argv else argv)
    assert f"did you mean {meant}" in str(refused.value), str(refused.value)
    assert not (tmp_path / "out").exists()


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


def test_moving_the_positional_keeps_a_flag_without_a_value_and_the_flags_after_it():
    """``--print_config`` takes no value here: the flag after it, and that flag's value, stay where they were."""
    from llmtrain.cli import _positionals_after_config, commands

    argv = ["pretrain", "--model_config", "m.yaml", "--print_config", "--train.max_steps", "2"]
    assert _positionals_after_config(argv, commands()) == argv
    assert _positionals_after_config(["pretrain", "NAME", "--config", "c.yaml", "--print_config"], commands()) == [
        "pretrain", "--config", "c.yaml", "--model_name", "NAME", "--print_config"]
