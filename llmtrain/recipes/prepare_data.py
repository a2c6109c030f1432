"""``llmtrain prepare_data``: tokenize a pretraining data module once, on every core of every rank, into a folder
of token shards and a manifest that training reads lazily (``--data Prepared --data.path DIR``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

from llmtrain.checkpoint import lock as out_dir_lock
from llmtrain.data.base import DataModule, PretrainDataModule
from llmtrain.data.manifest import Manifest, damaged_shards, describe_damage
from llmtrain.data.prepare import Preparation, check_writable, finished, forget_damaged, plan, prepare_rank
from llmtrain.data.tokens import available_cpu_count
from llmtrain.data.units import UNIT_BYTES, WorkUnit
from llmtrain.distributed.launch import is_first_process, launch, plan_launch, resolve_devices
from llmtrain.recipes.build import resolve_tokenizer


@dataclass
class PrepareJob:
    """What every rank needs (plain data: spawned ranks unpickle it)."""

    preparation: Preparation
    units: dict[str, list[WorkUnit]]
    out_dir: Path
    num_workers: int


def setup(
    data: Optional[DataModule] = None,
    out_dir: Optional[Path] = None,
    tokenizer_dir: Optional[Path] = None,
    shard_tokens: int = 2**23,
    unit_bytes: int = UNIT_BYTES,
    num_workers: Optional[int] = None,
    devices: Union[int, Literal["auto"]] = "auto",
    num_nodes: int = 1,
    verify: bool = False,
) -> Path:
    """Tokenize a pretraining data module into a folder of fixed-size token shards and a manifest.

    Every rank takes its share of the source's work units and tokenizes them on every core; a killed
    preparation resumes where it stopped, and a finished one is never redone.

    Args:
        data: The pretraining data module, as for pretrain, e.g. `--data TextFiles --data.train_data_path DIR`.
        out_dir: The prepared folder. Under several nodes, every node must see it (a shared filesystem).
        tokenizer_dir: Folder with tokenizer.json and tokenizer_config.json. Built-in data brings its own.
        shard_tokens: Most tokens in one shard file (default 2**23: 16 MiB of uint16 ids, or 32 MiB of uint32 ones
            for a vocabulary over 65,536).
        unit_bytes: About how much text one work unit holds (default 16 MiB): the grain of the work handed to a
            process, and of a resume. Each unit's tokens start a new shard.
        num_workers: Processes that tokenize on each rank (default: the available cores shared by the ranks of
            a node). With 1, the tokenizer's own threads use the cores.
        devices: Processes (ranks) per node: a number, or auto (one; under torchrun or srun, the processes it
            starts per node).
        num_nodes: Number of nodes.
        verify: For a folder that is prepared already, check every byte of every shard against the manifest's
            sha256 (hashing runs at the disk's or one core's speed), not only sizes and sampled blocks. Damaged
            shards are prepared again either way.
    """
    _check_source(data, out_dir, num_workers)
    data.validate()
    tokenizer = resolve_tokenizer(tokenizer_dir, data)
    preparation, units = plan(data, tokenizer, shard_tokens, unit_bytes)
    manifest = finished(out_dir, preparation)
    # NOTE: sizes and sampled blocks (a stat and 128 KiB a shard), or with --verify every byte, in each launching
    # process: the ranks must agree on whether to launch before they can talk.
    damaged = [] if manifest is None else damaged_shards(out_dir, manifest, check="sha256" if verify else "sample")
    if manifest is not None and not damaged:
        if is_first_process():
            _say_prepared(out_dir, manifest, verify)
        return Path(out_dir)
    check_writable(out_dir)
    devices, _ = resolve_devices(devices, num_nodes, "cpu")
    plan_launch(devices, num_nodes)  # the launcher's environment agrees with the flags
    workers = num_workers or max(1, available_cpu_count() // devices)
    with out_dir_lock.hold(out_dir) if is_first_process() else contextlib.nullcontext():  # one writer (recipes.prepare)
        if damaged and is_first_process():
            print(f"prepare_data: {out_dir} has {len(damaged)} damaged shard(s) ({describe_damage(damaged)}): "
                  "preparing their units again")
            forget_damaged(out_dir, [shard for shard, _ in damaged])
        launch(run, args=(PrepareJob(preparation, units, Path(out_dir), workers),), devices=devices,
               num_nodes=num_nodes)
    return Path(out_dir)


def _check_source(data: Optional[DataModule], out_dir: Optional[Path], num_workers: Optional[int]) -> None:
    """The flags of a preparation: pretraining data that is tokenized up front, whole, into ``out_dir``."""
    if data is None or out_dir is None:
        raise ValueError("prepare_data needs --data (e.g. `--data TextFiles --data.train_data_path DIR`) and "
                         "--out_dir (the folder to prepare)")
    if not isinstance(data, PretrainDataModule):
        raise ValueError(f"--data {type(data).__name__} is not pretraining data; prepare_data tokenizes a pretraining "
                         "module (TextFiles, HFDataset, BuiltinStories, PythonStdlib)")
    if num_workers is not None and num_workers < 1:
        raise ValueError(f"--num_workers {num_workers} must be at least 1 (or left out: every core)")
    if getattr(data, "streaming", False):
        raise ValueError("--data.streaming true tokenizes while training, and prepare_data tokenizes everything up "
                         "front: drop --data.streaming to prepare the source, or train on the stream directly")
    fraction = getattr(data, "val_split_fraction", None)
    if fraction is not None:
        raise ValueError(f"--data.val_split_fraction {fraction:g} holds out validation data when training: a prepared "
                         "folder keeps all of the training data. Drop it here, and pass it to the run that trains on "
                         f"the folder (--data Prepared --data.path {out_dir} --data.val_split_fraction {fraction:g})")


def _say_prepared(out_dir: Path, manifest: Manifest, verify: bool) -> None:
    shards = sum(len(split.shards) for split in manifest.splits.values())
    print(f"prepare_data: {out_dir} is prepared already ({manifest.splits['train'].tokens:,} training tokens "
          f"in {shards} shards, {'every byte' if verify else 'sizes and sampled blocks'} checked); nothing "
          "to do")


def run(job: PrepareJob) -> None:
    """One rank's preparation. Every process of the job executes this."""
    from llmtrain.distributed.runtime import Runtime

    runtime = Runtime.from_env("cpu")
    try:
        prepare_rank(job.preparation, job.units, job.out_dir, job.num_workers, runtime)
    finally:
        if not runtime.is_distributed:
            runtime.shutdown()
