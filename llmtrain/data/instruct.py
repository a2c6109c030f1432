"""Instruction fine-tuning data: records → prompt style → tokens with masked prompts, padded per micro-batch.

A record is either Alpaca style, ``{"instruction", "output"}`` with optional ``"input"`` and
``"system"``, or chat style, ``{"messages": [{"role", "content"}, ...]}``. The prompt style turns
it into prompt and response segments. The whole text is tokenized at once, as generation will
see it; the text up to the end of each segment, tokenized too, says where that segment ends.

A sample is bos (if the tokenizer adds one) + segments + eos (unless the last token is eos
already). Inputs are the sample without its last token, labels the sample without its first;
when the prompt is masked, a label is kept only where it is a response token. Every
micro-batch is padded to its longest sample (under --compile, to a multiple of
`COMPILE_PAD_MULTIPLE`; under sequence parallelism, of --tp_size), with the pad token (or eos) in
the inputs and IGNORE_INDEX (-100, which the loss skips) in the labels. A causal model needs no attention mask for this: right padding comes after every real token.

These datasets are small: they are tokenized once, in memory, by `prepare_data()`.
"""

import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import numpy as np
import torch

from llmtrain.data.base import IGNORE_INDEX, Batch, DataModule, TrainLoader, ValLoader
from llmtrain.prompts import Message, PromptStyle, Segment, split_turns
from llmtrain.tokenizer import Tokenizer

Conversation = list[Message]

COMPILE_PAD_MULTIPLE = 64
"""Under --compile, batches are padded to a multiple of this many tokens (at most --train.max_seq_length)."""


CHARS_KEPT = 2
"""A record is cut to this many times the characters its kept tokens can span before it is tokenized (see
:func:`cut_segments`): a 50 MB record costs what a short one does, and a sample equals the whole record's."""


def pad_multiple(compile: bool, sequence_shards: int = 1) -> int:
    """What a batch's width is rounded up to: 1 (its longest sample) unless the model is compiled or sequence
    parallelism splits each sequence over ``sequence_shards`` ranks (``--tp_size``), which must divide it.

    NOTE: a compiled block is specialised to the shapes it has seen; batches padded to their longest
    sample bring a new length nearly every step, and each one costs a recompilation (or, once torch
    turns the length dynamic, slower generic kernels). A few widths, multiples of 64, waste little.
    """
    return math.lcm(COMPILE_PAD_MULTIPLE if compile else 1, sequence_shards)


@dataclass(kw_only=True)
class InstructDataModule(DataModule):
    """Shared machinery of instruction data modules; subclasses implement `load_conversations()`.

    The fine-tuning recipe passes the model's own prompt style to `connect(..., prompt_style=)`;
    --data.prompt_style overrides it. The style in use is `resolved_prompt_style` after connect(),
    which the recipe saves beside the weights (`llmtrain.prompts.save_prompt_style`).
    """

    prompt_style: Optional[str] = None
    """Prompt style (alpaca, chatml, llama2, llama3, llama3.1, mistral, gemma, phi, tinyllama, default).
    None: the model's own."""
    mask_prompt: bool = True
    """Compute the loss on the responses only: prompt tokens get the label the loss skips (-100, IGNORE_INDEX)."""

    # Runtime state, not flags (no annotations, so they are no dataclass fields).
    resolved_prompt_style = None  # PromptStyle: set by connect()
    _samples = None  # dict split -> PaddedSamples, set by prepare_data()
    _truncation_note = ""
    _val_prompts = ()
    _pad_multiple = 1
    _dp_rank = 0
    _dp_size = 1

    def validate(self) -> None:
        if self.prompt_style is not None:
            PromptStyle.from_name(self.prompt_style)  # unknown names fail now, with the choices

    def connect(self, tokenizer: Tokenizer, micro_batch_size: int, max_seq_length: int, seed: int = 42,
                prompt_style: Union[PromptStyle, str, None] = None, pad_multiple: int = 1) -> None:
        """As `DataModule.connect`; `prompt_style` is the model's own style, used unless --data.prompt_style is set.

        Without either, Alpaca's template is used. `pad_multiple`: batches are padded to a multiple of it
        (see :func:`pad_multiple`).
        """
        super().connect(tokenizer, micro_batch_size, max_seq_length, seed)
        self._pad_multiple = pad_multiple
        if self.prompt_style is not None:
            prompt_style = self.prompt_style
        if isinstance(prompt_style, str):
            prompt_style = PromptStyle.from_name(prompt_style)
        self.resolved_prompt_style = prompt_style if prompt_style is not None else PromptStyle.from_name("alpaca")
        self._samples = None  # samples belong to one tokenizer, style and length

    def load_conversations(self) -> tuple[list[Conversation], Optional[list[Conversation]], str]:
        """Training conversations, validation conversations (None: no validation), and a name for messages."""
        raise NotImplementedError

    def prepare_data(self) -> None:
        tokenizer = self._require_connected()
        train, val, name = self.load_conversations()
        # The prompts of the validation conversations (everything before the final answer), for examples.
        self._val_prompts = [conversation[:-1] for conversation in (val or [])
                             if conversation and conversation[-1].get("role") == "assistant"]
        if not train:
            raise ValueError(f"{name} has no training records")
        self._samples = {}
        notes = []
        for split, conversations in (("train", train), ("val", val)):
            if conversations is None:
                continue
            samples, truncated, emptied = tokenize_conversations(
                conversations, self.resolved_prompt_style, tokenizer, self.max_seq_length, self.mask_prompt,
                pad_multiple=self._pad_multiple)
            self._samples[split] = samples
            if not any((labels != IGNORE_INDEX).any() for labels in samples.labels):
                # NOTE: validation too: a loss over no tokens would be logged as val_loss 0 (perplexity 1).
                what = "training sample keeps a response token to learn from" if split == "train" else \
                    "validation sample keeps a response token to score"
                raise ValueError(f"{name}: no {what} within --train.max_seq_length {self.max_seq_length} (their "
                                 "prompts are longer): raise --train.max_seq_length")
            if truncated:
                lost = f" ({emptied} of them kept no response token to learn from)" if emptied else ""
                notes.append(f"{truncated} of {len(conversations)} {split} samples{lost}")
        self._truncation_note = (
            f"{name}: {' and '.join(notes)} were longer than --train.max_seq_length {self.max_seq_length} "
            "and were truncated; raise --train.max_seq_length to keep them whole" if notes else "")

    def setup(self, dp_rank: int = 0, dp_size: int = 1) -> None:
        self._require_connected()
        if self._samples is None:
            self.prepare_data()
        self._dp_rank, self._dp_size = dp_rank, dp_size
        val = self._samples.get("val")
        if val is not None and len(val) < dp_size:
            raise ValueError(
                f"The validation split has {len(val)} samples, but each of the {dp_size} data-parallel ranks "
                "needs one. Add validation records or raise --data.val_split_fraction.")
        if self._truncation_note and dp_rank == 0:  # said once per run, not per rank or batch
            warnings.warn(self._truncation_note, stacklevel=2)
            self._truncation_note = ""

    def validation_prompts(self) -> list[Conversation]:
        """The validation conversations without their answers (empty before prepare_data or without a val split)."""
        return list(self._val_prompts)

    def train_dataloader(self) -> TrainLoader:
        samples = self._split("train")
        return TrainLoader(len(samples), samples.batch, self.micro_batch_size, self._dp_rank, self._dp_size,
                           seed=self.seed)

    def val_dataloader(self) -> Optional[ValLoader]:
        if self._samples is None or "val" not in self._samples:
            return None
        samples = self._split("val")
        return ValLoader(len(samples), samples.batch, self.micro_batch_size, self._dp_rank, self._dp_size)

    def _split(self, split: str) -> "PaddedSamples":
        if self._samples is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must be called before the dataloaders")
        return self._samples[split]


@dataclass(kw_only=True)
class JSON(InstructDataModule):
    """Instruction data in a .json (a list of records) or .jsonl file, or a folder with train and val files."""

    json_path: Path
    """A .json or .jsonl file, or a folder holding train.json(l) and optionally val.json(l)."""
    val_split_fraction: Optional[float] = None
    """Without a val file: the fraction of records, drawn at random, held out for validation. 0: no validation.
    None: 0.05."""
    split_seed: int = 42
    """Seed of the train/validation split (the training order follows --seed)."""

    def validate(self) -> None:
        super().validate()
        _, val_file = self._files()
        if self.val_split_fraction is not None and not 0 <= self.val_split_fraction < 1:
            raise ValueError(f"--data.val_split_fraction must be in [0, 1), got {self.val_split_fraction}")
        if val_file is not None and self.val_split_fraction is not None:
            raise ValueError(f"--data.val_split_fraction {self.val_split_fraction:g} holds out records of the training "
                             f"file, but --data.json_path {self.json_path} has a validation file of its own "
                             f"({val_file.name}): drop one of them")

    def load_conversations(self) -> tuple[list[Conversation], Optional[list[Conversation]], str]:
        train_file, val_file = self._files()
        train = [record_to_conversation(record, where) for record, where in read_json_records(train_file)]
        if val_file is not None:
            val = [record_to_conversation(record, where) for record, where in read_json_records(val_file)]
            return train, val, f"--data.json_path {self.json_path}"
        fraction = 0.05 if self.val_split_fraction is None else self.val_split_fraction
        train, val = split_records(train, fraction, self.split_seed)
        return train, val, f"--data.json_path {self.json_path}"

    def _files(self) -> tuple[Path, Optional[Path]]:
        path = Path(self.json_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"--data.json_path {path} does not exist")
        if path.is_file():
            if path.suffix not in (".json", ".jsonl"):
                raise ValueError(f"--data.json_path {path} must be a .json or .jsonl file, or a folder")
            return path, None
        train, val = _split_file(path, "train"), _split_file(path, "val")
        if train is None:
            raise FileNotFoundError(f"--data.json_path {path} is a folder without train.json or train.jsonl")
        return train, val


def _split_file(folder: Path, split: str) -> Optional[Path]:
    found = [folder / f"{split}{suffix}" for suffix in (".json", ".jsonl") if (folder / f"{split}{suffix}").is_file()]
    if len(found) > 1:
        raise ValueError(f"--data.json_path {folder} holds both {found[0].name} and {found[1].name}; keep one")
    return found[0] if found else None


# ------------------------------------------------------------------------------------------ records
def read_json_records(path: Path) -> list[tuple[Any, str]]:
    """(record, where) pairs from a .json list or a JSON-lines file; `where` names the file and record."""
    text = Path(path).read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{path} is empty")
    if path.suffix == ".json":
        try:
            records = json.loads(text)
        except RecursionError:
            raise ValueError(too_deep(path)) from None
        except json.JSONDecodeError as error:
            if error.msg != "Extra data":
                raise ValueError(f"{path} is not valid JSON: {error.msg} at line {error.lineno}, "
                                 f"column {error.colno}") from error
            return _read_json_lines(path, text)  # JSON lines under a .json name
        if not isinstance(records, list):
            raise ValueError(f"{path} must hold a list of records, not a {type(records).__name__}")
        if not records:
            raise ValueError(f"{path} holds an empty list: no records")
        return [(record, f"{path} record {index}") for index, record in enumerate(records)]
    return _read_json_lines(path, text)


def _read_json_lines(path: Path, text: str) -> list[tuple[Any, str]]:
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except RecursionError:
            raise ValueError(too_deep(f"{path} line {number}")) from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {number} is not valid JSON: {error.msg} (column {error.colno})") from error
        records.append((record, f"{path} line {number} (record {len(records)})"))
    return records


def too_deep(where: Any) -> str:
    """Why a JSON document nested deeper than Python's recursion limit cannot be read (a RecursionError, which no
    record needs)."""
    return (f"{where} nests its JSON deeper than Python's reader goes ({sys.getrecursionlimit()} levels): no record "
            "needs that; fix or drop it")


def record_to_conversation(record: Any, where: str) -> Conversation:
    """The conversation of an Alpaca-style or chat record; errors name `where` and what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a {type(record).__name__}, not an object with 'instruction' and 'output' "
                         "or with 'messages'")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        try:
            split_turns(messages)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
        if messages[-1]["role"] != "assistant":
            raise ValueError(f"{where}: the conversation ends with a {messages[-1]['role']} message; "
                             "the last message must be the assistant's reply")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if "instruction" in record and "output" in record:
        for key in ("instruction", "output", "input", "system"):
            if record.get(key) is not None and not isinstance(record[key], str):
                raise ValueError(f"{where}: {key!r} must be text, not {type(record[key]).__name__}")
        user = {"role": "user", "content": record["instruction"]}
        if record.get("input"):
            user["input"] = record["input"]
        system = [{"role": "system", "content": record["system"]}] if record.get("system") is not None else []
        return [*system, user, {"role": "assistant", "content": record["output"] or ""}]
    raise ValueError(f"{where} is neither an Alpaca-style record ('instruction', 'output', optional 'input') nor a "
                     f"chat record ('messages'); its keys are {sorted(record)}")


def split_records(records: list, fraction: float, seed: int) -> tuple[list, Optional[list]]:
    """A random `fraction` of the records for validation (None if that is none); both keep the file order."""
    num_val = int(len(records) * fraction)
    if num_val == 0:
        return records, None
    order = np.random.default_rng(seed).permutation(len(records))
    val_indices = set(order[:num_val].tolist())
    train = [r for i, r in enumerate(records) if i not in val_indices]
    val = [r for i, r in enumerate(records) if i in val_indices]
    return train, val


# ------------------------------------------------------------------------------------------ tokens
def tokenize_conversations(
    conversations: Iterable[Conversation], style: PromptStyle, tokenizer: Tokenizer, max_seq_length: int,
    mask_prompt: bool = True, pad_multiple: int = 1,
) -> tuple["PaddedSamples", int, int]:
    """Samples of the conversations, the number truncated, and how many of those lost every response token.

    Their batches are padded to a multiple of `pad_multiple` tokens, at most `max_seq_length`.
    """
    budget = CHARS_KEPT * (max_seq_length + 1) * tokenizer.max_token_chars
    rendered = [cut_segments(style.render(conversation), budget) for conversation in conversations]
    # NOTE: the tokens are those of the whole text, as generation will see it; encoding each segment
    # alone would differ where a tokenizer prepends a space to every call (sentencepiece-style ones).
    # A segment ends where the tokens of the text up to its end stop agreeing with the whole text's.
    prefixes = [text for segments in rendered for text in _running_texts(segments)]
    # One call for every prefix of every conversation: tokenizers spreads it over all cores.
    encoded = iter(tokenizer.encode_batch(prefixes, bos=False))
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    inputs, labels = [], []
    truncated = emptied = 0
    for segments in rendered:
        prefix_ids = [next(encoded) for _ in segments]
        ids = bos + prefix_ids[-1]
        is_response = np.zeros(len(ids), dtype=bool)
        start = len(bos)
        for segment, segment_ids in zip(segments, prefix_ids):
            end = len(bos) + _common_prefix_length(segment_ids, prefix_ids[-1])
            is_response[start:end] = segment.is_response
            start = end
        if tokenizer.eos_id is not None and (not ids or ids[-1] != tokenizer.eos_id):
            ids.append(tokenizer.eos_id)
            is_response = np.append(is_response, True)
        was_truncated = len(ids) > max_seq_length + 1
        if was_truncated:
            truncated += 1
            ids, is_response = ids[: max_seq_length + 1], is_response[: max_seq_length + 1]
        tokens = np.asarray(ids, dtype=np.int64)
        targets = tokens[1:].copy()
        if mask_prompt:
            targets[~is_response[1:]] = IGNORE_INDEX
            emptied += was_truncated and bool((targets == IGNORE_INDEX).all())
        inputs.append(tokens[:-1])
        labels.append(targets)
    pad_id = getattr(tokenizer, "pad_id", None)
    pad_id = pad_id if pad_id is not None else (tokenizer.eos_id if tokenizer.eos_id is not None else 0)
    samples = PaddedSamples(inputs, labels, pad_id, pad_multiple=pad_multiple, max_width=max_seq_length)
    return samples, truncated, emptied


def cut_segments(segments: list[Segment], budget: int) -> list[Segment]:
    """The segments' first ``budget`` characters: a record of any length costs the tokenizer at most that.

    With ``budget`` = CHARS_KEPT × tokens kept × the longest token's characters, the text cut off lies past
    twice the characters the kept tokens can span, so they are those of the whole text (only the word cut in
    two tokenizes differently, and it begins after them in any text of ordinary words).
    """
    kept, used = [], 0
    for segment in segments:
        if used >= budget:
            break
        kept.append(segment._replace(text=segment.text[: budget - used]))
        used += len(kept[-1].text)
    return kept


def _running_texts(segments: list[Segment]) -> list[str]:
    """The text up to the end of each segment; the last is the whole text."""
    texts, text = [], ""
    for segment in segments:
        text += segment.text
        texts.append(text)
    return texts


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


class PaddedSamples:
    """Variable-length samples; a batch is padded to its longest member, rounded up to a multiple of
    `pad_multiple` but not beyond `max_width`, with `pad_id` in the inputs and IGNORE_INDEX in the labels."""

    def __init__(self, inputs: list[np.ndarray], labels: list[np.ndarray], pad_id: int, pad_multiple: int = 1,
                 max_width: Optional[int] = None) -> None:
        self.inputs = inputs
        self.labels = labels
        self.pad_id = pad_id
        self.pad_multiple = pad_multiple
        self.max_width = max_width

    def __len__(self) -> int:
        return len(self.inputs)

    def batch(self, indices: np.ndarray) -> Batch:
        indices = indices.tolist()
        width = padded_width(max(len(self.inputs[i]) for i in indices), self.pad_multiple, self.max_width)
        input_ids = torch.full((len(indices), width), self.pad_id, dtype=torch.long)  # (B, longest)
        labels = torch.full((len(indices), width), IGNORE_INDEX, dtype=torch.long)
        for row, index in enumerate(indices):
            length = len(self.inputs[index])
            input_ids[row, :length] = torch.from_numpy(self.inputs[index])
            labels[row, :length] = torch.from_numpy(self.labels[index])
        real = sum(len(self.inputs[index]) for index in indices)
        return {"input_ids": input_ids, "labels": labels, "real_tokens": torch.tensor(real)}


def padded_width(longest: int, multiple: int, max_width: Optional[int] = None) -> int:
    """`longest` rounded up to a multiple of `multiple`, but never beyond `max_width` (nor below `longest`)."""
    width = -(-longest // multiple) * multiple
    return max(longest, min(width, max_width)) if max_width is not None else width
