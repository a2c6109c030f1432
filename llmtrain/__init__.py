"""llmtrain: pretrain and fine-tune GPT-style language models."""

__version__ = "0.1.0"
