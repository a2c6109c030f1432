"""``llmtrain pretrain``: train a model from scratch (or continue from weights) on a token stream."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from llmtrain.config import Config
from llmtrain.convert.hf import ensure_model_dir
from llmtrain.data import BuiltinStories
from llmtrain.recipes import checks, hparams
from llmtrain.recipes.flags import shared_flags, with_defaults
from llmtrain.recipes.hub import pretrain_batch_defaults, with_default_length
from llmtrain.recipes.prepare import prepare


@shared_flags(defaults={"out_dir": Path("out/pretrain")},
              docs={"data": "The data module, e.g. `--data TextFiles --data.train_data_path DIR`. Default: the "
                            "built-in corpus."})
def setup(
    model_name: Optional[str] = None,
    model_config: Optional[Config] = None,
    initial_checkpoint_dir: Optional[Path] = None,
    tokenizer_dir: Optional[Path] = None,
    **flags: Any,
) -> Optional[Path]:
    """Pretrain a model from the zoo (or a custom architecture) on a data module.

    Args:
        model_name: A name from the model zoo (`llmtrain pretrain list` prints them). Given as the first
            positional argument.
        model_config: A custom architecture instead of a zoo name: a YAML file or inline
            `--model_config.FIELD value` flags.
        initial_checkpoint_dir: Start a new run from the weights of this model directory (or transformers
            folder, converted on the fly).
        tokenizer_dir: Folder with tokenizer.json and tokenizer_config.json. Built-in data brings its own.
    """
    if model_name == "list":
        print_zoo()
        return None
    flags = with_defaults(setup, flags)
    if flags["data"] is None:
        flags["data"] = BuiltinStories()
    arguments = {"model_name": model_name, "model_config": model_config,
                 "initial_checkpoint_dir": initial_checkpoint_dir, "tokenizer_dir": tokenizer_dir, **flags}
    hyperparameters = hparams.hyperparameters(arguments)
    # Everything cheap is checked before any process, tokenizer or model is created.
    checks.check_out_dir(flags["out_dir"])
    checks.check_logger(flags["logger_name"])
    resume_from = checks.resume_checkpoint(flags, initial_checkpoint_dir)
    if initial_checkpoint_dir is not None:
        initial_checkpoint_dir = ensure_model_dir(Path(initial_checkpoint_dir), flag="--initial_checkpoint_dir")  # a transformers folder works too
    config = checks.resolve_model_config(model_name, model_config, initial_checkpoint_dir)
    zoo_name = config.name if config.name in Config.names() else None
    flags["train"] = with_default_length(flags["train"], zoo_name)
    return prepare("pretrain", flags, config=config, resume_from=resume_from, initial_checkpoint_dir=initial_checkpoint_dir,
            tokenizer_dir=tokenizer_dir, hyperparameters=hyperparameters,
            batch_defaults=pretrain_batch_defaults(zoo_name))


def print_zoo() -> None:
    """The zoo, one name per line: size (computed from the config, no weights built), Hugging Face id, aliases."""
    from llmtrain.config import aliases_of
    from llmtrain.flops import num_parameters

    print(f"{'name':<28} {'parameters':>10}  {'Hugging Face id':<52} aliases (any case)")
    for name in Config.names():
        config = Config.from_name(name)
        hf = f"{config.hf_config['org']}/{config.hf_config['name']}" if config.hf_config else "-"
        short = [alias for alias in aliases_of(name) if "/" not in alias and alias != config.hf_config.get(
            "name", "").lower()]
        print(f"{name:<28} {num_parameters(config) / 1e6:>9.1f}M  {hf:<52} {', '.join(short)}".rstrip())
