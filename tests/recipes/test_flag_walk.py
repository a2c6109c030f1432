"""Every flag of every training recipe does something: it changes what the run receives, or is refused.

For each flag (nested dataclass fields included) the test gives one value other than the default, runs the
real command line up to the launch, and compares the :class:`RunSpec` handed to the launcher (or the dry run's
printed plan) with the one of the same command without the flag. A flag that is accepted and changes neither
would be accepted and ignored. Architecture fields of ``--model_config`` are left out: each is a field of the
model's Config, which tests/model/test_model.py covers.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin

import pytest

from llmtrain.cli import CommandLineError, run_cli
from llmtrain.config import Config
from llmtrain.recipes import finetune, pretrain
from llmtrain.recipes import prepare as prepare_module
from llmtrain.recipes.hparams import to_yaml

RECIPES = {"pretrain": pretrain.setup, "finetune_full": finetune.setup_full, "finetune_lora": finetune.setup_lora}
SKIPPED = {"model_name", "model_config", "checkpoint_dir", "data"}  # positional or covered elsewhere; see doc


def leaf_flags(fn) -> list[tuple[str, Any, Any]]:
    """(flag, type, default) for every flag of a recipe, dataclass groups expanded to their fields."""
    hints = typing.get_type_hints(fn)
    flags = []
    for name, parameter in inspect.signature(fn).parameters.items():
        if name in SKIPPED:
            continue
        annotation = hints.get(name, parameter.annotation)
        default = parameter.default
        if dataclasses.is_dataclass(default):
            field_hints = typing.get_type_hints(type(default))
            flags += [(f"--{name}.{field.name}", field_hints[field.name], getattr(default, field.name))
                      for field in dataclasses.fields(default)]
        else:
            flags.append((f"--{name}", annotation, default))
    return flags


def other_value(annotation: Any, default: Any, tmp_path: Path) -> str:
    """A command-line value of this type that differs from the default."""
    if get_origin(annotation) is Literal:
        return str(next(choice for choice in get_args(annotation) if choice != default))
    if get_origin(annotation) is Union:
        options = [a for a in get_args(annotation) if a is not type(None)]
        # A default of another member (--devices auto, an int flag) asks the first member for any value.
        fits = isinstance(options[0], type) and isinstance(default, options[0])
        return other_value(options[0], default if fits else None, tmp_path)
    if annotation is bool:
        return "false" if default else "true"
    if annotation is int:
        return str((default or 1) + 1)
    if annotation is float:
        return str(round((default or 1.0) / 2, 6))
    if annotation is str:
        return "H100" if default is None else f"{default}x"
    if annotation in (Path, Optional[Path]):
        return str(tmp_path / "elsewhere")
    raise AssertionError(f"no test value for {annotation}")


def outcome(argv: list[str], monkeypatch, capsys) -> tuple[str, Any]:
    """("refused", message), ("launched", the RunSpec as YAML) or ("printed", the dry run's plan)."""
    launched = []
    monkeypatch.setattr(prepare_module, "launch", lambda fn, args, **kw: launched.append(args[0]))
    try:
        run_cli(argv)
    except (ValueError, OSError, CommandLineError, TypeError) as error:
        return "refused", str(error)
    printed = capsys.readouterr().out
    if launched:
        spec = launched[0]
        # What the ranks read: not the command line's record (hyperparameters), and of the raw --fsdp.* group
        # only the checkpoint settings; its layout settings reach the run through the resolved plan.
        seen = {**to_yaml(spec), "data": to_yaml(spec.data), "optimizer": repr(spec.optimizer),
                "fsdp": {"state_dict_type": spec.fsdp.state_dict_type, "async_save": spec.fsdp.async_save}}
        del seen["hyperparameters"]
        return "launched", seen
    return "printed", printed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from llmtrain.checkpoint.layout import CONFIG_FILE

    directory = tmp_path_factory.mktemp("model")
    # Two layers, not llama-debug's four: what a flag changes does not depend on the depth (two still split into the
    # two pipeline stages that --pp_size 2 asks for), and --dry_run.simulate's rank steps through every layer under
    # fake tensors (about 5 s of CPU per layer per fine-tuning recipe).
    Config.from_name("llama-debug", n_layer=2).save(directory / CONFIG_FILE)
    for name in ("model.safetensors", "tokenizer.json"):
        (directory / name).write_bytes(b"")  # nothing reads the weights before the launch
    return directory


CASES = [(recipe, flag, annotation, default) for recipe, fn in RECIPES.items()
         for flag, annotation, default in leaf_flags(fn)]


@pytest.fixture(scope="module")
def base_runs(model_dir) -> dict[str, tuple[list[str], Any]]:
    """Per recipe (and per recipe on ONE_MICRO_BATCH): the command without any of the walked flags, and what it
    launches (computed once: each case compares against it). The run is never launched, so the shared --out_dir
    must stay empty: a file there could change what a later case's command does."""
    runs: dict[str, tuple[list[str], Any]] = {}
    yield runs
    recipes = {key.split()[0] for key in runs}
    written = [str(path) for recipe in recipes for path in (model_dir.parent / f"out-{recipe}").rglob("*")]
    assert not written, f"a case wrote into the shared --out_dir: {written}"


ONE_MICRO_BATCH = ("--train.micro_batch_size", "1", "--train.global_batch_size", "1")
"""Added to the base command (and so to its reference) of the flags in ON_ONE_MICRO_BATCH."""
ON_ONE_MICRO_BATCH = {"--dry_run.simulate"}
"""Flags whose run steps through every micro-batch of a step: --dry_run.simulate's rank costs about 0.4 s of CPU per
micro-batch (16 of them a step in fine-tuning's default batch); what the flag changes does not depend on how many."""


def base_run(recipe, model_dir, base_runs, monkeypatch, capsys, flag: str = "") -> tuple[list[str], Any]:
    key = f"{recipe} one micro-batch" if flag in ON_ONE_MICRO_BATCH else recipe
    if key not in base_runs:
        head = [recipe, "llama-debug"] if recipe == "pretrain" else [recipe, str(model_dir)]
        base = [*head, "--out_dir", str(model_dir.parent / f"out-{recipe}"), "--train.max_steps", "10"]
        if flag in ON_ONE_MICRO_BATCH:
            base += ONE_MICRO_BATCH
        base_runs[key] = base, outcome(base, monkeypatch, capsys)
    return base_runs[key]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_base_run_launches_and_is_the_same_every_time(recipe, model_dir, base_runs, monkeypatch, capsys):
    """What makes one shared reference per recipe sound: the same command launches the same RunSpec again."""
    base, reference = base_run(recipe, model_dir, base_runs, monkeypatch, capsys)
    assert reference[0] == "launched", reference
    assert outcome(base, monkeypatch, capsys) == reference


@pytest.mark.parametrize("recipe, flag, annotation, default", CASES, ids=[f"{c[0]} {c[1]}" for c in CASES])
def test_every_flag_changes_the_run_or_is_refused(recipe, flag, annotation, default, model_dir, base_runs, tmp_path,
                                                  monkeypatch, capsys):
    base, reference = base_run(recipe, model_dir, base_runs, monkeypatch, capsys, flag)
    assert reference[0] == "launched", reference
    value = other_value(annotation, default, tmp_path)
    if flag == "--optimizer":
        value = "SGD"
    if flag == "--accelerator":
        value = "cuda"  # auto is cpu on a machine without a GPU: cuda is the value that differs (refused here)
    result = outcome([*base, flag, value], monkeypatch, capsys)
    assert result != reference, f"{recipe} {flag} {value} was accepted and changed nothing"


@pytest.mark.parametrize("recipe, extra, message", [
    ("finetune_lora", ["--quantize", "bnb.nf4", "--devices", "2", "--tp_size", "2"],
     "bitsandbytes' quantized weights cannot be sharded by FSDP nor split by --tp_size 2"),
    ("finetune_lora", ["--devices", "2", "--pp_size", "2"], "finetune_lora trains with data parallelism only"),
])
def test_adapters_refuse_a_split_model_before_the_launch(recipe, extra, message, model_dir, monkeypatch, capsys):
    """QLoRA and LoRA under --tp_size or --pp_size: one message through the real command line, nothing launched."""
    kind, said = outcome([recipe, str(model_dir), "--out_dir", str(model_dir.parent / "out"), *extra], monkeypatch,
                         capsys)
    assert kind == "refused" and message in said, (kind, said)
