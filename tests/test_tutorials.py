"""The commands in tutorials/ (and README.md) stay true to the CLI.

Every ```bash block is read like a shell would split it. Each `llmtrain SUBCOMMAND ...` (also
`.venv/bin/llmtrain`, `python -m llmtrain` and `torchrun ... -m llmtrain`) must name a real subcommand,
and each `--flag` must be one that `llmtrain SUBCOMMAND --help` lists, or a field of the class the flag
belongs to (`--data.*` of the data module named by `--data`, `--optimizer.*` of the optimizer,
`--model_config.*` of Config). Boolean flags must be given a value, and `--config` files from the
repository must exist. Nothing is run.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "tutorials").glob("*.md")) + [ROOT / "README.md"]
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
INLINE_COMMAND = re.compile(r"(?<!`)`((?:\S*/)?llmtrain [^`\n]+)`(?!`)")
SHELL_OPERATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", "2>", "2>&1", "&>"}
BOOLEAN_VALUES = {"true", "false", "True", "False", "yes", "no"}
# The data module a recipe uses when no --data is given.
DEFAULT_DATA = {"pretrain": "BuiltinStories", "finetune_full": "BuiltinInstruct", "finetune_lora": "BuiltinInstruct",
                "finetune": "BuiltinInstruct"}
REQUIRED_TUTORIALS = ("pretrain_on_your_own_text.md", "finetune_on_your_own_json.md", "add_a_model_family.md",
                      "add_a_data_module.md", "deepspeed.md", "data_at_scale.md")


# ---- reading the documents ------------------------------------------------------------------------
def shell_commands(markdown: str) -> list[list[str]]:
    """The simple commands of every bash block and inline `llmtrain ...` span, as shell words (comments
    dropped, `\\` lines joined)."""
    commands = []
    for block in BASH_BLOCK.findall(markdown) + INLINE_COMMAND.findall(markdown):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            current: list[str] = []
            skip_next = False
            for word in words:
                if skip_next:
                    skip_next = False
                elif word in SHELL_OPERATORS:
                    commands.append(current)
                    current = []
                elif word in REDIRECTS:
                    skip_next = word != "2>&1"
                else:
                    current.append(word)
            commands.append(current)
    return [command for command in commands if command]


def llmtrain_invocations(markdown: str) -> list[list[str]]:
    """The words after `llmtrain` of every command that runs it."""
    found = []
    for words in shell_commands(markdown):
        for index, word in enumerate(words):
            if word.rsplit("/", 1)[-1] == "llmtrain" and (index == 0 or words[index - 1] == "-m"
                                                           or "=" in words[index - 1] or "/" in word):
                found.append(words[index + 1:])
                break
    return found


def tutorial_classes(markdown: str) -> dict[str, type]:
    """Classes that a document's python blocks define (its example data module), by name."""
    namespace: dict = {}
    for block in PYTHON_BLOCK.findall(markdown):
        if re.search(r"^class \w+\(", block, re.M):
            exec(compile(block, "<tutorial>", "exec"), namespace)  # noqa: S102 (our own documentation)
    return {name: value for name, value in namespace.items() if inspect.isclass(value)}


# ---- what the CLI accepts --------------------------------------------------------------------------
def subcommands() -> dict[str, Optional[list[str]]]:
    """Subcommand -> its own subcommands (None when it has none)."""
    from llmtrain.cli import commands

    return {name: (sorted(value) if isinstance(value, dict) else None) for name, value in commands().items()}


@lru_cache(maxsize=None)
def help_text(path: tuple[str, ...]) -> str:
    import contextlib
    import io

    from llmtrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*path, "--help"])
    return out.getvalue()


def help_flags(path: tuple[str, ...]) -> tuple[set[str], set[str]]:
    """(every --flag the help mentions, the boolean ones)."""
    text = help_text(path)
    flags = {flag.rstrip(".") for flag in re.findall(r"--[A-Za-z_][\w.]*", text)}
    booleans = set(re.findall(r"(--[\w.]+) \{true,false\}", text))
    return flags, booleans


def data_class(name: str, extra: dict[str, type]) -> type:
    from llmtrain.data import REGISTRY

    short = name.rsplit(".", 1)[-1]
    if short in REGISTRY and (name == short or name.startswith("llmtrain.")):
        return REGISTRY[short]
    if short in extra:
        return extra[short]
    raise AssertionError(f"--data {name} is not a registered data module ({', '.join(REGISTRY)}) "
                         "nor one the tutorial defines")


def nested_flag_ok(flag: str, words: list[str], command: str, extra: dict[str, type]) -> bool:
    """`--group.field` where the group's class comes from another flag of the same command."""
    group, _, field = flag[2:].partition(".")
    value = _value_of(f"--{group}", words)
    if group == "data":
        module = data_class(value or DEFAULT_DATA.get(command, ""), extra)
        return field in {f.name for f in dataclasses.fields(module)}
    if group == "optimizer":
        import torch.optim

        optimizer = getattr(torch.optim, (value or "AdamW").rsplit(".", 1)[-1])
        return field in inspect.signature(optimizer).parameters
    if group == "model_config":
        from llmtrain.config import Config

        return field in {f.name for f in dataclasses.fields(Config)}
    return False


def _value_of(flag: str, words: list[str]) -> Optional[str]:
    for index, word in enumerate(words):
        if word == flag and index + 1 < len(words):
            return words[index + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def check_invocation(words: list[str], extra: dict[str, type]) -> list[str]:
    """Problems with one `llmtrain ...` command line (empty: none)."""
    if not words or words[0].startswith("-"):
        return []  # `llmtrain --help`
    available = subcommands()
    command = words[0]
    if command not in available:
        return [f"`llmtrain {command}`: no such subcommand (there are {', '.join(available)})"]
    path: tuple[str, ...] = (command,)
    rest = words[1:]
    if available[command] is not None:
        if not rest or rest[0] not in available[command]:
            return [f"`llmtrain {command}` needs one of {available[command]}, got {rest[:1]}"]
        path, rest = (command, rest[0]), rest[1:]
    flags, booleans = help_flags(path)
    problems = []
    for index, word in enumerate(rest):
        if not word.startswith("--"):
            continue
        flag = word.split("=", 1)[0]
        if flag not in flags and not ("." in flag and nested_flag_ok(flag, rest, command, extra)):
            problems.append(f"`llmtrain {' '.join(path)}` has no flag {flag}")
        if flag in booleans and "=" not in word:
            following = rest[index + 1] if index + 1 < len(rest) else None
            if following not in BOOLEAN_VALUES:
                problems.append(f"`llmtrain {' '.join(path)} {flag}` needs a value (true or false)")
        if flag == "--data":
            value = _value_of(flag, rest)
            try:
                data_class(value or "", extra)
            except AssertionError as error:
                problems.append(str(error))
        if flag == "--config":
            value = _value_of(flag, rest)
            if value and value.startswith("config_hub/") and not (ROOT / value).is_file():
                problems.append(f"--config {value} does not exist")
    return problems


# ---- the tests -------------------------------------------------------------------------------------
def test_the_tutorials_exist():
    for name in REQUIRED_TUTORIALS:
        assert (ROOT / "tutorials" / name).is_file(), name


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_match_the_cli(doc):
    markdown = doc.read_text()
    invocations = llmtrain_invocations(markdown)
    if doc.parent.name == "tutorials":
        assert invocations, f"{doc.name} runs no llmtrain command"
    extra = tutorial_classes(markdown) if "class " in markdown else {}
    problems = [problem for words in invocations for problem in check_invocation(words, extra)]
    assert not problems, "\n".join(problems)


def test_the_checker_catches_drift():
    """The checks above would fail on the mistakes they exist for."""
    assert check_invocation(["pretrian", "--config", "x.yaml"], {})
    assert check_invocation(["pretrain", "--train.max_stepz", "3"], {})
    assert check_invocation(["generate", "out/final", "--raw"], {})
    assert check_invocation(["finetune_lora", "ckpt", "--data", "JSON", "--data.jsonpath", "x.json"], {})
    assert check_invocation(["pretrain", "--optimizer", "SGD", "--optimizer.betas", "[0.9,0.9]"], {})
    assert check_invocation(["convert", "to_hff", "a", "b"], {})
    assert check_invocation(["pretrain", "--config", "config_hub/pretrain/missing.yaml"], {})
    assert not check_invocation(["finetune_lora", "ckpt", "--data", "JSON", "--data.json_path", "x.json",
                                 "--optimizer.lr", "2e-4", "--lora_mlp", "true"], {})
    assert llmtrain_invocations("```bash\nA=1 .venv/bin/llmtrain pretrain --devices 2 && echo done\n```\n") == [
        ["pretrain", "--devices", "2"]]
    assert llmtrain_invocations("```bash\ntorchrun --nnodes 2 \\\n  -m llmtrain pretrain --devices 8  # note\n```\n") \
        == [["pretrain", "--devices", "8"]]


def test_the_data_module_example_works(tmp_path, monkeypatch):
    """add_a_data_module.md's example class passes the example test the tutorial itself gives."""
    from llmtrain.tokenizer import train_bpe_tokenizer

    markdown = (ROOT / "tutorials" / "add_a_data_module.md").read_text()
    classes = tutorial_classes(markdown)
    assert "CSVText" in classes
    namespace = {**classes, "train_bpe_tokenizer": train_bpe_tokenizer}
    tests = [block for block in PYTHON_BLOCK.findall(markdown) if block.startswith("def test_")]
    assert tests, "the tutorial shows a test"
    for block in tests:
        exec(compile(block, "<tutorial>", "exec"), namespace)  # noqa: S102 (our own documentation)
    namespace["test_csv_text"](tmp_path, monkeypatch)


def test_the_docs_give_the_templates_signal_lead_time():
    """`N minutes before the time limit`, wherever the docs say it, is the `--signal=B:USR1@SECONDS` of the
    sbatch templates."""
    templates = sorted((ROOT / "scripts/slurm").glob("*.sbatch"))
    leads = {int(seconds) for path in templates
             for seconds in re.findall(r"^#SBATCH --signal=B:USR1@(\d+)$", path.read_text(), re.M)}
    assert len(leads) == 1, leads
    (lead_s,) = leads
    numbers = {"one": 1, "two": 2, "five": 5, "ten": 10, "fifteen": 15, "twenty": 20, "thirty": 30}
    stated = [(doc.name, amount) for doc in [*DOCS, ROOT / "scripts/slurm/README.md", *templates]
              for amount in re.findall(r"(\w+) minutes before the time limit", doc.read_text())]
    assert stated
    for name, amount in stated:
        minutes = int(amount) if amount.isdigit() else numbers[amount.lower()]
        assert minutes * 60 == lead_s, f"{name} says {amount} minutes; the templates send USR1 {lead_s} s before"
