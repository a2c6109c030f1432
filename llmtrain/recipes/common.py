"""Builders every recipe shares: checks before expensive work, model, optimizer, resume, hparams.

Plain functions, so that pretraining and fine-tuning assemble the same parts the same way and
all end in the one ``fit()``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Optional, Union

import torch

from llmtrain import checkpoint as layout
from llmtrain.config import Config

ResumeArg = Union[bool, Literal["auto"], Path]
OptimizerArg = Union[str, Callable[[Iterable], torch.optim.Optimizer]]


def configure_process(runtime: Any = None) -> None:
    """Per-process settings; spawned workers are fresh interpreters, so every entrypoint calls this."""
    import warnings

    # Warnings read as one line for people, not as a source listing.
    warnings.formatwarning = lambda message, category, *_: f"warning: {message}\n"
    if runtime is not None and not runtime.is_main:
        # Every rank sees the same configuration: rank 0 says it once. Errors still come from every rank.
        warnings.simplefilter("ignore")


# ----------------------------------------------------------------------------- model config
def resolve_model_config(model_name: Optional[str], model_config: Optional[Config],
                         initial_checkpoint_dir: Optional[Path] = None) -> Config:
    """Exactly one source of the architecture: a zoo name, an explicit config, or a model directory."""
    if model_name is not None and model_config is not None:
        raise ValueError("give either a model name from the zoo or --model_config, not both "
                         "(to change a zoo model, copy its model_config.yaml and edit it)")
    if model_config is not None:
        return model_config
    if model_name is not None:
        return Config.from_name(model_name)
    if initial_checkpoint_dir is not None:
        path = Path(initial_checkpoint_dir) / layout.CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"--initial_checkpoint_dir {initial_checkpoint_dir} has no {layout.CONFIG_FILE}")
        return Config.from_file(path)
    raise ValueError("no model given: pass a zoo name (`llmtrain pretrain list` shows them) or --model_config FILE")


# ------------------------------------------------------------------------------- out_dir/resume
def check_out_dir(out_dir: Path) -> None:
    """Fail now, not after hours of training, if checkpoints could not be written."""
    out_dir = Path(out_dir)
    parent = out_dir
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"--out_dir {out_dir}: {parent} is a file, not a directory; choose another --out_dir")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"--out_dir {out_dir}: {parent} is not writable; choose a directory you can write to")
    if out_dir.exists():
        try:
            with tempfile.NamedTemporaryFile(dir=out_dir):
                pass
        except OSError as error:
            raise PermissionError(f"--out_dir {out_dir} is not writable ({error})") from error


def resolve_resume(resume: ResumeArg, out_dir: Path, initial_checkpoint_dir: Optional[Path]) -> Optional[Path]:
    """Which checkpoint to continue from, or None for a fresh run."""
    if resume not in (False, None) and initial_checkpoint_dir is not None:
        raise ValueError("--resume and --initial_checkpoint_dir contradict each other: resume continues this run's "
                         "own checkpoint, initial_checkpoint_dir starts a new run from weights; pass only one")
    latest = layout.latest_checkpoint(out_dir)
    if resume is False or resume is None:
        if latest is not None:
            raise ValueError(f"--out_dir {out_dir} already holds checkpoints of a run (newest: {latest.name}); "
                             "pass --resume auto to continue it, or choose another --out_dir")
        return None
    if resume == "auto":
        return latest
    if resume is True:
        if latest is None:
            raise FileNotFoundError(f"--resume true: no complete checkpoint in --out_dir {out_dir}; "
                                    "use --resume auto to start fresh when there is none")
        return latest
    path = Path(resume)
    if not layout.is_complete(path) or not (path / layout.STATE_FILE).is_file():
        raise FileNotFoundError(f"--resume {path} is not a complete training checkpoint "
                                f"(it needs {layout.STATE_FILE} and {layout.MARKER_FILE})")
    return path


# ------------------------------------------------------------------------------------ tokenizer
def resolve_tokenizer(tokenizer_dir: Optional[Path], data: Any, *fallback_dirs: Optional[Path]):
    """``--tokenizer_dir``, else a model directory's tokenizer, else the data module's own, else an error."""
    from llmtrain.tokenizer import Tokenizer

    if tokenizer_dir is not None:
        return Tokenizer(tokenizer_dir)
    for directory in fallback_dirs:
        if directory is not None and (Path(directory) / "tokenizer.json").is_file():
            return Tokenizer(directory)
    own = data.default_tokenizer() if data is not None else None
    if own is None:
        raise ValueError(f"--data {type(data).__name__} needs a tokenizer: pass --tokenizer_dir DIR "
                         "(a folder with tokenizer.json and tokenizer_config.json)")
    return own


def check_vocab(tokenizer: Any, config: Config, tokenizer_source: str) -> None:
    if tokenizer.vocab_size > config.padded_vocab_size:
        raise ValueError(
            f"the tokenizer from {tokenizer_source} has {tokenizer.vocab_size} tokens but model {config.name!r} has "
            f"only {config.padded_vocab_size} embedding rows; use a model with vocab_size >= {tokenizer.vocab_size} "
            "(e.g. --model_config.vocab_size) or the model's own tokenizer")


# ---------------------------------------------------------------------------------------- model
def build_model(config: Config, *, runtime: Any, seed: int, precision: Any, strategy: str = "auto",
                fsdp: Any = None, num_nodes: int = 1, compile: bool = False,
                initial_checkpoint_dir: Optional[Path] = None) -> tuple[torch.nn.Module, Any]:
    """Build on the meta device, parallelize, then materialise only this rank's shard.

    A 70B model never exists whole on one rank: weights are allocated after sharding and initialised
    (or loaded from ``initial_checkpoint_dir``) shard by shard. The same seed gives the same weights
    at any world size.
    """
    from llmtrain.distributed.checkpoint import load_full_weights
    from llmtrain.distributed.parallelize import materialize, parallelize
    from llmtrain.model import GPT

    with torch.device("meta"):
        model = GPT(config).to(precision.param_dtype)
    model, info = parallelize(model, runtime=runtime, strategy=strategy, fsdp=fsdp, precision=precision,
                              num_nodes=num_nodes, compile=compile)
    materialize(model, runtime.device, seed, cpu_offload=info.cpu_offload)
    if initial_checkpoint_dir is not None:
        load_full_weights(model, initial_checkpoint_dir)
    return model, info


# ------------------------------------------------------------------------------------ optimizer
def build_optimizer(spec: OptimizerArg, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``"AdamW"`` (a torch.optim class name or dotted path, torch defaults) or a callable from the CLI."""
    if callable(spec):
        return spec(params)
    return optimizer_class(spec)(params)


def optimizer_class(name: str) -> type:
    if "." in name:
        module_name, _, class_name = name.rpartition(".")
        module = __import__(module_name, fromlist=[class_name])
        cls = getattr(module, class_name, None)
    else:
        cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        choices = sorted(n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                         and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer")
        raise ValueError(f"--optimizer {name!r} is not a torch.optim optimizer; choose one of {', '.join(choices)}")
    return cls


def optimizer_spec(spec: OptimizerArg) -> dict:
    """A YAML-able description (class_path + init_args) that ``--optimizer`` accepts back."""
    probe = build_optimizer(spec, [torch.nn.Parameter(torch.zeros(1))])
    cls = type(probe)
    accepted = inspect.signature(cls.__init__).parameters
    init_args = {k: to_yaml(v) for k, v in probe.defaults.items() if k in accepted and k != "params"}
    return {"class_path": f"{cls.__module__}.{cls.__name__}", "init_args": init_args}


# --------------------------------------------------------------------------------- hyperparams
def to_yaml(value: Any) -> Any:
    """Plain YAML types for dataclasses, paths, tuples and tensors."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_yaml(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [to_yaml(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_yaml(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def data_spec(data: Any) -> Optional[dict]:
    if data is None:
        return None
    return {"class_path": f"{type(data).__module__}.{type(data).__name__}", "init_args": to_yaml(data)}
