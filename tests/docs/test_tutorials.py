"""The commands in tutorials/ (and README.md) stay true to the CLI.

Every ```bash block is read like a shell would split it. Each `llmtrain SUBCOMMAND ...` (also
`.venv/bin/llmtrain`, `python -m llmtrain`, `torchrun ... -m llmtrain` and `deepspeed ... --module llmtrain`)
must name a real subcommand, and each `--flag` must be one that `llmtrain SUBCOMMAND --help` lists, or a field
of the class the flag belongs to (`--data.*` of the data module named by `--data`, `--optimizer.*` of the
optimizer, `--model_config.*` of Config). Boolean flags must be given a value, and `--config` files from the
repository must exist. Nothing is trained; the figures and output that out_of_memory.md and
parallelism.md quote from `--dry_run` are compared with the dry run.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "tutorials").glob("*.md")) + [ROOT / "README.md"]
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
INLINE_COMMAND = re.compile(r"(?<!`)`((?:\w+=\S* )*(?:\S*/)?llmtrain [^`\n]+)`(?!`)")
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
            if word.rsplit("/", 1)[-1] == "llmtrain" and (index == 0 or words[index - 1] in ("-m", "--module")
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
    assert llmtrain_invocations("```bash\ndeepspeed --num_gpus 2 --module llmtrain pretrain --devicez 2\n```\n") \
        == [["pretrain", "--devicez", "2"]]


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


# The rows of out_of_memory.md's tables (their first cell) -> the command whose dry run gives the row's figure.
# Pretraining rows add their flags to the tutorial's first command (micro batch 4); fine-tuning rows run on a
# Llama-3.1-8B model directory with the flags the table's heading names.
OOM_PRETRAIN_ROWS = {
    "recompute activations in backward": ["--fsdp.activation_checkpointing", "true"],
    "smaller micro batch, same global batch": ["--train.micro_batch_size", "1"],
    "both of the above": ["--fsdp.activation_checkpointing", "true", "--train.micro_batch_size", "1"],
    "shorter sequences": ["--train.max_seq_length", "2048"],
    "reduce-scatter the gradients after every micro-batch": ["--fsdp.skip_gradient_sync", "false"],
    "all three: checkpointing, micro batch 1, gradients sharded": [
        "--fsdp.activation_checkpointing", "true", "--train.micro_batch_size", "1", "--fsdp.skip_gradient_sync", "false"],
    "keep weights, gradients and moments in host memory": ["--fsdp.cpu_offload", "true", "--accelerator", "cuda"],
    "train in bf16 throughout": ["--precision", "bf16-true"],
    "shard weights after forward (the default)": [],
    "more devices": [],
}
OOM_COMPARED = {"SHARD_GRAD_OP": ["--fsdp.sharding_strategy", "SHARD_GRAD_OP"], "one device": ["--devices", "1"]}
OOM_FINETUNE_ROWS = {
    "full fine-tuning": ["finetune_full"],
    "full fine-tuning on 8 devices": ["finetune_full", "--devices", "8", "--fsdp.activation_checkpointing", "true"],
    "LoRA (3.4M trainable parameters)": ["finetune_lora"],
    "QLoRA, base weights in 4 bits": ["finetune_lora", "--quantize", "bnb.nf4"],
    "QLoRA and activation checkpointing": ["finetune_lora", "--quantize", "bnb.nf4",
                                           "--fsdp.activation_checkpointing", "true"],
}


def _table_rows(markdown: str) -> dict[str, list[str]]:
    """The cells of every markdown table row, by the row's first cell."""
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


def _dry_run(capsys, args: list[str]) -> str:
    """What `llmtrain ...args... --dry_run` prints."""
    from llmtrain.cli import main

    main([*args, "--dry_run"])
    return capsys.readouterr().out


def _estimate_gib(capsys, args: list[str]) -> float:
    """The total per device that `--dry_run` prints for these arguments."""
    (total,) = re.findall(r"^memory {7}per device \(estimate.*\| total ([\d.]+) GiB$", _dry_run(capsys, args), re.M)
    return float(total)


def _plain_blocks(markdown: str) -> list[list[str]]:
    """The lines of every fenced block without a language (quoted output)."""
    blocks, current, language = [], None, ""
    for line in markdown.splitlines():
        if line.startswith("```") and current is None:
            current, language = [], line[3:]
        elif line.startswith("```"):
            if not language:
                blocks.append(current)
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_the_parallelism_tutorial_quotes_what_its_dry_runs_print(capsys, tmp_path):
    """Every line of dry-run output that parallelism.md quotes is printed, as it stands, by one of the dry runs the
    text names: the 8B and the 70B of its first block, the 8B at `--tp_size 2 --pp_size 2` and the 70B at micro
    batch 4."""
    markdown = (ROOT / "tutorials" / "parallelism.md").read_text()
    llama_8b, llama_70b = ([word for word in words if word not in ("llmtrain", "--dry_run")]
                           + ["--out_dir", str(tmp_path / "out")] for words in shell_commands(markdown)[:2])
    assert "llama-3-8b" in llama_8b and "llama-3-70b" in llama_70b
    micro_4 = _dry_run(capsys, [*llama_70b, "--train.micro_batch_size", "4"])
    printed = set("\n".join([_dry_run(capsys, llama_8b), _dry_run(capsys, llama_70b), micro_4,
                             _dry_run(capsys, [*llama_8b, "--tp_size", "2", "--pp_size", "2"])]).splitlines())
    quoted = [line for block in _plain_blocks(markdown) for line in block]
    assert len(quoted) >= 10
    stale = [line for line in quoted if line not in printed]
    assert not stale, "parallelism.md quotes lines that no dry run prints:\n" + "\n".join(stale)
    (stated,) = re.findall(r"micro batch 4 .*\n?.* needs ([\d.]+) GiB per device as it stands", markdown)
    assert f"total {stated} GiB" in micro_4


def test_the_out_of_memory_tables_are_the_dry_runs(capsys, tmp_path):
    """Every per-device figure of out_of_memory.md is what `--dry_run` prints for that row's flags (to the
    figure's last digit): the tables rank the flags by the estimate, so they must move with it."""
    markdown = (ROOT / "tutorials" / "out_of_memory.md").read_text()
    rows = _table_rows(markdown)
    # The starting point: the first command of the first block.
    base = [word for word in shell_commands(markdown)[0] if word not in ("llmtrain", "--dry_run")]
    base += ["--out_dir", str(tmp_path / "out")]

    def close(stated: str, args: list[str], where: str) -> None:
        actual = _estimate_gib(capsys, args)
        places = len(stated.partition(".")[2])
        assert abs(float(stated) - actual) <= 0.5 * 10 ** -places + 1e-9, \
            f"out_of_memory.md, {where}: {stated} GiB, but the dry run of {' '.join(args)} prints {actual} GiB"

    (start,) = re.findall(r"needs \*\*([\d.]+) GiB\*\* per device", markdown)
    close(start, base, "the starting point")
    for name, flags in OOM_PRETRAIN_ROWS.items():
        close(rows[name][2].split()[0], base + flags, f"row {name!r}")
    for name, flags in OOM_COMPARED.items():
        (stated,) = re.findall(rf"{name}`? \(([\d.]+) GiB\)", markdown)
        close(stated, base + flags, f"the figure for {name}")

    for name, (command, *flags) in OOM_FINETUNE_ROWS.items():
        close(rows[name][2].split()[0].rstrip(":"), [command, *_oom_finetune(tmp_path), *flags], f"row {name!r}")


def _model_dir(model_dir: Path, model_name: str) -> Path:
    """A model directory of a zoo architecture, enough for a dry run (it reads only the architecture)."""
    from llmtrain.checkpoint.layout import CONFIG_FILE
    from llmtrain.config import Config

    model_dir.mkdir(parents=True, exist_ok=True)
    Config.from_name(model_name).save(model_dir / CONFIG_FILE)
    for name in ("model.safetensors", "tokenizer.json"):
        (model_dir / name).write_bytes(b"")
    return model_dir


def _oom_finetune(tmp_path: Path) -> list[str]:
    """A Llama-3.1-8B model directory and the flags of out_of_memory.md's fine-tuning table."""
    model_dir = _model_dir(tmp_path / "model", "Llama-3.1-8B")
    return [str(model_dir), "--train.micro_batch_size", "1", "--train.max_seq_length", "2048", "--precision",
            "bf16-true", "--out_dir", str(tmp_path / "out")]


def test_the_out_of_memory_lora_sizes_are_the_dry_runs(capsys, tmp_path):
    """The trainable parameters that out_of_memory.md gives for the 8B's adapters, without and with --lora_mlp, are
    what `finetune_lora --dry_run` prints."""
    markdown = " ".join((ROOT / "tutorials" / "out_of_memory.md").read_text().split())
    (stated,) = re.findall(r"`--lora_mlp true` takes this 8B's from ([\d.]+M) to ([\d.]+M) trainable", markdown)
    printed = tuple(re.search(r"^model .*, ([\d.]+M) trainable$", _dry_run(capsys, ["finetune_lora", *_oom_finetune(
        tmp_path), *flags]), re.M)[1] for flags in ([], ["--lora_mlp", "true"]))
    assert stated == printed, f"out_of_memory.md says {stated}; the dry runs print {printed}"


def test_the_finetuning_tutorial_quotes_its_commands_dry_runs(capsys, tmp_path, monkeypatch):
    """The per-device memory that finetune_on_your_own_json.md gives for its LoRA and QLoRA commands (and the LoRA
    command at micro batch 1) is what `--dry_run` prints for them, run where their model folders and data exist."""
    markdown = (ROOT / "tutorials" / "finetune_on_your_own_json.md").read_text()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_data.json").write_text(json.dumps([{"instruction": "What is 12 + 30?", "output": "42"}]))
    commands = {}
    for words in shell_commands(markdown):
        if words[:2] == ["llmtrain", "finetune_lora"] and words[2].startswith("checkpoints/"):
            _model_dir(tmp_path / words[2], words[2].rsplit("/", 1)[1])
            commands["qlora" if "--quantize" in words else "lora"] = [*words[1:], "--out_dir", str(tmp_path / "out")]
    prose = " ".join(markdown.split())
    ((lora, lora_micro_1),) = re.findall(r"micro batch 4 of 2,048 tokens: ([\d.]+) GiB per device by `--dry_run`, "
                                         r"a 24 GB GPU; ([\d.]+) GiB at `--train.micro_batch_size 1`", prose)
    (qlora,) = re.findall(r"a 7-8B model trains on a 24 GB GPU \(([\d.]+) GiB per device by `--dry_run`\)", prose)
    for stated, args in ((lora, commands["lora"]), (lora_micro_1, [*commands["lora"], "--train.micro_batch_size", "1"]),
                         (qlora, commands["qlora"])):
        assert float(stated) == _estimate_gib(capsys, args), f"finetune_on_your_own_json.md: {' '.join(args)}"
    assert float(qlora) <= 0.9 * 24  # the dry run fits a plan in 90% of a GPU (an L4: 24 GiB)


def test_the_torchrun_rendezvous_wait_is_torchruns_own():
    """multi_gpu_and_multi_node.md's wait for a missing node under torchrun is the timeout that torchrun gives its
    rendezvous for the two-node command of that page, and `--rdzv-conf timeout=N` replaces it."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler
    from torch.distributed.run import config_from_args, get_args_parser

    def wait_s(extra: list[str]) -> float:
        args = get_args_parser().parse_args(["--nnodes", "2", "--node_rank", "0", "--nproc_per_node", "2",
                                             "--master_addr", "127.0.0.1", "--master_port", "29500", *extra,
                                             "-m", "llmtrain", "pretrain"])
        config, _, _ = config_from_args(args)
        parameters = RendezvousParameters(config.rdzv_backend, config.rdzv_endpoint, config.run_id, config.min_nodes,
                                          config.max_nodes, **config.rdzv_configs)
        return create_rdzv_handler(parameters).timeout.total_seconds()

    markdown = " ".join((ROOT / "tutorials" / "multi_gpu_and_multi_node.md").read_text().split())
    (stated, flag_s) = re.findall(r"under torchrun its own rendezvous waits, (\d+) seconds unless "
                                  r"`--rdzv-conf timeout=(\d+)`", markdown)[0]
    assert wait_s([]) == int(stated), f"the tutorial says {stated} s; torchrun waits {wait_s([]):g} s"
    assert wait_s(["--rdzv-conf", f"timeout={flag_s}"]) == int(flag_s)
