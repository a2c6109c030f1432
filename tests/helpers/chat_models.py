"""A tiny model directory that talks: a byte-level tokenizer trained on a few llama sentences and random weights far
from uniform, so that different prompts get different greedy replies (`llmtrain chat`'s and the Python API's tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from llmtrain.checkpoint.files import write_model_dir
from llmtrain.model import GPT

from conftest import tiny_config

TEXTS = ["Llamas eat grass and hay. " * 4, "What food do llamas eat? They eat leaves.", "Alpacas hum. " * 3]


def write_chat_model(directory: Path, tiny_tokenizer: Callable, block_size: int = 256) -> Path:
    """The model directory ``directory`` (written; returned), with conftest's ``tiny_tokenizer`` fixture's tokenizer."""
    tokenizer = tiny_tokenizer(TEXTS, vocab_size=300)
    config = tiny_config("llama-debug", n_layer=2, block_size=block_size, vocab_size=tokenizer.vocab_size)
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    return write_model_dir(directory, state_dict=model.state_dict(), model_config=config, hyperparameters=None,
                           tokenizer=tokenizer)
