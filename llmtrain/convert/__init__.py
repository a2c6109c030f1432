"""Conversion between llmtrain model directories and Hugging Face transformers folders.

`to_hf` and `from_hf` convert whole folders; `ensure_model_dir` lets any command take either kind;
`adapters` holds what each transformers architecture calls every weight and config field.
"""

from llmtrain.convert.adapters import ADAPTERS, Adapter, adapter_for_config, state_dict_from_hf
from llmtrain.convert.hf import convert_from_hf, convert_to_hf, ensure_model_dir, from_hf, read_hf_config, to_hf

__all__ = [
    "ADAPTERS", "Adapter", "adapter_for_config", "convert_from_hf", "convert_to_hf", "ensure_model_dir", "from_hf",
    "read_hf_config", "state_dict_from_hf", "to_hf",
]
