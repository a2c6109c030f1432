"""`--help` documents every flag, in groups, with its default."""

import os
import re
import subprocess

import pytest

from forked_cli import run_forked

ENTRY = re.compile(r"^  (-[-\w.]+)(.*)$")

# The command lines this module reads, run together from one forked_cli driver on first use, each as its own
# `python -m llmtrain` process (a fresh interpreter each would import torch and llmtrain again: 2 s of CPU apiece).
BATCH = [*[[recipe, "--help"] for recipe in ("pretrain", "finetune_lora", "finetune_full")], ["pretrain", "list"]]
_FORKED: dict = {}


@pytest.fixture(scope="module", autouse=True)
def forked_workdir(tmp_path_factory):
    """Where this module's command lines keep their outputs (llmtrain_each)."""
    _FORKED.update(workdir=tmp_path_factory.mktemp("cli"), done={})
    yield
    _FORKED.clear()


def llmtrain_each(*argvs: list[str]) -> list[subprocess.CompletedProcess]:
    """Each `python -m llmtrain ARGV`'s result, the ones not run yet (and BATCH's) from one driver."""
    done = _FORKED["done"]
    pending = [argv for argv in [*argvs, *BATCH] if tuple(argv) not in done]
    pending = [argv for index, argv in enumerate(pending) if argv not in pending[:index]]
    if pending:
        results = run_forked(pending, _FORKED["workdir"] / str(len(done)), dict(os.environ), timeout_s=300)
        done.update(zip(map(tuple, pending), results))
    return [done[tuple(argv)] for argv in argvs]


def help_entries(command: list[str]) -> dict[str, str]:
    """Each option of `llmtrain COMMAND --help` with its help text (the lines up to the next option)."""
    [done] = llmtrain_each([*command, "--help"])
    assert done.returncode == 0, done.stderr
    entries: dict[str, str] = {}
    current = None
    for line in done.stdout.splitlines():
        match = ENTRY.match(line)
        if match:
            current = match[1]
            rest = match[2]
            # "--flag   text" or "--flag VALUE   text": the text follows two or more spaces
            if rest.startswith("  "):
                entries[current] = rest.strip()
            else:
                entries[current] = rest.strip().split("  ", 1)[1].strip() if "  " in rest.strip() else ""
        elif current and line.startswith(" " * 6) and line.strip():
            entries[current] += " " + line.strip()
        elif not line.strip():
            current = None
    return entries


@pytest.mark.parametrize("command", [["pretrain"], ["finetune_lora"], ["finetune_full"]])
def test_every_flag_has_help_and_its_default(command):
    entries = help_entries(command)
    assert len(entries) > 40
    undocumented = [flag for flag, text in entries.items() if not text.strip()]
    assert not undocumented, undocumented
    for flag in ("--train.global_batch_size", "--train.micro_batch_size", "--precision", "--devices",
                 "--fsdp.activation_checkpointing", "--dry_run.enabled", "--profile.start_step"):
        assert flag in entries and "default:" in entries[flag], (flag, entries.get(flag))


def test_flags_are_grouped_by_their_dataclass():
    """The fields of --train, --eval, --fsdp, --dry_run and --profile each sit under a heading of their own."""
    [done] = llmtrain_each(["pretrain", "--help"])
    heading, headings = None, {}
    for line in done.stdout.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            heading = line
        match = ENTRY.match(line)
        if match and "." in match[1]:
            headings.setdefault(match[1].split(".")[0], set()).add(heading)
    groups = ("--train", "--eval", "--fsdp", "--dry_run", "--profile")
    for group in groups:
        assert len(headings[group]) == 1 and headings[group] != {"options:"}, (group, headings[group])
    assert len({next(iter(headings[g])) for g in groups}) == len(groups)


def test_pretrain_list_shows_the_zoo_with_parameter_counts_and_aliases():
    [done] = llmtrain_each(["pretrain", "list"])
    rows = {line.split()[0]: line.split(None, 3)[1:] for line in done.stdout.splitlines()[1:]}
    assert rows["tiny-llama-1.1b"][:2] == ["1100.0M", "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"]
    assert rows["tiny-llama-1.1b"][2].split(", ") == ["tiny-llama", "tinyllama", "tinyllama-1.1b"]
    assert rows["pythia-160m"][:2] == ["162.3M", "EleutherAI/pythia-160m"]
    assert rows["Llama-3.1-8B"][0].startswith("8030")
    assert "llama-3-8b" in rows["Meta-Llama-3-8B"][2].split(", ")


def test_an_alias_prints_its_canonical_name_and_an_ambiguous_one_lists_the_candidates(tmp_path):
    command = ["pretrain", "tiny-llama", "--devices", "8", "--num_nodes", "4", "--dry_run", "--out_dir", str(tmp_path)]
    done, ambiguous = llmtrain_each(command, [*command[:1], "qwen2.5", *command[2:]])
    assert done.returncode == 0, done.stderr
    assert "model        tiny-llama-1.1b: 1,100.0M parameters" in done.stdout
    assert "8 devices × 4 nodes = 32 ranks" in done.stdout
    assert "global 512 sequences" in done.stdout and "config_hub/pretrain/tinyllama.yaml" in done.stdout
    done = ambiguous
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: The model name 'qwen2.5' is ambiguous: it may mean Qwen2.5-0.5B, Qwen2.5-1.5B, Qwen2.5-3B, "
                      "Qwen2.5-7B, Qwen2.5-14B, Qwen2.5-32B, Qwen2.5-72B; pass one of them"], done.stderr
    assert "Traceback" not in done.stderr


def test_every_commands_help_lists_debug(capsys):
    """`--debug` (main() takes it off the command line) is in the top level's help and in every command's."""
    from llmtrain.cli import commands, run_cli

    def command_lines(tree: dict, prefix: tuple = ()) -> list[tuple]:
        return [prefix] + [line for name, value in tree.items() for line in (
            command_lines(value, (*prefix, name)) if isinstance(value, dict) else [(*prefix, name)])]

    lines = command_lines(commands())
    assert ("pretrain",) in lines and ("convert", "to_hf") in lines
    for line in lines:
        with pytest.raises(SystemExit):
            run_cli([*line, "--help"])
        assert re.search(r"^  --debug +On an error, show its traceback instead of one line", capsys.readouterr().out,
                         re.M), line
