"""Data modules connected as each rank of a data-parallel group connects them, and their samples in global order."""

from __future__ import annotations

import torch

from llmtrain.data.base import TrainLoader
from llmtrain.tokenizer import Tokenizer


def connected(module, tokenizer: Tokenizer, dp_rank: int = 0, dp_size: int = 1, micro_batch_size: int = 2,
              seq_len: int = 16, seed: int = 7):
    module.validate()
    module.connect(tokenizer, micro_batch_size, seq_len, seed)
    module.setup(dp_rank, dp_size)
    return module


def loaders(make_module, tokenizer: Tokenizer, dp_size: int, **kwargs) -> list[TrainLoader]:
    return [connected(make_module(), tokenizer, rank, dp_size, **kwargs).train_dataloader() for rank in range(dp_size)]


def global_samples(ranks: list[TrainLoader], micro_steps: int) -> list[torch.Tensor]:
    """The samples of ``micro_steps`` micro-steps in global order: rank 0's micro-batch, then rank 1's, ..."""
    rows = []
    for _ in range(micro_steps):
        for batch in [next(loader) for loader in ranks]:
            rows.extend(batch["input_ids"])
    return rows


def same_rows(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))
