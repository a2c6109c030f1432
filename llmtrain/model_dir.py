"""Model directories: check what one holds, build the model, tokenizer and prompt style from it, and merge a LoRA
checkpoint's adapters into the base model directory it names (``llmtrain merge_lora``, ``convert to_hf``).

A model directory is a checkpoint (:mod:`llmtrain.checkpoint` writes and checks its files) with a tokenizer and a
prompt style beside the weights: opening one needs those two modules, which read the checkpoint's layout
themselves, so it sits above both.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Optional

import torch

from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.lora import merged_state_dict, read_lora_settings
from llmtrain.checkpoint.weights import check_weights_match, load_weights, tied_twins
from llmtrain.config import Config
from llmtrain.flops import num_parameters
from llmtrain.lora import apply_lora, is_lora_parameter, load_lora_state_dict
from llmtrain.memory import check_model_fits
from llmtrain.model import GPT
from llmtrain.prompts import PromptStyle, checkpoint_prompt_style
from llmtrain.quantize import QuantizeMode, quantized_bytes_per_weight
from llmtrain.tokenizer import Tokenizer


def check_model_dir(checkpoint_dir: Path, flag: str = "CHECKPOINT_DIR", adapters: bool = True) -> Path:
    """A model directory has the architecture, the weights and a tokenizer; say which is missing.

    ``flag`` is how the user passed the directory, for the message. ``adapters``: a finetune_lora step checkpoint
    (adapters and their settings in place of the weights) counts as a model directory; :func:`load_model_dir` merges
    its adapters into their base in memory.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.exists():
        raise FileNotFoundError(missing_path_message(checkpoint_dir, flag))
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"{flag} {checkpoint_dir} is a file, not a directory; pass a model directory such as "
                                "out/pretrain/final")
    for name in (layout.CONFIG_FILE, layout.MODEL_FILE, layout.TOKENIZER_FILE):
        if name == layout.MODEL_FILE and adapters and is_lora_checkpoint(checkpoint_dir):
            continue
        if not (checkpoint_dir / name).is_file():
            hint = " (a LoRA step checkpoint holds only adapters: merge it first with `llmtrain merge_lora`)" if (
                name == layout.MODEL_FILE and (checkpoint_dir / layout.LORA_FILE).is_file()) else ""
            raise FileNotFoundError(
                f"{flag} {checkpoint_dir} is not a model directory: {checkpoint_dir / name} does not exist (a model "
                f"directory needs {layout.CONFIG_FILE}, {layout.MODEL_FILE} and {layout.TOKENIZER_FILE}){hint}")
    return checkpoint_dir


def is_lora_checkpoint(checkpoint_dir: Path) -> bool:
    """A finetune_lora step checkpoint: adapters (lora.safetensors) and their settings, no merged weights."""
    checkpoint_dir = Path(checkpoint_dir)
    return not (checkpoint_dir / layout.MODEL_FILE).is_file() and all(
        (checkpoint_dir / name).is_file() for name in (layout.LORA_FILE, layout.LORA_SETTINGS_FILE))


def missing_path_message(path: Path, flag: str = "CHECKPOINT_DIR") -> str:
    """Why ``path`` (a model the user named) cannot be opened: it does not exist, where that was looked for, and
    ``llmtrain download ORG/NAME`` when it reads like a Hub repository (ORG/NAME, or checkpoints/ORG/NAME)."""
    path = Path(path)
    where = "" if path.is_absolute() else f" (relative to the current directory {Path.cwd()}: {path.resolve()})"
    message = f"{flag} {path} does not exist{where}; pass a model directory such as out/pretrain/final"
    parts = path.parts
    hub_like = not path.is_absolute() and len(parts) >= 2 and all(_HUB_NAME.fullmatch(p) for p in parts[-2:])
    repo_id = "/".join(parts[-2:]) if hub_like and (len(parts) == 2 or parts[-3] == "checkpoints") else None
    if len(parts) == 1 and _HUB_NAME.fullmatch(parts[0]):  # a zoo model's name, e.g. Llama-3.2-1B
        try:
            hf = Config.from_name(parts[0]).hf_config
        except ValueError:
            hf = {}
        repo_id = f"{hf['org']}/{hf['name']}" if hf.get("org") and hf.get("name") else None
    if repo_id is not None:
        message += (f", or a transformers folder; to fetch {repo_id} from the Hugging Face Hub: `llmtrain download "
                    f"{repo_id}` (into checkpoints/{repo_id})")
    return message


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.\-]*")
"""One half of a Hub repository id (ORG or NAME)."""


def load_model_dir(checkpoint_dir: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   quantize: Optional[QuantizeMode] = None) -> tuple[GPT, Config, Tokenizer, PromptStyle]:
    """Model (eval mode, frozen), config, tokenizer and prompt style (`read_model_dir`) of a model directory.

    With `quantize`, the weights are quantized onto `device` a block at a
    time (:func:`build_quantized_model_from_dir`); `dtype` is then the compute dtype. A finetune_lora step
    checkpoint's adapters are merged into their base model in memory first (:func:`merged_lora_weights`).
    """
    config, tokenizer, prompt_style = read_model_dir(checkpoint_dir)
    if is_lora_checkpoint(checkpoint_dir):
        model = _merged_model(checkpoint_dir, config, device, dtype, quantize)
    elif quantize is not None:
        model = build_quantized_model_from_dir(checkpoint_dir, config, quantize, compute_dtype=dtype, device=device)
    else:
        model = build_model_from_dir(checkpoint_dir, config, device=device, dtype=dtype)
    model.eval().requires_grad_(False)
    return model, config, tokenizer, prompt_style


def read_model_dir(checkpoint_dir: Path) -> tuple[Config, Tokenizer, PromptStyle]:
    """Config, tokenizer and prompt style of a model directory: all but the weights, in a moment.

    The prompt style is `checkpoint_prompt_style`'s: prompt_style.yaml, else the directory's chat template, else
    the one the model's family uses.
    """
    checkpoint_dir = check_model_dir(checkpoint_dir)
    config = Config.from_file(checkpoint_dir / layout.CONFIG_FILE)
    tokenizer = Tokenizer(checkpoint_dir)
    prompt_style = checkpoint_prompt_style(checkpoint_dir, config)
    return config, tokenizer, prompt_style


def build_model_from_dir(checkpoint_dir: Path, config: Config, device: torch.device | str = "cpu",
                         dtype: Optional[torch.dtype] = None, config_file: Optional[Path] = None) -> GPT:
    """A plain GPT on ``device`` holding the directory's weights, allocated straight in ``dtype``.

    ``config_file``: where ``config`` was read, for the message when it is too large (default: the directory's).
    """
    check_model_fits(config, weight_bytes=num_parameters(config) * (dtype or torch.float32).itemsize, device=device,
                     source=config_file or Path(checkpoint_dir) / layout.CONFIG_FILE)
    with torch.device("meta"):
        model = GPT(config)
        if dtype is not None:  # a bf16 model never exists in fp32
            model = model.to(dtype)
    model.to_empty(device=device)
    load_weights(model, checkpoint_dir)
    model.reset_rope_cache()  # to_empty left the non-persistent RoPE tables uninitialised
    return model


def _merged_model(checkpoint_dir: Path, config: Config, device: torch.device | str, dtype: torch.dtype,
                  quantize: Optional[QuantizeMode]) -> GPT:
    """A plain GPT holding a LoRA step checkpoint's merged weights on ``device`` in ``dtype`` (quantized with
    ``quantize``)."""
    weights = merged_lora_weights(checkpoint_dir)
    check_model_fits(config, weight_bytes=num_parameters(config) * dtype.itemsize, device=device,
                     source=Path(checkpoint_dir) / layout.CONFIG_FILE)
    with torch.device("meta"):
        model = GPT(config).to(dtype)
    model.to_empty(device="cpu" if quantize else device)
    model.load_state_dict(weights)
    model.reset_rope_cache()
    if quantize is not None:
        from llmtrain.quantize import quantize_model  # NOTE: imports bitsandbytes, which only --quantize needs

        quantize_model(model, quantize, compute_dtype=dtype, device=device)
    return model


def build_quantized_model_from_dir(checkpoint_dir: Path, config: Config, mode: QuantizeMode,
                                   compute_dtype: torch.dtype, device: torch.device | str = "cpu",
                                   config_file: Optional[Path] = None) -> GPT:
    """A GPT holding the directory's weights with the linear layers of its blocks quantized (QLoRA's frozen base).

    Streamed: each block's weights are read from the file in ``compute_dtype``, quantized onto ``device`` and
    dropped before the next block is read, and the embedding, final norm and head go straight to ``device``.
    Neither the host nor the device ever holds the model in full precision, nothing is initialised only to be
    overwritten, and the quantization statistics are in ``compute_dtype``, the dtype the layers compute in.
    ``config_file`` as in :func:`build_model_from_dir`.
    """
    from safetensors import safe_open  # NOTE: lazy, as in every CLI path that may not load weights

    from llmtrain.quantize import quantize_block

    path = Path(checkpoint_dir) / layout.MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a model directory needs {layout.MODEL_FILE}")
    device = torch.device(device)
    # A lower bound: the embedding, norms and head stay in compute_dtype.
    check_model_fits(config, weight_bytes=num_parameters(config) * quantized_bytes_per_weight(mode), device=device,
                     source=config_file or path.with_name(layout.CONFIG_FILE))
    with torch.device("meta"):
        model = GPT(config)
    twins = tied_twins(model)
    # NOTE: pread, not mmap: the pages of a mapped file count in this process's resident memory until
    # the whole file is unmapped, which would be once every weight had been read.
    with safe_open(str(path), framework="pt", device="cpu", backend="pread") as file:
        check_weights_match({name: torch.empty(file.get_slice(name).get_shape(), device="meta")
                             for name in file.keys()}, model, path)

        def assign(module: torch.nn.Module, prefix: str, to: torch.device) -> None:
            state = {}
            for name in module.state_dict():
                if prefix + name in twins:  # tied: the parameter its twin, loaded earlier, already is
                    state[name] = model.get_parameter(twins[prefix + name])
                    continue
                stored = file.get_tensor(prefix + name)
                state[name] = stored.to(to, compute_dtype if stored.is_floating_point() else None)
            module.load_state_dict(state, assign=True)

        for name, child in model.named_children():
            if name != "blocks":
                assign(child, f"{name}.", device)
                continue
            for index, block in enumerate(child):
                assign(block, f"blocks.{index}.", torch.device("cpu"))
                quantize_block(block, mode, compute_dtype, device)
    # The RoPE tables are not in the file: recompute them on the device.
    model.rope_cos, model.rope_sin = (torch.empty(0, device=device) for _ in range(2))
    model.reset_rope_cache()
    return model


def merged_lora_weights(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's adapters merged into the base model that ``lora.yaml`` names, on the CPU.

    Adapters were trained against the base in their own dtype (``--precision bf16-true``: bf16; QLoRA: the quantized
    base, dequantized to the compute dtype): they are merged into exactly that, as ``final/`` of their run was.
    """
    from safetensors.torch import load_file  # NOTE: lazy, as everywhere a CLI path may not need it

    checkpoint_dir = Path(checkpoint_dir)
    lora, base_dir, quantize = read_lora_settings(checkpoint_dir)
    base_dir = check_model_dir(base_dir, flag=f"the base model of {checkpoint_dir / layout.LORA_SETTINGS_FILE}",
                               adapters=False)
    config = Config.from_file(checkpoint_dir / layout.CONFIG_FILE)
    adapters = load_file(str(checkpoint_dir / layout.LORA_FILE))
    if quantize:
        # NOTE: QLoRA checkpoints written before 2026-11-26's fix also hold bitsandbytes' quantization state
        # (absmax, quant_map, ...): the adapters are what merges.
        adapters = {name: tensor for name, tensor in adapters.items() if is_lora_parameter(name)}
    dtype = next(iter(adapters.values())).dtype  # the dtype the run held its weights in (bf16-true: bf16)
    config_file = checkpoint_dir / layout.CONFIG_FILE
    if quantize:
        model = build_quantized_model_from_dir(base_dir, config, quantize, compute_dtype=dtype, config_file=config_file)
    else:
        model = build_model_from_dir(base_dir, config, dtype=dtype, config_file=config_file)
    apply_lora(model, lora)
    try:
        load_lora_state_dict(model, adapters)
    except (KeyError, ValueError) as error:
        raise ValueError(f"{checkpoint_dir / layout.LORA_FILE} does not hold the adapters that "
                         f"{checkpoint_dir / layout.LORA_SETTINGS_FILE} describes: {error}") from error
    return merged_state_dict(model)


def merge_lora_checkpoint(checkpoint_dir: Path, out_dir: Optional[Path] = None) -> Path:
    """Write the merged model of a LoRA checkpoint as a full model directory (default: ``CHECKPOINT_DIR-merged``)."""
    checkpoint_dir = Path(checkpoint_dir)
    out_dir = Path(out_dir) if out_dir is not None else checkpoint_dir.with_name(checkpoint_dir.name + "-merged")
    files.check_output_dir(out_dir)
    weights = merged_lora_weights(checkpoint_dir)

    def extras(directory: Path) -> None:
        if (checkpoint_dir / layout.PROMPT_STYLE_FILE).is_file():
            shutil.copy2(checkpoint_dir / layout.PROMPT_STYLE_FILE, directory / layout.PROMPT_STYLE_FILE)

    config = Config.from_file(checkpoint_dir / layout.CONFIG_FILE)
    return files.write_model_dir(out_dir, state_dict=weights, model_config=config,
                                 hyperparameters=files.read_hyperparameters(checkpoint_dir) or None,
                                 tokenizer=Tokenizer(checkpoint_dir), marker={"kind": "model", "lora_merged": True},
                                 write_extras=extras)
