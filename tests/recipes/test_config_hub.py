"""Every YAML recipe in config_hub/ parses through the real CLI and resolves to arguments a run would accept.

Nothing trains here: placeholder paths (checkpoints, data) need not exist, because `--print_config` prints
the resolved arguments and exits before the recipe looks at any file.
"""

import re
from pathlib import Path

import pytest
import yaml

from llmtrain.args import EvalArgs, TrainArgs, batch_plan
from llmtrain.distributed.launch import resolve_devices
from llmtrain.cli import main
from llmtrain.config import Config
from llmtrain.data import REGISTRY
from llmtrain.precision import resolve_precision

ROOT = Path(__file__).resolve().parents[2]
HUB = ROOT / "config_hub"
RECIPES = sorted(HUB.rglob("*.yaml"))
FINETUNE_COMMANDS = {"full": "finetune_full", "lora": "finetune_lora", "qlora": "finetune_lora"}
PRETRAIN_DATA_WITH_OWN_TOKENIZER = {"BuiltinStories", "PythonStdlib"}


def command_of(recipe: Path) -> str:
    """pretrain/*.yaml → pretrain; finetune/<model>/{full,lora,qlora}.yaml → finetune_full / finetune_lora."""
    kind = recipe.relative_to(HUB).parts[0]
    if kind == "finetune":
        assert recipe.stem in FINETUNE_COMMANDS, f"{recipe}: finetune recipes are named full, lora or qlora.yaml"
        return FINETUNE_COMMANDS[recipe.stem]
    assert kind == "pretrain", f"{recipe}: config_hub/ holds pretrain/ and finetune/ only"
    return kind


def resolve(recipe: Path, capsys) -> dict:
    with pytest.raises(SystemExit) as done:  # --print_config prints and exits
        main([command_of(recipe), "--config", str(recipe), "--print_config"])
    assert done.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def model_of(recipe: Path, resolved: dict) -> Config:
    """The architecture a recipe trains: its model_name (pretrain) or the name of its checkpoint_dir (finetune)."""
    if command_of(recipe) == "pretrain":
        if resolved.get("model_config"):
            return Config(**resolved["model_config"])
        assert resolved.get("model_name"), f"{recipe}: names neither model_name nor model_config"
        return Config.from_name(resolved["model_name"])
    return base_model_of(resolved["checkpoint_dir"])


def base_model_of(checkpoint_dir: str) -> Config:
    """The architecture a finetune recipe starts from: `checkpoints/<org>/<name>` names a zoo entry by its Hugging
    Face repository name; `<out_dir>/final` is what the pretrain recipe with that out_dir trains."""
    for recipe in (HUB / "pretrain").glob("*.yaml"):
        written = yaml.safe_load(recipe.read_text())
        if f"{written['out_dir']}/final" == checkpoint_dir:
            return Config.from_name(written["model_name"])
    return Config.from_name(Path(checkpoint_dir).name)


def test_there_are_recipes():
    assert (HUB / "pretrain/debug.yaml") in RECIPES
    for name in ("tinyllama", "llama-3.2-1b", "pythia-160m"):
        assert (HUB / f"pretrain/{name}.yaml") in RECIPES


def test_every_finetune_folder_has_full_lora_and_qlora():
    folders = sorted(path for path in (HUB / "finetune").iterdir() if path.is_dir())
    assert folders
    for folder in folders:
        assert sorted(p.name for p in folder.glob("*.yaml")) == ["full.yaml", "lora.yaml", "qlora.yaml"], folder


def test_every_model_family_has_finetune_recipes():
    """Each family the prompt styles know (Llama 2, Llama 3.x, TinyLlama, Mistral, Qwen2.5, Gemma, Phi-2,
    Pythia, SmolLM2) has recipes: a new family in llmtrain.prompts without recipes fails here."""
    from llmtrain.prompts import FAMILY_STYLES

    names = [yaml.safe_load(path.read_text())["checkpoint_dir"] for path in (HUB / "finetune").rglob("*.yaml")]
    models = [base_model_of(name).name for name in names]
    for pattern, _, _ in FAMILY_STYLES:
        if pattern == r"-debug$":
            continue
        assert any(re.search(pattern, model.lower()) for model in models), f"no finetune recipe for {pattern!r}"


@pytest.mark.parametrize("recipe", sorted((HUB / "finetune").rglob("*.yaml")), ids=lambda p: str(p.relative_to(HUB)))
def test_the_prompt_style_comment_says_where_the_style_comes_from(recipe):
    """prompt_style: null takes the checkpoint's prompt_style.yaml, else its chat template (which a transformers
    download of these models carries), else the family's style; the comments left the chat template out."""
    from llmtrain.prompts import PromptStyle

    lines = recipe.read_text().splitlines()
    end = next(index for index, line in enumerate(lines) if line.startswith("prompt_style:"))
    start = max(index for index in range(end) if lines[index].startswith("# null:"))
    comment = " ".join(line[2:] for line in lines[start:end])
    family = PromptStyle.from_config(base_model_of(yaml.safe_load(recipe.read_text())["checkpoint_dir"])).name
    if recipe.parent.name == "debug":
        assert comment.startswith("null: the checkpoint's own prompt style, else its family's (alpaca"), comment
        return
    assert re.match(r"null: the checkpoint's own prompt_style\.yaml, else its chat template .*, else the family's: "
                    rf"{re.escape(family)} \(", comment), comment


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(HUB)))
def test_recipe_parses_and_resolves(recipe, capsys):
    command = command_of(recipe)
    written = yaml.safe_load(recipe.read_text())
    if command != "pretrain":
        assert "checkpoint_dir" in written, f"{recipe}: finetune recipes name checkpoint_dir (a placeholder is fine)"
    resolved = resolve(recipe, capsys)

    # Batch arithmetic at the world size the recipe names.
    train = TrainArgs(**resolved["train"])
    EvalArgs(**resolved["eval"])
    devices, _ = resolve_devices(resolved["devices"], resolved["num_nodes"], "cpu", environ={})  # auto: 1 on a CPU
    world = devices * resolved["num_nodes"]
    plan = batch_plan(train, world)
    assert plan.grad_accum_steps * world * plan.micro_batch_size == plan.global_batch_size
    assert any(v is not None for v in (train.max_steps, train.max_tokens, train.epochs)), f"{recipe}: never stops"

    # A known model, and sequences it can hold.
    config = model_of(recipe, resolved)
    seq_len = train.max_seq_length or config.block_size
    assert seq_len <= config.block_size, f"{recipe}: max_seq_length {seq_len} > block_size {config.block_size}"

    precision = resolve_precision(resolved["precision"], "cpu")
    optimizer = resolved["optimizer"]
    if isinstance(optimizer, dict):
        lr = optimizer.get("init_args", {}).get("lr")
        if lr is not None:
            assert train.min_lr <= lr, f"{recipe}: min_lr {train.min_lr} is above the peak lr {lr}"

    data = resolved.get("data")
    if data is not None:
        assert data["class_path"].rsplit(".", 1)[-1] in REGISTRY, f"{recipe}: unknown data module {data['class_path']}"

    if command == "pretrain":
        data_name = data["class_path"].rsplit(".", 1)[-1] if data else "BuiltinStories"
        if data_name not in PRETRAIN_DATA_WITH_OWN_TOKENIZER:
            assert resolved.get("tokenizer_dir"), f"{recipe}: {data_name} needs a tokenizer_dir"
    if command == "finetune_lora":
        if resolved["lora_head"]:
            assert not config.tie_embeddings, f"{recipe}: lora_head with tied embeddings"
        if recipe.stem == "qlora":
            assert resolved["quantize"], f"{recipe}: a qlora recipe sets quantize"
        if resolved.get("quantize"):
            # The same rules finetune_lora enforces when it starts.
            assert world == 1, f"{recipe}: --quantize runs on one device"
            assert not precision.is_mixed, f"{recipe}: --quantize needs a -true precision"


QLORA_RECIPES = [recipe for recipe in RECIPES if recipe.name == "qlora.yaml" and recipe.parent.name != "debug"]


@pytest.mark.parametrize("recipe", QLORA_RECIPES, ids=lambda p: p.parent.name)
def test_a_qlora_recipe_quotes_the_memory_its_dry_run_estimates(recipe, capsys, tmp_path, monkeypatch):
    """The comment's two figures, as written and with activation checkpointing, are what `--dry_run` prints for
    the recipe on a stand-in folder of its model (the dry run reads only the architecture) and stand-in data (it
    checks that the file exists)."""
    from llmtrain.checkpoint.layout import CONFIG_FILE

    comment = " ".join(line[2:] for line in recipe.read_text().splitlines() if line.startswith("# "))
    written, checkpointed = re.search(r"estimates ([\d.]+) GiB per device as written, and ([\d.]+) GiB with "
                                      r"`--fsdp.activation_checkpointing true`", comment).groups()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    base_model_of(yaml.safe_load(recipe.read_text())["checkpoint_dir"]).save(model_dir / CONFIG_FILE)
    for name in ("model.safetensors", "tokenizer.json"):
        (model_dir / name).write_bytes(b"")
    data = yaml.safe_load(recipe.read_text())["data"]["init_args"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / (data.get("json_path") or data["path"])).write_text("[]")  # the file the recipe names
    for stated, extra in ((written, []), (checkpointed, ["--fsdp.activation_checkpointing", "true"])):
        main(["finetune_lora", "--config", str(recipe.resolve()), str(model_dir), "--out_dir", str(tmp_path / "out"),
              *extra, "--dry_run"])
        (total,) = re.findall(r"^memory {7}per device \(estimate.*\| total ([\d.]+) GiB$", capsys.readouterr().out,
                              re.M)
        assert total == stated, (recipe, extra, total, stated)
