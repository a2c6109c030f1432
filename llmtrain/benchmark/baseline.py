"""The benchmark's baselines: reference tokens/s per machine and setting, and the key that finds them.

The repository's baselines are ``baseline.json`` in this package, shipped as package data and read through
``importlib.resources``, so an installed copy (not only a source tree) compares with them. A machine they have no
number for keeps its own in the llmtrain cache. Nothing writes the package's file: a new reference number goes in
by hand, or by recording a run into it with ``--baseline llmtrain/benchmark/baseline.json`` in a source tree.
"""

from __future__ import annotations

import json
import os
from importlib.resources import files
from pathlib import Path
from typing import Optional

from llmtrain.distributed.parallel_plan import data_parallel_ranks

DEFAULT_BASELINE = Path(files(__package__) / "baseline.json")  # a plain file: packages install unzipped
"""The repository's baselines (--baseline's default): this package's ``baseline.json``."""


def baseline_key(record: dict) -> str:
    """The machine and setting a baseline belongs to. The machine is the device's model (a CPU's with its core
    count), since another CPU is another speed. Threads are part of the setting: on a shared box a run with one
    thread per process is steadier than one whose OpenMP threads wait for each other behind other work. A setting
    left at its default adds nothing, so keys stay those of the runs recorded before it was a flag."""
    key = "|".join(str(record[k]) for k in ("device", "model", "precision", "micro_batch_size", "seq_len",
                                            "devices", "compile", "threads_per_process"))
    split = [f"{name} {record.get(name)}" for name in ("tp_size", "pp_size") if (record.get(name) or 1) > 1]
    if record.get("strategy", "auto") not in ("auto", "fsdp"):
        split.append(record["strategy"])
    if record.get("sharding_strategy") not in (None, "FULL_SHARD"):  # FULL_SHARD: the default on one node
        split.append(record["sharding_strategy"])
    if record.get("global_batch_size", default_global_batch(record)) != default_global_batch(record):
        split.append(f"global batch {record['global_batch_size']}")  # accumulation: fewer optimizer steps per token
    if record.get("activation_checkpointing"):
        split.append(f"activation checkpointing {record['activation_checkpointing']}")
    if record.get("recipe", "pretrain") != "pretrain":  # a pretraining key stays as it was before --recipe
        split.append(record["recipe"])
    if record.get("lora"):
        split.append(_lora_words(record["lora"]))
    if record.get("quantize"):
        split.append(record["quantize"])
    return "|".join([key, *split])


def default_global_batch(record: dict) -> int:
    """--global_batch_size's default for a record's setting: micro batch × data-parallel ranks × pipeline stages."""
    tp, pp, devices = record.get("tp_size") or 1, record.get("pp_size") or 1, record["devices"]
    data_parallel = data_parallel_ranks(devices, tp, pp) or devices
    return record["micro_batch_size"] * data_parallel * pp


def _lora_words(lora: dict) -> str:
    """"r 8, alpha 16, dropout 0.05 on query, value": the adapters a finetune_lora record timed."""
    targets = [name.removeprefix("lora_") for name in ("lora_query", "lora_key", "lora_value", "lora_projection",
                                                       "lora_mlp", "lora_head") if lora[name]]
    return f"r {lora['lora_r']}, alpha {lora['lora_alpha']}, dropout {lora['lora_dropout']:g} on {', '.join(targets)}"


def machine_baseline_file() -> Path:
    """Where a machine that the repository has no baseline for keeps its own: the llmtrain cache."""
    from llmtrain.data.tokens import cache_dir

    return cache_dir() / "benchmark_baseline.json"


def _baseline_files(path: Path) -> list[Path]:
    """The files a baseline is looked up in: ``path``, and for the default the machine's own file after it."""
    return [path, machine_baseline_file()] if path == DEFAULT_BASELINE else [path]


def _read_baseline(file: Path) -> dict:
    """A baseline file's {key: numbers}; {} for a file not there yet. Raises naming the file when it is not one."""
    if not file.exists():
        return {}
    if file.is_dir():
        raise ValueError(f"baseline file {file} is a folder; pass --baseline a JSON file (it is created when missing)")
    try:
        stored = json.loads(file.read_text())
    except ValueError as error:
        raise ValueError(f"baseline file {file} is not valid JSON ({error}); fix it, delete it (the next run "
                         "records a new baseline) or pass another --baseline") from None
    if not isinstance(stored, dict):
        raise ValueError(f"baseline file {file} holds a {type(stored).__name__}, not an object of baselines by "
                         "machine and setting; fix it, delete it or pass another --baseline")
    return stored


def _check_record_files(results: Path, baseline: Optional[Path]) -> None:
    """Before the run, not after it: --results is no folder, and the baselines it compares with parse."""
    if results.is_dir():
        raise ValueError(f"--results {results} is a folder; name the JSON-lines file to append to, e.g. "
                         f"{results / 'benchmarks.jsonl'}")
    for file in _baseline_files(baseline) if baseline is not None else []:
        _read_baseline(file)


def _stored_baseline(record: dict, path: Path) -> Optional[dict]:
    """The baseline for this machine and setting: from ``path`` (for the default, the repository's file and then
    :func:`machine_baseline_file`). Where none is stored, this run becomes it (in ``path``, or for the default in
    the machine's file, never in the repository) and None is returned: there is nothing to compare with yet."""
    key = baseline_key(record)
    files = _baseline_files(path)
    for file in files:
        stored = _read_baseline(file)
        if key in stored:
            return stored[key]
    target = files[-1]
    stored = _read_baseline(target)
    stored[key] = {name: record[name] for name in ("tokens_per_sec_per_device", "mfu", "commit", "device", "torch",
                                                   "load_average", "time", "command")}
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(stored, indent=2) + "\n")
    os.replace(partial, target)  # never a half-written file
    print(f"no baseline for this machine and setting ({key}) in {' or '.join(map(str, files))}: this run "
          f"({record['tokens_per_sec_per_device']:,.0f} tokens/s) is now the baseline, in {target}")
    return None

