"""Builders a rank runs: the tokenizer, and the model on the meta device, parallelized, then materialised."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

import torch

from llmtrain.config import Config
from llmtrain.distributed.parallel_plan import ParallelPlan
from llmtrain.distributed.parallelize import materialize, parallelize
from llmtrain.distributed.pipeline import build_pipeline_model
from llmtrain.distributed.runtime import Runtime
from llmtrain.lora import LoRAArgs, apply_lora, mark_only_lora_trainable, reset_lora_parameters
from llmtrain.model import GPT
from llmtrain.model_dir import build_quantized_model_from_dir
from llmtrain.checkpoint.weights import load_weights
from llmtrain.tokenizer import Tokenizer, sentencepiece_only_message


def resolve_tokenizer(tokenizer_dir: Optional[Path], data: Any, *fallback_dirs: Optional[Path]):
    """``--tokenizer_dir``, else a model directory's tokenizer, else the data module's own, else an error."""
    if tokenizer_dir is not None:
        return Tokenizer(tokenizer_dir)
    for directory in fallback_dirs:
        if directory is not None and (Path(directory) / "tokenizer.json").is_file():
            return Tokenizer(directory)
        # NOTE: the model's own tokenizer, unreadable, must not give way to the data module's: the weights
        # would train on another vocabulary's ids.
        sentencepiece_only = sentencepiece_only_message(directory) if directory is not None else None
        if sentencepiece_only:
            raise ValueError(sentencepiece_only)
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


def build_model(config: Config, *, plan: ParallelPlan, runtime: Runtime, seed: int, compile: bool = False,
                initial_checkpoint_dir: Optional[Path] = None, lora: Optional[LoRAArgs] = None,
                quantize: Optional[str] = None,
                allocating: Callable[[], ContextManager] = contextlib.nullcontext) -> torch.nn.Module:
    """Build on the meta device, parallelize, then materialise only this rank's shard.

    A 70B model never exists whole on one rank: weights are allocated after sharding and initialised
    (or loaded from ``initial_checkpoint_dir``) shard by shard. The same seed gives the same weights
    at any world size. With ``lora``, adapters are added before sharding and only they train.
    ``allocating``: the context the weights are allocated in (``--dry_run.simulate``'s fake tensors, which must not
    see the meta model built before: torch cannot convert a fake meta parameter's dtype in place).
    Under ZeRO stage 3 the DeepSpeed engine builds the model partitioned instead (llmtrain.recipes.engine).
    """
    if quantize is not None:
        return _build_quantized(config, plan=plan, runtime=runtime, seed=seed,
                                initial_checkpoint_dir=initial_checkpoint_dir, lora=lora, quantize=quantize,
                                compile=compile)
    if plan.pp > 1:  # this rank's pipeline stages (LoRA and QLoRA refuse pipeline parallelism before launch)
        model = build_pipeline_model(config, plan=plan, runtime=runtime, seed=seed, compile=compile,
                                     allocating=allocating)
        if initial_checkpoint_dir is not None:
            load_weights(model, initial_checkpoint_dir)
        return model
    with torch.device("meta"):
        model = GPT(config).to(plan.precision.param_dtype)
    after_init = None
    if lora is not None:
        apply_lora(model, lora)
        mark_only_lora_trainable(model)
        after_init = reset_lora_parameters
    model = parallelize(model, plan, device=runtime.device, compile=compile, mesh=runtime.mesh)
    with allocating():
        materialize(model, runtime.device, seed, cpu_offload=plan.cpu_offload, after_init=after_init)
    if initial_checkpoint_dir is not None:
        load_weights(model, initial_checkpoint_dir)
    return model


def _build_quantized(config: Config, *, plan: ParallelPlan, runtime: Runtime, seed: int,
                     initial_checkpoint_dir: Optional[Path], lora: Optional[LoRAArgs], quantize: str,
                     compile: bool) -> torch.nn.Module:
    """QLoRA on one device: real weights first (quantizing needs them), then 4-bit/int8 layers, then adapters.

    The weights of a checkpoint are quantized a block at a time as they are read, in the compute dtype
    (:func:`~llmtrain.model_dir.build_quantized_model_from_dir`); only a model without one is
    initialised, and then in the compute dtype too.
    """
    from llmtrain.quantize import quantize_model  # NOTE: imports bitsandbytes, which only QLoRA needs

    dtype = plan.precision.compute_dtype
    if initial_checkpoint_dir is not None:
        model = build_quantized_model_from_dir(initial_checkpoint_dir, config, quantize, compute_dtype=dtype,
                                               device=runtime.device)
    else:
        with torch.device("meta"):
            model = GPT(config).to(dtype)
        materialize(model, torch.device("cpu"), seed)
        quantize_model(model, quantize, compute_dtype=dtype, device=runtime.device)
    if lora is not None:
        apply_lora(model, lora)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            reset_lora_parameters(model)
        mark_only_lora_trainable(model)
    return parallelize(model, plan, device=runtime.device, compile=compile, mesh=runtime.mesh)
