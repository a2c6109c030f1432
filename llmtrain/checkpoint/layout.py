"""Every file and folder name of a checkpoint, and the questions that only need names to answer.

Nothing else in llmtrain spells one of these names; it imports them from here. Standard library
only, so the tokenizer, the config and the CLI can read the layout without importing torch.

An output directory (``--out_dir``)::

    step-NNNNNNNN/           a training checkpoint (resumable)
    final/                   the model at the end of the run (always a full model directory)
    .step-NNNNNNNN.tmp*      a save under way, or one a crash interrupted (deleted by the next save)
    .step-NNNNNNNN.old-PID   an older copy being deleted

A model directory (``final/``, a full ``step-*/``, a converted transformers model)::

    model.safetensors        the full weights (tied weights stored once)
    model_config.yaml        the architecture (llmtrain.config.Config)
    hyperparameters.yaml     the resolved command-line config of the run that wrote it
    tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json
    prompt_style.yaml        fine-tuning: how prompts are written out
    lora.safetensors         LoRA: the adapters (a LoRA step checkpoint has them instead of model.safetensors)
    lora.yaml                LoRA: the adapter settings and the base model they were trained on
    training_state.pt        step checkpoints: counters, data position, RNG, optimizer (full format)
    dcp/                     sharded step checkpoints: model + optimizer shards (torch.distributed.checkpoint)
    checkpoint.json          the marker, written last: format, step, and every file's size and checksum
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

FORMAT_VERSION = 3
"""3: the marker records every file's checksum (``"checksums"``); 2: its size (``"sizes"``). Older markers still
load, checked for what they record."""

MODEL_FILE = "model.safetensors"
LORA_FILE = "lora.safetensors"
CONFIG_FILE = "model_config.yaml"
HPARAMS_FILE = "hyperparameters.yaml"
STATE_FILE = "training_state.pt"
MARKER_FILE = "checkpoint.json"
LORA_SETTINGS_FILE = "lora.yaml"
PROMPT_STYLE_FILE = "prompt_style.yaml"
LOCK_FILE = ".llmtrain.lock"
"""In an out_dir: the lock its one writer holds (llmtrain.checkpoint.lock), with the holder's host and pid."""
DCP_DIR = "dcp"
DCP_METADATA_FILE = ".metadata"
"""The index torch.distributed.checkpoint writes beside the shards (a pickle: read with care)."""
WRITER_RANK = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|(?:bf16_)?zero_pp_rank_(\d+)_)")
"""The files one rank writes and reads on its own: a DCP shard (``dcp/__R_N.distcp``, torch's FileSystemWriter) or
a DeepSpeed partition (``zero_pp_rank_R_mp_rank_00_optim_states.pt``); group 1 or 2 is the rank R."""

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SENTENCEPIECE_FILE = "tokenizer.model"
"""A SentencePiece model (older Llama 2, Mistral and Gemma folders); llmtrain reads only tokenizer.json."""
"""Where transformers keeps a tokenizer's chat template (older folders: tokenizer_config.json's chat_template)."""
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE, GENERATION_CONFIG_FILE,
                   CHAT_TEMPLATE_FILE)
"""What ``Tokenizer.save`` copies into a checkpoint (generation_config.json: the ids that end generation)."""

FINAL_DIR = "final"
REWOUND_DIR = "rewound"
"""Where a run resumed from an older checkpoint puts the newer ones of the branch it abandoned."""
STEP_DIR = re.compile(r"^step-(\d{8})$")
LEFTOVER_DIR = re.compile(r"^\.(step-\d{8}|final)\.(tmp|old)")
"""What an interrupted save leaves: its temporary directory, or the old copy it was about to delete."""
"""Test hook: every save sleeps this many seconds before its marker, so a test can kill it half-way."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def temporary_dir(target: Path, process_id: Optional[int] = None) -> Path:
    """Where ``target`` is written before the rename that publishes it (``LEFTOVER_DIR`` matches it).

    Without ``process_id`` the name is the same on every rank, so a sharded save's ranks meet in it.
    """
    suffix = "tmp" if process_id is None else f"tmp-{process_id}"
    return target.parent / f".{target.name}.{suffix}"


def trash_dir(target: Path, process_id: int) -> Path:
    """Where an old ``target`` goes before it is deleted (``LEFTOVER_DIR`` matches it)."""
    return target.parent / f".{target.name}.old-{process_id}"


def is_complete(path: Path) -> bool:
    """A checkpoint counts only when its marker, written last, is there (and can be seen: not in a folder this
    process may not read)."""
    try:
        return (Path(path) / MARKER_FILE).is_file()
    except PermissionError:
        return False


def is_training_checkpoint(path: Path) -> bool:
    """Complete, and holding the training state that ``--resume`` needs."""
    return is_complete(path) and (Path(path) / STATE_FILE).is_file()


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """Complete ``step-*`` training checkpoints in ``out_dir``, oldest first (not checked for damage)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = []
    for child in out_dir.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and is_training_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def incomplete_step_dirs(out_dir: Path) -> list[Path]:
    """``step-*`` directories in ``out_dir`` that are no training checkpoint (no marker or training state, or
    unreadable), oldest first: no save of llmtrain leaves one (it writes under a temporary name), so a user should
    hear of them."""
    out_dir = Path(out_dir)
    complete = {path for _, path in list_checkpoints(out_dir)}
    return sorted(child for child in out_dir.iterdir() if STEP_DIR.match(child.name) and child.is_dir()
                  and child not in complete) if out_dir.is_dir() else []


def writer_rank(relative: str) -> Optional[int]:
    """The rank that wrote the checkpoint file ``relative`` (a path inside the checkpoint) on its own, if any."""
    match = WRITER_RANK.search(relative)
    return None if match is None else int(match.group(1) or match.group(2))


def latest_checkpoint(out_dir: Path) -> Optional[Path]:
    checkpoints = list_checkpoints(out_dir)
    return checkpoints[-1][1] if checkpoints else None
