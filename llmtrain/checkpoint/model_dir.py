"""Opening a model directory: check what it holds, then build the model, tokenizer and prompt style from it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from llmtrain.checkpoint import layout
from llmtrain.checkpoint.weights import load_weights
from llmtrain.config import Config
from llmtrain.model import GPT
from llmtrain.prompts import PromptStyle, has_prompt_style, load_prompt_style
from llmtrain.quantize import QuantizeMode, quantize_model
from llmtrain.tokenizer import Tokenizer


def check_model_dir(checkpoint_dir: Path, flag: str = "CHECKPOINT_DIR") -> Path:
    """A model directory has the architecture, the weights and a tokenizer; say which is missing.

    ``flag`` is how the user passed the directory, for the message.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"{flag} {checkpoint_dir} does not exist or is not a directory; pass a model "
                                "directory such as out/pretrain/final")
    for name in (layout.CONFIG_FILE, layout.MODEL_FILE, layout.TOKENIZER_FILE):
        if not (checkpoint_dir / name).is_file():
            hint = " (a LoRA step checkpoint holds only adapters: merge it first with `llmtrain merge_lora`)" if (
                name == layout.MODEL_FILE and (checkpoint_dir / layout.LORA_FILE).is_file()) else ""
            raise FileNotFoundError(
                f"{flag} {checkpoint_dir} is not a model directory: {checkpoint_dir / name} does not exist (a model "
                f"directory needs {layout.CONFIG_FILE}, {layout.MODEL_FILE} and {layout.TOKENIZER_FILE}){hint}")
    return checkpoint_dir


def load_model_dir(checkpoint_dir: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   quantize: Optional[QuantizeMode] = None) -> tuple[GPT, Config, Tokenizer, PromptStyle]:
    """Model (eval mode, frozen), config, tokenizer and prompt style of a model directory.

    The prompt style is the directory's prompt_style.yaml (written by fine-tuning), else the one
    the model's family uses. With `quantize`, the weights are loaded on the CPU and quantized onto
    `device`, so the device only ever holds the quantized model; `dtype` is then the compute dtype.
    """
    checkpoint_dir = check_model_dir(checkpoint_dir)
    config = Config.from_file(checkpoint_dir / layout.CONFIG_FILE)
    tokenizer = Tokenizer(checkpoint_dir)
    prompt_style = (load_prompt_style(checkpoint_dir) if has_prompt_style(checkpoint_dir)
                    else PromptStyle.from_config(config))
    model = build_model_from_dir(checkpoint_dir, config, device="cpu" if quantize else device, dtype=dtype)
    if quantize is not None:
        quantize_model(model, quantize, compute_dtype=dtype, device=torch.device(device))
    model.eval().requires_grad_(False)
    return model, config, tokenizer, prompt_style


def build_model_from_dir(checkpoint_dir: Path, config: Config, device: torch.device | str = "cpu",
                         dtype: Optional[torch.dtype] = None) -> GPT:
    """A plain GPT on ``device`` holding the directory's weights, allocated straight in ``dtype``."""
    with torch.device("meta"):
        model = GPT(config)
        if dtype is not None:  # a bf16 model never exists in fp32
            model = model.to(dtype)
    model.to_empty(device=device)
    load_weights(model, checkpoint_dir)
    model.reset_rope_cache()  # to_empty left the non-persistent RoPE tables uninitialised
    return model
