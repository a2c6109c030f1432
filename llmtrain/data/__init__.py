"""Data modules for pretraining, and the registry that `--data NAME` picks from.

Every module is a dataclass subclass of `DataModule`; its fields are the `--data.*` flags.
"""

from llmtrain.data.base import IGNORE_INDEX, DataModule, PretrainDataModule, TrainLoader, ValLoader
from llmtrain.data.builtin_instruct import BuiltinInstruct
from llmtrain.data.hf_dataset import HFDataset
from llmtrain.data.instruct import JSON, InstructDataModule
from llmtrain.data.instruct_hub import LIMA, Alpaca, Alpaca2k, Dolly
from llmtrain.data.mixture import Mixture, MixtureSource
from llmtrain.data.prepared import Prepared
from llmtrain.data.stdlib import PythonStdlib
from llmtrain.data.stories import BuiltinStories
from llmtrain.data.text_files import TextFiles
from llmtrain.data.tokens import cache_dir

REGISTRY: dict[str, type[DataModule]] = {
    module.__name__: module for module in (BuiltinStories, PythonStdlib, TextFiles, HFDataset, Prepared, Mixture,
                                           BuiltinInstruct, JSON, Alpaca, Alpaca2k, Dolly, LIMA)
}
"""Every data module by the name users pass to --data."""

__all__ = [
    "JSON", "LIMA", "Alpaca", "Alpaca2k", "BuiltinInstruct", "Dolly", "InstructDataModule",
    "IGNORE_INDEX", "REGISTRY", "BuiltinStories", "DataModule", "HFDataset", "Mixture", "MixtureSource", "Prepared",
    "PretrainDataModule", "PythonStdlib",
    "TextFiles", "TrainLoader", "ValLoader", "cache_dir",
]
