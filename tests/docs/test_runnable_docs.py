"""The README and the tutorials, followed verbatim: every block marked runnable is run, in order (the README's
first command before them, as its reader runs it).

A block is runnable when the line before its fence is ``<!-- runnable -->`` (```bash blocks run in
bash, ```python blocks in Python), or ``<!-- runnable: save as NAME -->`` (the block's text is saved to
NAME, as the reader would save it). Each document runs in its own empty folder, where `config_hub/`
is visible as from the repository root and the `llmtrain` of this environment is on PATH; what the
reader brings (their texts, their JSON records) is given by GIVEN below.

Tiny settings: every `llmtrain pretrain|finetune_lora|finetune_full` command gets TINY appended
(later flags override earlier ones), so a block that trains for hours in the tutorial trains for a
few steps here; RENAMES maps the step numbers the prose names to the ones those steps write. Nothing
else in a block is changed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MARKED_BLOCK = re.compile(r"^<!-- runnable(?:: save as (?P<save>\S+))? -->\n```(?P<lang>\w*)\n(?P<body>.*?)^```",
                          re.S | re.M)
TRAINING = re.compile(r"^(\s*llmtrain (?:pretrain|finetune_lora|finetune_full)\b.*)$", re.M)
# Two steps (the second writes the step checkpoint the prose's step 200 stands for, then final/), sequences of 128,
# two accumulation steps of 2: every step, save, resume, merge and conversion a document names still happens.
TINY = ("--train.max_steps 2 --train.save_interval 2 --train.global_batch_size 4 --train.micro_batch_size 2 "
        "--train.max_seq_length 128 --train.lr_warmup_steps 1 --eval.interval 1000 --eval.max_iters 1")
RENAMES = {"step-00000200": "step-00000002"}


def _stories(count: int) -> list[str]:
    from llmtrain.data.stories import generate_stories

    return list(generate_stories(7, "train", count))


def _given_texts(folder: Path, stack: ExitStack) -> None:
    stories = _stories(200)
    for index in range(0, len(stories), 50):
        sub = folder / "my_texts" / f"part{index // 50}"
        sub.mkdir(parents=True)
        (sub / "stories.txt").write_text("\n\n".join(stories[index:index + 50]), encoding="utf-8")


def _given_records(folder: Path, stack: ExitStack) -> None:
    records = [{"instruction": f"What is {a} + {b}?", "output": str(a + b)} for a in range(8) for b in range(8)]
    (folder / "my_data.json").write_text(json.dumps(records))


HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The repository from_the_hub.md downloads: a tiny random Llama under its name, on a Hub on 127.0.0.1."""


def _given_hub(folder: Path, stack: ExitStack) -> dict[str, str | None]:
    """The Hub the reader downloads from, for as long as the document runs: HF_ENDPOINT points at it, online, with
    no token or cache of this machine's."""
    from local_hub import local_hub, write_tiny_llama

    repo = folder.parent / "hub" / HUB_REPO
    repo.mkdir(parents=True)
    hub = stack.enter_context(local_hub({HUB_REPO: write_tiny_llama(repo)}))
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(folder.parent / "hf_home"), "HF_HUB_OFFLINE": None,
            "HF_TOKEN": None}


GIVEN = {"pretrain_on_your_own_text.md": [_given_texts], "finetune_on_your_own_json.md": [_given_records],
         "convert_to_and_from_hf.md": [_given_records], "out_of_memory.md": [], "multi_gpu_and_multi_node.md": [],
         "parallelism.md": [],
         "README.md": [], "deepspeed.md": [], "data_at_scale.md": [_given_texts], "from_the_hub.md": [_given_hub]}
DOCS = {name: (ROOT / "tutorials" / name if name != "README.md" else ROOT / name) for name in GIVEN}


def runnable_blocks(markdown: str) -> list[tuple[str, str, str]]:
    """(language, body, save-as name or "") of each marked block, in order."""
    return [(m["lang"], m["body"], m["save"] or "") for m in MARKED_BLOCK.finditer(markdown)]


FIRST_COMMAND = re.compile(r"\.venv/bin/(llmtrain pretrain\b.*)$", re.M)


def reader_blocks(name: str) -> list[tuple[str, str, str]]:
    """What a reader runs, in order: the README's first command (its first `.venv/bin/llmtrain pretrain`, in the
    folder where the runnable blocks then run, as a reader runs it before reading on), then the runnable blocks."""
    markdown = DOCS[name].read_text()
    first = [("bash", FIRST_COMMAND.search(markdown)[1] + "\n", "")] if name == "README.md" else []
    return first + runnable_blocks(markdown)


def tiny(body: str) -> str:
    """Join continued lines, append TINY to each training command (before any trailing comment)."""
    body = body.replace("\\\n", " ")

    def shrink(match: re.Match) -> str:
        if "--dry_run" in match[1]:  # a plan costs nothing; its numbers are the point
            return match[1]
        command, _, comment = match[1].partition("  #")
        return f"{command.rstrip()} {TINY}" + (f"  #{comment}" if comment else "")

    body = TRAINING.sub(shrink, body)
    for old, new in RENAMES.items():
        body = body.replace(old, new)
    return body


# What a resumed run shares with the run it continues, as written in the document (TINY would hide a difference):
# the documents promise the same data order and losses, which nothing else in the settings changes.
RESUME_KEEPS = ("model_name", "model_config", "initial_checkpoint_dir", "tokenizer_dir", "precision", "data", "seed",
                "optimizer", "train.global_batch_size", "train.micro_batch_size", "train.max_seq_length",
                "train.lr_warmup_steps", "train.lr_warmup_fraction", "train.min_lr", "train.lr_decay", "train.max_norm")


def _settings(words: list[str]) -> dict:
    """What `llmtrain ...words... --print_config` prints, as a dict."""
    import contextlib
    import io

    import yaml

    from llmtrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*words, "--print_config"])
    return yaml.safe_load(out.getvalue())


def _setting(settings: dict, key: str):
    for part in key.split("."):
        settings = settings[part]
    return settings


def _differences(written: dict, resumed: dict) -> list[str]:
    return [f"{key}: {_setting(written, key)!r} -> {_setting(resumed, key)!r}" for key in RESUME_KEEPS
            if _setting(written, key) != _setting(resumed, key)]


NAMED_STEP = re.compile(r"(\S+)/step-(\d{8})\b")


def _check_named_steps(name: str, line: str, latest: dict[str, dict]) -> None:
    """A step checkpoint that a command names exists once the run before it, as written (no TINY), ran: that run is
    sized in steps (an epoch's steps depend on the data), reaches the step, and saves there."""
    for out_dir, step in NAMED_STEP.findall(line):
        if out_dir not in latest:
            continue
        train, step = latest[out_dir]["train"], int(step)
        ends, interval = train["max_steps"], train["save_interval"]
        saved = ends is not None and step <= ends and (step == ends or bool(interval) and step % interval == 0)
        assert train["epochs"] is None and train["max_tokens"] is None and saved, (
            f"{name}: `{line.strip()}` names {out_dir}/step-{step:08d}, which the run that wrote {out_dir} may not "
            f"write: max_steps {ends}, save_interval {interval}, epochs {train['epochs']}, max_tokens "
            f"{train['max_tokens']} (an epoch's steps depend on the data's size)")


@pytest.mark.parametrize("name", list(DOCS))
def test_a_resumed_run_keeps_the_settings_of_the_run_it_continues(name, tmp_path, monkeypatch):
    """Every `--resume` training command of a document's runnable blocks, as written (no TINY), resolves to the
    settings of the command that first wrote its out_dir: another sequence length, batch or data is refused by the
    resume, or changes the run that the text says continues unchanged; and a command without --resume never starts in an
    out_dir that an earlier one wrote (it would stop with "already holds checkpoints"). Nothing is trained: the settings
    are what --print_config prints, and a `--print_config > FILE` line writes FILE for the commands after it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config_hub").symlink_to(ROOT / "config_hub")
    first: dict[str, dict] = {}
    latest: dict[str, dict] = {}  # the settings of the last run that wrote each out_dir
    for lang, body, save_as in reader_blocks(name):
        if save_as:
            (tmp_path / save_as).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / save_as).write_text(body)
            continue
        if lang != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if not TRAINING.match(line):
                _check_named_steps(name, line, latest)
                continue
            words = shlex.split(line, comments=True)[1:]
            target = None
            if ">" in words:
                words, target = words[:words.index(">")], words[words.index(">") + 1]
            settings = _settings([word for word in words if word != "--print_config"])
            if target is not None:
                (tmp_path / target).write_text(yaml.safe_dump(settings, sort_keys=False))
            if target is not None or settings["dry_run"]["enabled"]:
                continue  # a plan writes nothing
            elif settings["resume"] is False:
                # A fresh run into an out_dir that an earlier command wrote stops with "already holds checkpoints".
                assert settings["out_dir"] not in first, (f"{name}: `{line.strip()}` starts a fresh run in "
                                                          f"{settings['out_dir']}, which an earlier command wrote")
                first[settings["out_dir"]] = settings
            else:
                assert settings["out_dir"] in first, f"{name}: `{line.strip()}` resumes a run the document never starts"
                changed = _differences(first[settings["out_dir"]], settings)
                assert not changed, (f"{name}: `{' '.join(words)}` resumes {settings['out_dir']} with other settings "
                                     f"than the run that wrote it: {'; '.join(changed)}")
            latest[settings["out_dir"]] = settings


def test_every_listed_document_has_runnable_blocks():
    for name, path in DOCS.items():
        assert runnable_blocks(path.read_text()), f"{name} marks no block runnable"


NOT_RUN = {"llmtrain evaluate out/smol-lora/final --tasks hellaswag": "lm-eval's datasets come from the Hub"}
"""README commands of the Hub path that no test runs, and why."""


def test_the_readmes_hub_path_is_run_by_the_tutorial():
    """Each command of the README's Hub path starts a line of a runnable block of from_the_hub.md (which the test
    above runs), or is in NOT_RUN with the reason."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### From a model on the Hub"):]
    block = section[section.index("```bash\n") + 8:].split("```", 1)[0].replace("\\\n", " ")
    commands = [" ".join(shlex.split(line, comments=True)) for line in block.splitlines() if line.strip()]
    ran = [" ".join(shlex.split(line, comments=True)) for _, body, _ in
           runnable_blocks(DOCS["from_the_hub.md"].read_text()) for line in body.replace("\\\n", " ").splitlines()
           if line.startswith("llmtrain ")]
    assert len(commands) == 5
    for command in commands:
        assert any(line.startswith(command) for line in ran) or any(command.startswith(skip) for skip in NOT_RUN), (
            f"README's `{command}` is run by no runnable block of tutorials/from_the_hub.md")


def test_tiny_overrides_training_commands_only():
    body = "llmtrain pretrain --config x.yaml \\\n    --train.max_steps 300  # long\nllmtrain generate out --prompt hi\n"
    shrunk = tiny(body)
    assert shrunk.splitlines()[0].endswith("  # long") and TINY in shrunk.splitlines()[0]
    assert shrunk.splitlines()[1] == "llmtrain generate out --prompt hi"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DOCS))
def test_document_runs_verbatim(name, tmp_path, tmp_path_factory):
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "config_hub").symlink_to(ROOT / "config_hub")
    stack = ExitStack()  # what a given keeps running (a Hub) while the document runs
    changes: dict[str, str | None] = {}
    for give in GIVEN[name]:
        changes.update(give(folder, stack) or {})
    # OMP_NUM_THREADS stays this process's: under pytest-xdist, conftest gave it this worker's share of the cores (a
    # fixed 2 beside the other worker, times 2 for a `--devices 2` block's workers, made every OpenMP thread wait for
    # the others: a tiny pretraining took 5x the CPU time of one thread); alone, the document's commands choose theirs.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "GLOO_SOCKET_IFNAME": "lo", "LLMTRAIN_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "shared-cache"),
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env = {key: value for key, value in {**env, **changes}.items() if value is not None}
    with stack:
        for number, (lang, body, save_as) in enumerate(reader_blocks(name), start=1):
            if save_as:
                (folder / save_as).parent.mkdir(parents=True, exist_ok=True)
                (folder / save_as).write_text(body)
                continue
            if lang == "bash":
                command = ["bash", "-e", "-o", "pipefail", "-c", tiny(body)]
            elif lang == "python":
                command = [sys.executable, "-c", body]
            else:
                raise AssertionError(f"{name} block {number}: cannot run a ```{lang} block")
            done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, (f"{name} block {number} failed:\n{body}\n--- stdout\n"
                                          f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
