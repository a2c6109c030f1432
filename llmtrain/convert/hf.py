"""Convert between llmtrain model directories and Hugging Face transformers folders.

    to_hf(checkpoint_dir, output_dir)    a llmtrain checkpoint (full, sharded or LoRA) -> a transformers folder
    from_hf(hf_dir, output_dir)          a transformers folder -> a llmtrain model directory
    ensure_model_dir(path)               either kind of folder -> a llmtrain model directory (converted once, cached)

A transformers folder holds config.json, generation_config.json, the tokenizer files and the weights
(`model.safetensors`, or `model-0000N-of-0000M.safetensors` shards listed in
`model.safetensors.index.json`; reading also takes `pytorch_model.bin` files). Both directions read
one tensor at a time, so a conversion needs about the model's size in memory (to_hf: one shard).
Outputs are written under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Literal, Optional, Union

from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.resume import checkpoint_format
from llmtrain.checkpoint.size import check_weights_hold
from llmtrain.config import Config
from llmtrain.convert.adapters import (
    EXPERT_BIAS,
    IGNORED_HF_TENSORS,
    Adapter,
    adapter_for_config,
    config_from_hf,
    named_config,
    zoo_config,
)
from llmtrain.model_dir import merged_lora_weights, missing_path_message

if TYPE_CHECKING:
    import torch

DTypeName = Literal["float32", "bfloat16", "float16"]
HF_CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = layout.GENERATION_CONFIG_FILE
SAFETENSORS_FILE = layout.MODEL_FILE  # transformers' single weights file has the name llmtrain's has
SAFETENSORS_INDEX = "model.safetensors.index.json"
HF_WEIGHT_LAYOUTS = ((SAFETENSORS_INDEX, SAFETENSORS_FILE), ("pytorch_model.bin.index.json", "pytorch_model.bin"))
"""(index, single file) of each weights layout transformers writes, the preferred first."""
EXTRA_FILES = (GENERATION_CONFIG_FILE, layout.CHAT_TEMPLATE_FILE, layout.SENTENCEPIECE_FILE)
"""Files copied unchanged in both directions, besides the tokenizer files that `Tokenizer.save` copies."""


# ------------------------------------------------------------------------------------ transformers -> llmtrain
def from_hf(hf_dir: Path, output_dir: Path, model_name: Optional[str] = None,
            dtype: Optional[DTypeName] = None) -> Path:
    """Write the transformers model in `hf_dir` as a llmtrain model directory `output_dir`.

    The architecture comes from config.json, exactly; when a zoo entry has the same architecture
    its name is used (`model_name` picks one explicitly and must agree with config.json).
    `dtype` casts floating-point weights; None keeps the stored precision.
    """
    hf_dir, output_dir = Path(hf_dir), Path(output_dir)
    files.check_output_dir(output_dir)
    adapter, config = read_hf_config(hf_dir)
    if model_name is not None:
        config = named_config(config, model_name, hf_dir / HF_CONFIG_FILE)
    else:
        config = _zoo_or_own(config, hf_dir)
    check_weights_hold(config, hf_dir / HF_CONFIG_FILE, hf_weight_files(hf_dir))
    weights = _read_hf_weights(hf_dir, adapter, config, _torch_dtype(dtype))
    tokenizer = _tokenizer_or_none(hf_dir)

    def extras(directory: Path) -> None:
        _copy_files(hf_dir, directory, EXTRA_FILES)

    return files.write_model_dir(output_dir, state_dict=weights, model_config=config, hyperparameters=None,
                                  tokenizer=tokenizer, write_extras=extras,
                                  marker={"kind": "model", "converted_from": str(hf_dir.resolve())})


def read_hf_config(hf_dir: Path) -> tuple[Adapter, Config]:
    """The adapter and the exact llmtrain Config of the transformers folder `hf_dir`."""
    hf_dir = Path(hf_dir)
    path = hf_dir / HF_CONFIG_FILE
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"{hf_dir} does not exist")
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {hf_dir} is not a transformers model folder "
                                "(its config.json describes the architecture)")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    return config_from_hf(values, path)


def hf_folder_config(path: Path) -> Optional[Config]:
    """The Config that converting the transformers folder `path` would record (a zoo entry when one has its
    architecture), read from its config.json alone; None when `path` is not a transformers folder (a llmtrain model
    directory, or no folder). What a dry run needs to know of a model, without converting its weights."""
    path = Path(path)
    if (path / layout.CONFIG_FILE).is_file() or not (path / HF_CONFIG_FILE).is_file():
        return None
    config = _zoo_or_own(read_hf_config(path)[1], path)
    hf_weight_files(path)  # the weights are there (a run would convert them)
    return config


def _zoo_or_own(config: Config, hf_dir: Path) -> Config:
    return zoo_config(config, hints=[config.hf_config.get("name", ""), hf_dir.name])


def _read_hf_weights(hf_dir: Path, adapter: Adapter, config: Config,
                     dtype: Optional["torch.dtype"]) -> Iterator[tuple[str, "torch.Tensor"]]:
    """llmtrain weights from the transformers files, one at a time, checked tensor by tensor against config.json.

    A generator: the conversion writes each weight as it comes, so the model never exists whole in memory.
    """
    expected = _hf_shapes(adapter, config, files.stored_shapes(config))
    tied_head = adapter.hf_name("lm_head.weight") if config.tie_embeddings else None
    found = set()

    def checked() -> Iterator[tuple[str, "torch.Tensor"]]:
        for file, hf_name, tensor in _iter_hf_tensors(hf_dir):
            if IGNORED_HF_TENSORS.search(hf_name):
                continue
            hf_name = adapter.canonical_hf_name(hf_name)
            if hf_name == tied_head:
                continue  # the embedding is the output layer; some files store it twice
            if hf_name not in expected:
                raise ValueError(f"{file}: tensor {hf_name!r} is not part of the {adapter.architecture} that "
                                 f"{hf_dir / HF_CONFIG_FILE} describes")
            if tuple(tensor.shape) != expected[hf_name]:
                raise ValueError(f"{file}: {hf_name!r} has shape {tuple(tensor.shape)}, but "
                                 f"{hf_dir / HF_CONFIG_FILE} implies {expected[hf_name]}")
            found.add(hf_name)
            yield hf_name, _cast(tensor, dtype)
        missing = [name for name in expected if name not in found]
        if missing:
            raise ValueError(f"{hf_dir}: the weights lack {len(missing)} tensors that {HF_CONFIG_FILE} implies, "
                             f"e.g. {missing[:3]}")

    # NOTE: the experts of a mixture wait until all of a weight's experts have come, and are then stacked.
    yield from adapter.weights_from_hf(config, checked())


def hf_weight_files(hf_dir: Path) -> list[Path]:
    """The weights files of a transformers folder: the shards its index lists, or the single file."""
    for index_name, single_name in HF_WEIGHT_LAYOUTS:
        index = hf_dir / index_name
        if index.is_file():
            files = [hf_dir / name for name in dict.fromkeys(json.loads(index.read_text())["weight_map"].values())]
            missing = [file.name for file in files if not file.is_file()]
            if missing:
                raise FileNotFoundError(f"{index} lists shards that do not exist: {missing}")
            return files
        if (hf_dir / single_name).is_file():
            return [hf_dir / single_name]
    raise FileNotFoundError(f"{hf_dir} holds no transformers weights: expected {SAFETENSORS_FILE}, "
                            f"{SAFETENSORS_INDEX} or pytorch_model.bin(.index.json)")


def _iter_hf_tensors(hf_dir: Path) -> Iterator[tuple[Path, str, "torch.Tensor"]]:
    """(file, name, tensor) for every tensor of the folder, one at a time, shard by shard."""
    import torch
    from safetensors import safe_open

    for file in hf_weight_files(hf_dir):
        if file.suffix == ".safetensors":
            # NOTE: pread, not mmap: a mapped file's pages count in this process's memory until it is closed.
            with safe_open(str(file), framework="pt", backend="pread") as handle:
                for name in handle.keys():
                    yield file, name, handle.get_tensor(name)
            continue
        state = _load_bin(file)
        for name in list(state):
            yield file, name, state.pop(name)


def _load_bin(file: Path) -> dict:
    """A ``pytorch_model.bin`` file's tensors, with ``torch.load(weights_only=True)``: one that pickles anything
    else (which could run code) is refused, naming the file."""
    import pickle

    import torch

    from llmtrain.checkpoint.state import DamagedCheckpointError, refused_global

    try:
        try:  # memory-mapped, so the whole file is never in memory next to the converted copy
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (pre-zip) torch.save format cannot be mapped
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise DamagedCheckpointError(
            f"{file} holds a pickled {refused_global(error) or 'object'} besides tensors, so llmtrain will not load "
            "it: it could run code. Use the model's safetensors weights (model.safetensors) instead") from None


# ------------------------------------------------------------------------------------ llmtrain -> transformers
def to_hf(checkpoint_dir: Path, output_dir: Path, dtype: Optional[DTypeName] = None,
          max_shard_size: Union[str, int] = "5GB") -> Path:
    """Write the llmtrain checkpoint `checkpoint_dir` as a transformers folder `output_dir`.

    `checkpoint_dir` is a model directory (`final/`), a full or sharded `step-*/` checkpoint, or a
    LoRA step checkpoint (its adapters are merged into the base model recorded in lora.yaml).
    Weights go to `model.safetensors`, or to shards of at most `max_shard_size` with an index.
    """
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    files.check_output_dir(output_dir)
    shard_bytes = parse_size(max_shard_size)
    config_path = checkpoint_dir / layout.CONFIG_FILE
    if not config_path.is_file():
        hint = " (it is a transformers folder: use from_hf)" if (checkpoint_dir / HF_CONFIG_FILE).is_file() else ""
        raise FileNotFoundError(f"{config_path} does not exist: {checkpoint_dir} is not a llmtrain checkpoint{hint}")
    config = Config.from_file(config_path)
    adapter = adapter_for_config(config)
    hf_config = adapter.hf_config(config)
    weights = _open_checkpoint_weights(checkpoint_dir, config)
    _check_no_expert_bias(weights, adapter, checkpoint_dir)
    tokenizer = _tokenizer_or_none(checkpoint_dir)
    target_dtype = _torch_dtype(dtype)
    token_ids = {} if tokenizer is None else {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    token_ids = {key: value for key, value in token_ids.items() if value is not None}
    saved_dtype = target_dtype or weights.dtypes["wte.weight"]

    tmp = output_dir.parent / f".{output_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_hf_weights(tmp, adapter, config, weights, target_dtype, shard_bytes)
        hf_config.update(token_ids, torch_dtype=str(saved_dtype).removeprefix("torch."))
        _write_json(tmp / HF_CONFIG_FILE, hf_config)
        if not (checkpoint_dir / GENERATION_CONFIG_FILE).is_file():
            _write_json(tmp / GENERATION_CONFIG_FILE, {"_from_model_config": True, **token_ids})
        _copy_files(checkpoint_dir, tmp, EXTRA_FILES)
        if tokenizer is not None:
            tokenizer.save(tmp)
            _write_chat_format(checkpoint_dir, tmp, tokenizer)
        _publish(tmp, output_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output_dir


@dataclass
class _Weights:
    """The tensors of a checkpoint: shapes and dtypes up front, each tensor loaded when asked for."""

    where: Path
    """The file or folder they come from, for messages."""
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, "torch.dtype"]
    load: Callable[[str], "torch.Tensor"]

    @classmethod
    def from_state_dict(cls, where: Path, state_dict: dict[str, "torch.Tensor"]) -> "_Weights":
        # pop: every tensor is read once, so memory drops as the shards are written.
        return cls(where, {k: tuple(v.shape) for k, v in state_dict.items()},
                   {k: v.dtype for k, v in state_dict.items()}, state_dict.pop)

    @classmethod
    def from_safetensors(cls, path: Path) -> "_Weights":
        from safetensors import safe_open

        handle = safe_open(str(path), framework="pt")
        slices = {name: handle.get_slice(name) for name in handle.keys()}
        return cls(path, {k: tuple(s.get_shape()) for k, s in slices.items()},
                   {k: _safetensors_dtype(s.get_dtype()) for k, s in slices.items()}, handle.get_tensor)


def _open_checkpoint_weights(checkpoint_dir: Path, config: Config) -> _Weights:
    """The full weights of a model directory, a sharded checkpoint or a LoRA step checkpoint (merged)."""
    dcp_dir, adapters = checkpoint_dir / layout.DCP_DIR, checkpoint_dir / layout.LORA_FILE
    config_file = checkpoint_dir / layout.CONFIG_FILE
    if (checkpoint_dir / layout.MODEL_FILE).is_file():
        check_weights_hold(config, config_file, [checkpoint_dir / layout.MODEL_FILE])
        weights = _Weights.from_safetensors(checkpoint_dir / layout.MODEL_FILE)
    elif dcp_dir.is_dir() and checkpoint_format(checkpoint_dir) == "sharded":
        check_weights_hold(config, config_file, [path for path in dcp_dir.rglob("*") if path.is_file()])
        weights = _Weights.from_state_dict(dcp_dir, _read_sharded(dcp_dir))
    elif adapters.is_file():
        weights = _Weights.from_state_dict(adapters, merged_lora_weights(checkpoint_dir))
    else:
        raise FileNotFoundError(f"{checkpoint_dir} holds no weights: expected {layout.MODEL_FILE}, a sharded "
                                f"checkpoint's {layout.DCP_DIR}/ folder or LoRA adapters ({layout.LORA_FILE})")
    _check_checkpoint_weights(weights, config, config_file)
    return weights


def _check_checkpoint_weights(weights: _Weights, config: Config, config_path: Path) -> None:
    expected = files.stored_shapes(config)
    if config.tie_embeddings and "lm_head.weight" in weights.shapes:
        del weights.shapes["lm_head.weight"]  # the embedding, stored a second time (e.g. by DCP)
    for name, shape in weights.shapes.items():
        if name not in expected:
            raise ValueError(f"{weights.where}: tensor {name!r} is not part of the model that {config_path} describes")
        if shape != expected[name]:
            raise ValueError(f"{weights.where}: {name!r} has shape {shape}, but {config_path} implies {expected[name]}")
    missing = [name for name in expected if name not in weights.shapes]
    if missing:
        raise ValueError(f"{weights.where} lacks {len(missing)} tensors that {config_path} implies, e.g. {missing[:3]}")


def _check_no_expert_bias(weights: _Weights, adapter: Adapter, checkpoint_dir: Path) -> None:
    """A model trained with aux-loss-free balancing chooses its experts by score plus a learned bias per expert, which
    no transformers family here has: exported without it, the model would route differently."""
    for name in [name for name in weights.shapes if EXPERT_BIAS.match(name)]:
        if weights.load(name).count_nonzero():
            raise ValueError(f"{checkpoint_dir}: {name} is not zero: the model was trained with "
                             "router_bias_update_rate (aux-loss-free balancing) and chooses its experts by score plus "
                             f"this bias, which {adapter.architecture} has no place for, so the exported model would "
                             "route tokens differently. It can only be used with llmtrain")


def _read_sharded(dcp_dir: Path) -> dict[str, "torch.Tensor"]:
    """The model's full state dict from the DCP shards of a sharded checkpoint, in this one process."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from llmtrain.checkpoint import dcp_reader  # NOTE: slow, as torch.distributed.checkpoint

    # The saved state is {"model": ..., "optimizer": ...}; allocate and read the model's tensors only.
    metadata = dcp_reader.read_metadata(dcp_dir / layout.DCP_METADATA_FILE)
    model_state = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
                   for key, meta in metadata.state_dict_metadata.items()
                   if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp_reader.load({"model": model_state}, dcp_dir, no_dist=True)
    return model_state


def _write_hf_weights(directory: Path, adapter: Adapter, config: Config, weights: _Weights,
                      dtype: Optional["torch.dtype"], max_shard_bytes: int) -> None:
    """The weights as transformers tensors, in shards of at most max_shard_bytes (plus an index) or one file."""
    hf_layout = adapter.hf_layout(config, list(weights.shapes))
    shapes = _hf_shapes(adapter, config, weights.shapes)
    sizes = {hf_name: _numel(shapes[hf_name]) * (dtype or weights.dtypes[source.parts[0]]).itemsize
             for hf_name, source in hf_layout.items()}
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for hf_name, size in sizes.items():
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(hf_name)
        shard_bytes += size
    if len(shards) == 1:
        file_names = [SAFETENSORS_FILE]
    else:
        file_names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    stacked: dict[str, "torch.Tensor"] = {}  # the expert tensor being split, loaded once for all its experts

    def load(name: str, expert: Optional[int]) -> "torch.Tensor":
        if expert is None:
            return weights.load(name)
        if name not in stacked:
            stacked.clear()
            stacked[name] = weights.load(name)
        return stacked[name]

    for file_name, shard in zip(file_names, shards):
        tensors = {}
        for hf_name in shard:
            source = hf_layout[hf_name]
            parts = [load(part, source.expert) for part in source.parts]
            tensor = _cast(adapter.fuse(config, parts, source.expert), dtype).contiguous()
            # NOTE: an expert's slice shares the stacked tensor's storage, which safetensors refuses to save.
            tensors[hf_name] = tensor.clone() if source.expert is not None else tensor
        files.save_safetensors(tensors, directory / file_name)
        del tensors
    if len(shards) > 1:
        weight_map = {hf_name: file_name for file_name, shard in zip(file_names, shards) for hf_name in shard}
        _write_json(directory / SAFETENSORS_INDEX, {"metadata": {"total_size": sum(sizes.values())},
                                                    "weight_map": dict(sorted(weight_map.items()))})


# ------------------------------------------------------------------------------------ either -> llmtrain
def ensure_model_dir(path: Path, cache_dir: Optional[Path] = None, flag: str = "CHECKPOINT_DIR") -> Path:
    """A llmtrain model directory for `path`: `path` itself, or its conversion if it is a transformers folder.

    The conversion happens once: it is cached under `cache_dir` (default `$LLMTRAIN_CACHE_DIR/from_hf`,
    else `~/.cache/llmtrain/from_hf`), keyed by the folder's path and its files' sizes and mtimes.
    Processes that call this together convert once (a file lock), the others wait and reuse it. ``flag`` is how
    the user passed `path`, for the message when it does not exist.
    """
    from llmtrain.data.tokens import cache_dir as default_cache_dir
    from llmtrain.data.tokens import cache_key, exclusive_lock

    path = Path(path)
    if (path / layout.CONFIG_FILE).is_file():
        return path
    if not path.exists():
        raise FileNotFoundError(missing_path_message(path, flag))
    if not (path / HF_CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path} is neither a llmtrain model directory (it has no {layout.CONFIG_FILE}) "
                                f"nor a transformers folder (it has no {HF_CONFIG_FILE})")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "from_hf"
    stamps = [(file.name, file.stat().st_size, file.stat().st_mtime_ns) for file in sorted(path.iterdir())
              if file.is_file()]
    target = root / f"{path.name}-{cache_key('from_hf', str(path.resolve()), stamps)}"
    with exclusive_lock(root / f".{target.name}.lock"):
        if not layout.is_complete(target):
            shutil.rmtree(target, ignore_errors=True)
            print(f"converting transformers folder {path} to a llmtrain model directory in {target}",
                  file=sys.stderr, flush=True)
            from_hf(path, target)
    return target


# ------------------------------------------------------------------------------------ command line
def convert_to_hf(checkpoint_dir: Path, output_dir: Path, dtype: Optional[DTypeName] = None,
                  max_shard_size: str = "5GB") -> Path:
    """Convert a llmtrain checkpoint into a folder that transformers' `from_pretrained` opens.

    Args:
        checkpoint_dir: A llmtrain `final/`, a full or sharded `step-*/` checkpoint, or a LoRA `step-*/` (merged first).
        output_dir: Where the transformers folder goes; it must not exist or be empty.
        dtype: Precision of the saved weights: float32, bfloat16 or float16. Default: as stored in the checkpoint.
        max_shard_size: Largest weights file, e.g. 5GB or 500MB; bigger models are split into shards with an index.
    """
    written = to_hf(checkpoint_dir, output_dir, dtype=dtype, max_shard_size=max_shard_size)
    print(f"wrote transformers model to {output_dir}")
    return Path(written)


def convert_from_hf(hf_dir: Path, output_dir: Path, model_name: Optional[str] = None,
                    dtype: Optional[DTypeName] = None) -> Path:
    """Convert a transformers model folder (e.g. a Hugging Face Hub download) into a llmtrain model directory.

    Args:
        hf_dir: The transformers folder: config.json, safetensors or .bin weights (sharded or not), tokenizer files.
        output_dir: Where the llmtrain model directory goes; it must not exist or be empty.
        model_name: The zoo entry to record (e.g. Llama-3.2-1B); it must agree with config.json. Default: by shape.
        dtype: Precision of the saved weights: float32, bfloat16 or float16. Default: as stored in the folder.
    """
    path = from_hf(hf_dir, output_dir, model_name=model_name, dtype=dtype)
    config = Config.from_file(path / layout.CONFIG_FILE)
    described = config.name or f"custom, {config.hf_config.get('name') or 'not in the zoo'}"
    print(f"wrote llmtrain model directory {path} (model {described})")
    return path


# ------------------------------------------------------------------------------------ helpers
def parse_size(size: Union[str, int]) -> int:
    """Bytes in "5GB" (powers of 1000), "4GiB" (powers of 1024) or a plain number."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
    if match is None or match.group(2).upper() not in units:
        raise ValueError(f"--max_shard_size {size!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    size_bytes = int(float(match.group(1)) * units[match.group(2).upper()])
    if size_bytes < 1:
        raise ValueError(f"--max_shard_size {size!r} is no size at all; write e.g. 5GB, 500MB or 2GiB")
    return size_bytes


def _torch_dtype(name: Optional[str]) -> Optional["torch.dtype"]:
    import torch

    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name is not None and name not in choices:
        raise ValueError(f"--dtype {name!r} must be one of {list(choices)}")
    return None if name is None else choices[name]


def _safetensors_dtype(name: str) -> "torch.dtype":
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool}[name]


def _cast(tensor: "torch.Tensor", dtype: Optional["torch.dtype"]) -> "torch.Tensor":
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _hf_shapes(adapter: Adapter, config: Config, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Shape of every transformers tensor (a fused QKV stacks the rows of its parts)."""
    out = {}
    for hf_name, source in adapter.hf_layout(config, list(shapes)).items():
        first = shapes[source.parts[0]]
        if source.expert is not None:
            out[hf_name] = first[1:]
        else:
            out[hf_name] = (sum(shapes[part][0] for part in source.parts), *first[1:])
    return out


def _tokenizer_or_none(directory: Path):
    from llmtrain.tokenizer import Tokenizer

    if not (directory / layout.TOKENIZER_FILE).is_file():
        from llmtrain.tokenizer import sentencepiece_only_message

        why = sentencepiece_only_message(directory) or f"{directory} has no {layout.TOKENIZER_FILE}"
        print(f"warning: {why}; the converted model has no tokenizer", file=sys.stderr)
        return None
    return Tokenizer(directory)


def _write_chat_format(checkpoint_dir: Path, directory: Path, tokenizer) -> None:
    """The chat format of the prompt style the model was fine-tuned with (its prompt_style.yaml), as transformers
    reads it: the chat template and the tokens that end a turn. A checkpoint without one keeps its tokenizer's."""
    from llmtrain.prompts import has_prompt_style, load_prompt_style

    if has_prompt_style(checkpoint_dir):
        style = load_prompt_style(checkpoint_dir)
        _write_chat_template(checkpoint_dir, directory, style, tokenizer)
        _write_stop_tokens(directory, style, tokenizer)


def _write_chat_template(checkpoint_dir: Path, directory: Path, style, tokenizer) -> None:
    """The style's chat template as chat_template.jinja, where transformers reads and writes it; not the template
    that came with the tokenizer files, which is the base model's."""
    from llmtrain.prompts import checked_chat_template
    from llmtrain.tokenizer import read_special_tokens

    special_tokens = read_special_tokens(directory)
    # NOTE: transformers encodes a rendered chat without special tokens, so the template writes the bos token
    # where llmtrain's tokenizer adds one.
    bos = tokenizer.add_bos and "bos_token" in special_tokens
    try:
        template = checked_chat_template(style, special_tokens, bos)
    except ValueError as error:
        template = None
        print(f"warning: {checkpoint_dir / layout.PROMPT_STYLE_FILE}: {error}; the converted model has no chat "
              "template, so transformers' apply_chat_template refuses it: write its prompts as llmtrain's "
              f"{style.name!r} style does", file=sys.stderr)
    config_path = directory / layout.TOKENIZER_CONFIG_FILE
    if config_path.is_file():
        tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
        if tokenizer_config.pop("chat_template", None) is not None:
            _write_json(config_path, tokenizer_config)
    if template is None:
        (directory / layout.CHAT_TEMPLATE_FILE).unlink(missing_ok=True)
    else:
        (directory / layout.CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")


def _write_stop_tokens(directory: Path, style, tokenizer) -> None:
    """The style's end-of-turn tokens (<|im_end|>, <|eot_id|>, ...) among generation_config.json's eos_token_id,
    after the eos token, so that transformers' generate ends a reply where llmtrain's generate and chat do."""
    path = directory / GENERATION_CONFIG_FILE
    generation = json.loads(path.read_text()) if path.is_file() else {"_from_model_config": True}
    eos = generation.get("eos_token_id")
    eos = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    # NOTE: a marker of several tokens cannot be listed; transformers' stop_strings needs the tokenizer passed in.
    stop_ids = [ids[0] for ids in style.stop_tokens(tokenizer) if len(ids) == 1]
    stop_ids = list(dict.fromkeys(eos + stop_ids))
    if stop_ids != eos:
        generation["eos_token_id"] = stop_ids[0] if len(stop_ids) == 1 else stop_ids
        _write_json(path, generation)


def _copy_files(source: Path, target: Path, names: tuple[str, ...]) -> None:
    for name in names:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished folder into place (over an empty one), so readers see all files or none."""
    if target.is_dir():
        target.rmdir()
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, target)
