"""One tokenizer class over HF `tokenizers` (tokenizer.json), with bos/eos handling.

The special-token settings come from the files that sit beside tokenizer.json, in the
order transformers itself trusts them: tokenizer_config.json, special_tokens_map.json,
generation_config.json.
"""

import functools
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from tokenizers import Tokenizer as HFTokenizer

from llmtrain.checkpoint.layout import (
    GENERATION_CONFIG_FILE,
    SENTENCEPIECE_FILE,
    SPECIAL_TOKENS_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    TOKENIZER_FILES,
)

# Files that make a tokenizer directory self-contained, in the order `save` copies them.

BPE_EOS_TOKEN = "<|endoftext|>"
BPE_BOS_TOKEN = "<|bos|>"


class Tokenizer:
    """Encode and decode text with the tokenizer stored in `checkpoint_dir`."""

    def __init__(self, checkpoint_dir: Union[Path, str]) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        tokenizer_path = self.checkpoint_dir / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            sentencepiece_only = sentencepiece_only_message(self.checkpoint_dir)
            if sentencepiece_only:
                raise FileNotFoundError(sentencepiece_only)
            what = "directory" if not self.checkpoint_dir.is_dir() else "file"
            missing = self.checkpoint_dir if what == "directory" else tokenizer_path
            raise FileNotFoundError(
                f"Tokenizer {what} not found: {missing}. Pass --tokenizer_dir pointing to a folder "
                "that holds tokenizer.json (e.g. a downloaded Hugging Face model folder)."
            )
        # Read the file once: the fingerprint must describe exactly what was loaded.
        tokenizer_json = tokenizer_path.read_bytes()
        self.processor = _parse_tokenizer(tokenizer_path, tokenizer_json)
        settings = _read_special_token_settings(self.checkpoint_dir)
        self.bos_id: Optional[int] = self._resolve_id(settings.get("bos_token"), settings.get("bos_token_id"))
        if self.bos_id is None:
            # NOTE: with no file naming a bos token (a folder with tokenizer.json alone), transformers still adds
            # the one the post-processor puts in front; it is this tokenizer's bos.
            self.bos_id = self._post_processor_bos()
        self.eos_id: Optional[int] = self._resolve_id(settings.get("eos_token"), settings.get("eos_token_id"))
        self.add_bos: bool = self._default_add_bos(settings.get("add_bos_token"))
        eos_ids = [self.eos_id] if self.eos_id is not None else []
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids + settings.get("stop_token_ids", [])))
        """Every id that ends generation: eos, then the others generation_config.json lists as eos_token_id
        (Llama 3.1's instruct models list three, Qwen2.5's two)."""
        digest = hashlib.sha256(tokenizer_json)
        digest.update(json.dumps(self._config_dict(), sort_keys=True).encode())
        self.fingerprint: str = digest.hexdigest()
        """Changes whenever the ids this tokenizer produces could change; a cache key."""

    @property
    def vocab_size(self) -> int:
        return self.processor.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's text, in characters (bytes, for byte-level tokens): no token covers more of a text,
        so n tokens never span more than n × this many characters (before the normalizer, which the common ones
        do not shorten)."""
        return max(map(len, self.processor.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, bos: Optional[bool] = None, eos: bool = False) -> list[int]:
        """Token ids of `text`. `bos=None` follows the tokenizer's own default."""
        ids = self.processor.encode(text, add_special_tokens=False).ids
        return self._add_special(ids, bos, eos)

    def encode_batch(self, texts: Sequence[str], bos: Optional[bool] = None, eos: bool = False) -> list[list[int]]:
        """Like `encode` for many texts at once; tokenizers spreads the work over all cores."""
        encodings = self.processor.encode_batch(list(texts), add_special_tokens=False)
        return [self._add_special(encoding.ids, bos, eos) for encoding in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):  # a tensor or numpy array
            ids = ids.tolist()
        return self.processor.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.processor.token_to_id(token)

    def save(self, out_dir: Union[Path, str]) -> None:
        """Copy the tokenizer files into `out_dir`, so a checkpoint folder stands on its own."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if out_dir.resolve() == self.checkpoint_dir.resolve():
            return
        for name in TOKENIZER_FILES:
            source = self.checkpoint_dir / name
            if source.is_file():
                _atomic_copy(source, out_dir / name)
        if not (self.checkpoint_dir / TOKENIZER_CONFIG_FILE).is_file():
            # NOTE: the settings may have come from generation_config.json, which belongs to the
            # model rather than the tokenizer; write them down so the copy reads the same.
            _atomic_write_json(out_dir / TOKENIZER_CONFIG_FILE, self._config_dict())

    def __repr__(self) -> str:
        return (
            f"Tokenizer({str(self.checkpoint_dir)!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos})"
        )

    def _add_special(self, ids: list[int], bos: Optional[bool], eos: bool) -> list[int]:
        want_bos = self.add_bos if bos is None else bos
        if want_bos:
            if self.bos_id is None:
                raise ValueError(f"bos=True, but the tokenizer in {self.checkpoint_dir} defines no bos token")
            if not ids or ids[0] != self.bos_id:  # the text itself may start with the bos token
                ids = [self.bos_id] + ids
        if eos:
            if self.eos_id is None:
                raise ValueError(f"eos=True, but the tokenizer in {self.checkpoint_dir} defines no eos token")
            ids = ids + [self.eos_id]
        return ids

    def _resolve_id(self, token: Optional[str], token_id: Optional[int]) -> Optional[int]:
        if token is not None:
            resolved = self.processor.token_to_id(token)
            if resolved is not None:
                return resolved
        return token_id

    def _post_processor_bos(self) -> Optional[int]:
        plain = self.processor.encode("a", add_special_tokens=False).ids
        special = self.processor.encode("a", add_special_tokens=True).ids
        return special[0] if special[1:] == plain else None

    def _default_add_bos(self, configured: Optional[bool]) -> bool:
        if self.bos_id is None:
            return False
        if configured is not None:
            return bool(configured)
        # NOTE: without an explicit setting (Llama 3, for one) the post-processor decides;
        # ask it by encoding a probe with special tokens on.
        probe = self.processor.encode("a", add_special_tokens=True).ids
        return bool(probe) and probe[0] == self.bos_id

    def _config_dict(self) -> dict:
        return {
            "bos_token": None if self.bos_id is None else self.processor.id_to_token(self.bos_id),
            "eos_token": None if self.eos_id is None else self.processor.id_to_token(self.eos_id),
            "add_bos_token": self.add_bos,
        }


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Union[Path, str]) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `texts` and write it to `out_dir` atomically.

    `<|endoftext|>` is the eos token and `<|bos|>` the bos token, added to the front of
    every encoded document. `transformers.AutoTokenizer.from_pretrained(out_dir)` opens it.
    """
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    out_dir = Path(out_dir)
    hf_tokenizer = HFTokenizer(models.BPE())
    hf_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf_tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS_TOKEN, BPE_BOS_TOKEN],
        # NOTE: the full byte alphabet means any text encodes, even characters never seen in training.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf_tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = hf_tokenizer.token_to_id(BPE_BOS_TOKEN)
    hf_tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BPE_BOS_TOKEN} $A", pair=f"{BPE_BOS_TOKEN} $A {BPE_BOS_TOKEN} $B",
            special_tokens=[(BPE_BOS_TOKEN, bos_id)],
        ),
    ])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BPE_BOS_TOKEN,
        "eos_token": BPE_EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
    }
    special_tokens_map = {"bos_token": BPE_BOS_TOKEN, "eos_token": BPE_EOS_TOKEN}

    staging = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        hf_tokenizer.save(str(staging / TOKENIZER_FILE))
        _write_json(staging / TOKENIZER_CONFIG_FILE, config)
        _write_json(staging / SPECIAL_TOKENS_FILE, special_tokens_map)
        _publish_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Tokenizer(out_dir)


def sentencepiece_only_message(directory: Union[Path, str]) -> Optional[str]:
    """Why `directory` has no usable tokenizer although it holds one (a SentencePiece tokenizer.model alone), and
    the fix; None for any other directory."""
    directory = Path(directory)
    if (directory / TOKENIZER_FILE).is_file() or not (directory / SENTENCEPIECE_FILE).is_file():
        return None
    return (f"{directory} holds a SentencePiece {SENTENCEPIECE_FILE} but no {TOKENIZER_FILE}, the only tokenizer file "
            f"llmtrain reads; write one with transformers in the folder the model was downloaded to "
            f"(AutoTokenizer.from_pretrained(FOLDER).save_pretrained(FOLDER), with the sentencepiece package installed), "
            f"or pass --tokenizer_dir DIR with the model's {TOKENIZER_FILE}")


def read_special_tokens(directory: Union[Path, str]) -> dict[str, str]:
    """The text of the special tokens a tokenizer folder names (bos_token, eos_token, unk_token, pad_token), as
    transformers hands them to a chat template; the first file that says wins."""
    tokens: dict[str, str] = {}
    for name in (TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE):
        data = read_settings(Path(directory) / name)
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            token = _token_content(data.get(key))
            if token is not None:
                tokens.setdefault(key, token)
    return tokens


def _read_special_token_settings(directory: Path) -> dict:
    """bos/eos tokens (as strings), their ids and add_bos_token; the first file that says wins."""
    settings: dict = {key: token for key, token in read_special_tokens(directory).items()
                      if key in ("bos_token", "eos_token")}
    for name in (TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE):
        data = read_settings(directory / name)
        if data.get("add_bos_token") is not None:
            settings.setdefault("add_bos_token", data["add_bos_token"])
    generation = read_settings(directory / GENERATION_CONFIG_FILE)
    for key in ("bos_token_id", "eos_token_id"):
        value = generation.get(key)
        values = value if isinstance(value, list) else [value]
        # NOTE: transformers' generate stops on generation_config's eos_token_id (all of them, when a list) even where
        # tokenizer_config.json names another eos token; the first is the canonical one.
        if key == "eos_token_id":
            settings["stop_token_ids"] = [token_id for token_id in values if isinstance(token_id, int)]
        if values and isinstance(values[0], int):
            settings[key] = values[0]
    return settings


def _token_content(token: Union[str, dict, None]) -> Optional[str]:
    if isinstance(token, dict):  # AddedToken serialized as {"content": ..., "lstrip": ...}
        return token.get("content")
    return token


def _parse_tokenizer(path: Path, content: bytes) -> HFTokenizer:
    """The tokenizer in ``content`` (``path``'s bytes); a ValueError naming the file if the library cannot read it."""
    try:
        return HFTokenizer.from_str(content.decode("utf-8"))
    except Exception as error:  # noqa: BLE001  (the library raises a bare Exception, from its Rust parser)
        raise ValueError(f"{path} is not a tokenizer file the tokenizers library can read ({error}): it is cut short "
                         "or damaged; copy it again from the model it belongs to, or pass another "
                         "--tokenizer_dir") from None


def read_settings(path: Path) -> dict:
    """A settings file's object ({} when absent); a ValueError naming the file when it is no JSON (a file cut short,
    or nested deeper than Python's reader goes)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        problem = "it is nested too deeply" if isinstance(error, RecursionError) else error
        raise ValueError(f"{path} is not a JSON file llmtrain can read ({problem}): fix it, or copy it again from "
                         "the model it belongs to") from None
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _atomic_write_json(path: Path, data: dict) -> None:
    temp = _temp_name(path)
    _write_json(temp, data)
    os.replace(temp, path)


def _atomic_copy(source: Path, target: Path) -> None:
    temp = _temp_name(target)
    shutil.copyfile(source, temp)
    os.replace(temp, target)


def _publish_dir(staging: Path, out_dir: Path) -> None:
    """Move a finished directory into place; readers see either nothing or every file."""
    try:
        os.rename(staging, out_dir)
        return
    except OSError:
        pass  # out_dir exists already (an older copy, or another process won the race)
    out_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: tokenizer.json goes last: its presence is what marks a directory as usable.
    for name in sorted(os.listdir(staging), key=lambda n: n == TOKENIZER_FILE):
        os.replace(staging / name, out_dir / name)
