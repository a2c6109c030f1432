"""The command line's own rewriting (llmtrain/cli.py), through the real parser up to the launch."""

from __future__ import annotations

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
