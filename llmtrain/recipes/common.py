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

from llmtrain.checkpoint import layout
from llmtrain.checkpoint.resume import resolve_resume  # noqa: F401 (recipes call common.resolve_resume)
from llmtrain.checkpoint.size import check_disk_space  # noqa: F401 (recipes call common.check_disk_space)
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


def check_logger(logger_name: str) -> None:
    """A logger whose package is missing fails now, not after the model is built."""
    import importlib.util

    package = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(logger_name)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(f"--logger_name {logger_name} needs the {package} package: pip install {package}, "
                         "or use --logger_name csv")


def check_seq_len(train: Any, config: Config) -> int:
    """The sample length: --train.max_seq_length, else the model's block size, never beyond it."""
    seq_len = train.max_seq_length or config.block_size
    if seq_len > config.block_size:
        raise ValueError(f"--train.max_seq_length {seq_len} exceeds the block_size {config.block_size} of "
                         f"{config.name or 'the model'}; lower it to at most {config.block_size}")
    return seq_len


def arguments_of(function: Callable, local_vars: dict) -> dict:
    """The values of ``function``'s parameters among ``local_vars`` (a recipe's ``locals()``)."""
    return {name: local_vars[name] for name in inspect.signature(function).parameters if name in local_vars}


def launch_run(run: Callable, spec: Any, *, devices: int, num_nodes: int) -> None:
    """Check the parallel settings against the process count, then start ``run(spec)`` on every rank."""
    from llmtrain.distributed.launch import launch
    from llmtrain.distributed.parallelize import resolve_sharding_strategy

    resolve_sharding_strategy(spec.strategy, spec.fsdp, devices * num_nodes, num_nodes)  # contradictions fail here
    launch(run, args=(spec,), devices=devices, num_nodes=num_nodes)


# ------------------------------------------------------------------------------------ tokenizer
def resolve_tokenizer(tokenizer_dir: Optional[Path], data: Any, *fallback_dirs: Optional[Path]):
    """``--tokenizer_dir``, else a model directory's tokenizer, else the data module's own, else an error."""
    from llmtrain.tokenizer import Tokenizer

    if tokenizer_dir is not None:
        return Tokenizer(tokenizer_dir)
    for directory in fallback_dirs:
        if directory is not None and (Path(directory) / layout.TOKENIZER_FILE).is_file():
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
            "(a --model_config file with that vocab_size instead of a zoo name) or pass the model's own tokenizer "
            "with --tokenizer_dir")


# ---------------------------------------------------------------------------------------- model
def build_model(config: Config, *, runtime: Any, seed: int, precision: Any, strategy: str = "auto",
                fsdp: Any = None, num_nodes: int = 1, compile: bool = False,
                initial_checkpoint_dir: Optional[Path] = None, lora: Any = None,
                quantize: Optional[str] = None) -> tuple[torch.nn.Module, Any]:
    """Build on the meta device, parallelize, then materialise only this rank's shard.

    A 70B model never exists whole on one rank: weights are allocated after sharding and initialised
    (or loaded from ``initial_checkpoint_dir``) shard by shard. The same seed gives the same weights
    at any world size. With ``lora``, adapters are added before sharding and only they train.
    """
    from llmtrain.checkpoint.weights import load_weights
    from llmtrain.distributed.parallelize import materialize, parallelize
    from llmtrain.model import GPT

    if quantize is not None:
        return _build_quantized(config, runtime=runtime, seed=seed, precision=precision,
                                initial_checkpoint_dir=initial_checkpoint_dir, lora=lora, quantize=quantize,
                                fsdp=fsdp, compile=compile)
    with torch.device("meta"):
        model = GPT(config).to(precision.param_dtype)
    after_init = None
    if lora is not None:
        from llmtrain.lora import apply_lora, mark_only_lora_trainable, reset_lora_parameters

        apply_lora(model, lora)
        mark_only_lora_trainable(model)
        after_init = reset_lora_parameters
    model, info = parallelize(model, runtime=runtime, strategy=strategy, fsdp=fsdp, precision=precision,
                              num_nodes=num_nodes, compile=compile)
    materialize(model, runtime.device, seed, cpu_offload=info.cpu_offload, after_init=after_init)
    if initial_checkpoint_dir is not None:
        load_weights(model, initial_checkpoint_dir)
    return model, info


def _build_quantized(config: Config, *, runtime: Any, seed: int, precision: Any,
                     initial_checkpoint_dir: Optional[Path], lora: Any, quantize: str, fsdp: Any,
                     compile: bool) -> tuple[torch.nn.Module, Any]:
    """QLoRA on one device: real weights first (quantizing needs them), then 4-bit/int8 layers, then adapters."""
    from llmtrain.checkpoint.weights import load_weights
    from llmtrain.distributed.parallelize import materialize, parallelize
    from llmtrain.lora import apply_lora, mark_only_lora_trainable, reset_lora_parameters
    from llmtrain.model import GPT
    from llmtrain.quantize import quantize_model

    with torch.device("meta"):
        model = GPT(config)
    materialize(model, torch.device("cpu"), seed)
    if initial_checkpoint_dir is not None:
        load_weights(model, initial_checkpoint_dir)
    quantize_model(model, quantize, compute_dtype=precision.compute_dtype, device=runtime.device)
    if lora is not None:
        apply_lora(model, lora)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            reset_lora_parameters(model)
        mark_only_lora_trainable(model)
    return parallelize(model, runtime=runtime, strategy="auto", fsdp=fsdp, precision=precision, num_nodes=1,
                       compile=compile)


# ------------------------------------------------------------------------------------ optimizer
def build_optimizer(spec: OptimizerArg, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``"AdamW"`` (a torch.optim class name or dotted path, torch defaults) or a callable from the CLI.

    Adam and AdamW run their fused kernels unless ``--optimizer.foreach`` or ``--optimizer.fused`` says
    otherwise: one kernel over all parameters instead of a loop over them (3x faster steps on CPU, see
    BENCHMARKS.md), with the same arithmetic.
    """
    params = list(params)
    optimizer = spec(params) if callable(spec) else optimizer_class(spec)(params)
    defaults = optimizer.defaults
    if (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and defaults.get("fused") is None
            and defaults.get("foreach") is None and _fused_capable(params)):
        accepted = inspect.signature(type(optimizer).__init__).parameters
        settings = {key: value for key, value in defaults.items() if key in accepted}
        optimizer = type(optimizer)(params, **{**settings, "fused": True, "foreach": None})
    return optimizer


def _fused_capable(params: list[torch.nn.Parameter]) -> bool:
    return bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16,
                                                                               torch.float16) for p in params)


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


def hyperparameters(arguments: dict) -> dict:
    """A recipe's arguments as YAML that ``--config`` accepts back (call with the recipe's ``locals()`` first thing)."""
    out = {}
    for name, value in arguments.items():
        if name == "optimizer":
            out[name] = optimizer_spec(value)
        elif name == "data":
            out[name] = data_spec(value)
        else:
            out[name] = to_yaml(value)
    return out


def data_spec(data: Any) -> Optional[dict]:
    if data is None:
        return None
    return {"class_path": f"{type(data).__module__}.{type(data).__name__}", "init_args": to_yaml(data)}
