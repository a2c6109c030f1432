"""llmtrain: pretrain and fine-tune GPT-style language models.

From Python: ``from llmtrain import LLM`` (``LLM.load(...)``, ``.generate``, ``.chat``) and the recipes
``llmtrain.pretrain(...)``, ``finetune_lora``, ``finetune_full``, ``merge_lora``, ``convert_to_hf``,
``convert_from_hf`` and ``prepare_data`` with the command line's arguments (llmtrain.api). They are imported on first
use, so that ``import llmtrain`` (and the command line's start) stays as cheap as the standard library.
"""

__version__ = "0.1.0"

API = ("LLM", "pretrain", "finetune_lora", "finetune_full", "merge_lora", "convert_to_hf", "convert_from_hf",
       "prepare_data")
"""The names llmtrain.api gives the package."""

__all__ = ["__version__", *API]


def __getattr__(name: str):
    if name in API:
        from llmtrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'llmtrain' has no attribute {name!r}")


def __dir__() -> list:
    return sorted({*globals(), *API})
