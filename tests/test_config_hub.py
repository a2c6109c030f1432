"""Every YAML recipe in config_hub/ parses and resolves to valid arguments."""

from pathlib import Path

import pytest
import yaml

from llmtrain.args import TrainArgs, batch_plan
from llmtrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "config_hub").rglob("*.yaml"))


def test_there_are_recipes():
    assert (ROOT / "config_hub/pretrain/debug.yaml") in RECIPES


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_parses_and_resolves(recipe, capsys):
    command = recipe.relative_to(ROOT / "config_hub").parts[0]
    with pytest.raises(SystemExit) as done:  # --print_config prints and exits
        main([command, "--config", str(recipe), "--print_config"])
    assert done.value.code in (0, None)
    resolved = yaml.safe_load(capsys.readouterr().out)
    train = TrainArgs(**resolved["train"])
    world = resolved.get("devices", 1) * resolved.get("num_nodes", 1)
    assert batch_plan(train, world).grad_accum_steps >= 1
    if resolved.get("model_name"):
        from llmtrain.config import Config

        config = Config.from_name(resolved["model_name"])
        assert (train.max_seq_length or config.block_size) <= config.block_size
