"""llmtrain from Python: ``from llmtrain import LLM`` and the recipes as functions.

- `LLM`: a model directory (or a LoRA checkpoint, a transformers folder, a hub repository) loaded once, then
  ``.generate(prompt)`` and ``.chat(messages)``, whole or streamed. Generation is `llmtrain.generate.generate`'s
  loop, prompts are rendered as ``llmtrain generate`` and ``llmtrain chat`` render them, and streamed text is
  `llmtrain.chat.TextStream`'s: a greedy answer here is the command line's, character for character.
- `pretrain`, `finetune_lora`, `finetune_full`, `merge_lora`, `convert_to_hf`, `convert_from_hf`, `prepare_data`:
  the subcommands, called with the command line's arguments as keyword arguments (a group as a dict,
  ``train={"max_steps": 2}``, or a dotted name, ``**{"train.max_steps": 2}``). They are turned into the command's
  flags and parsed by the command line's own parser (`llmtrain.cli.dispatch`): the same names, defaults, checks and
  messages, and a misspelt name raises the parser's suggestion.

Bad input raises the exception the command line would report in one line (a ValueError or an OSError such as
FileNotFoundError), with the same message; nothing here exits the interpreter.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Optional, Sequence, Union

if TYPE_CHECKING:
    import torch

    from llmtrain.config import Config
    from llmtrain.generate import LoadedModel
    from llmtrain.model import GPT
    from llmtrain.prompts import Message, PromptStyle
    from llmtrain.tokenizer import Tokenizer

__all__ = ["LLM", "pretrain", "finetune_lora", "finetune_full", "merge_lora", "convert_to_hf", "convert_from_hf",
           "prepare_data"]

HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""What a Hugging Face repository id looks like (``ORG/NAME``); a path that exists is never taken for one."""


# ------------------------------------------------------------------------------------------ the model
class LLM:
    """A model loaded for generation. Make one with :meth:`LLM.load`.

    One call generates at a time (the KV cache is the model's): calls from several threads wait for each other.
    """

    def __init__(self, loaded: LoadedModel, checkpoint_dir: Path) -> None:
        self.loaded = loaded
        self.checkpoint_dir = checkpoint_dir
        """The llmtrain model directory (or LoRA checkpoint) the weights came from."""
        self._lock = threading.Lock()

    @classmethod
    def load(cls, model: Union[str, Path], *, accelerator: Literal["auto", "cpu", "cuda"] = "auto",
             precision: Optional[str] = None, quantize: Optional[str] = None,
             access_token: Optional[str] = None, checkpoint_dir: Path = Path("checkpoints")) -> LLM:
        """Load a model for generation.

        Args:
            model: A llmtrain model directory (`out/pretrain/final`), a finetune_lora checkpoint (`step-*/` holding
                only adapters: merged into its base model in memory), a transformers folder (converted once and
                cached, as every command does), or a Hugging Face repository id `ORG/NAME` that is no local path
                (downloaded into `checkpoint_dir`, as `llmtrain download` does).
            accelerator: auto (a GPU if there is one), cpu or cuda.
            precision: auto, 32-true, bf16-true, 16-true, ... as for `llmtrain generate`. Default: bf16-true on a GPU
                that supports it, else 32-true.
            quantize: Quantize the blocks' weights with bitsandbytes (bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq,
                bnb.int8), as `llmtrain generate --quantize`.
            access_token: A Hugging Face token for a gated repository (default: $HF_TOKEN). Only for a repository id.
            checkpoint_dir: Where a repository is downloaded to (`checkpoint_dir/ORG/NAME`).
        """
        from llmtrain.generate import load_for_generation

        path = _local_model_dir(model, access_token=access_token, checkpoint_dir=checkpoint_dir)
        _check_choice("precision", precision, _precision_names())
        _check_choice("quantize", quantize, _quantize_modes())
        if _is_lora_step(path):
            return cls(_load_lora_step(path, accelerator=accelerator, precision=precision, quantize=quantize), path)
        return cls(load_for_generation(path, quantize=quantize, precision=precision, accelerator=accelerator), path)

    @property
    def model(self) -> GPT:
        return self.loaded.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def prompt_style(self) -> PromptStyle:
        """How prompts are written out for the model (the checkpoint's own style)."""
        return self.loaded.prompt_style

    @property
    def config(self) -> Config:
        return self.loaded.model.config

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    def __repr__(self) -> str:
        return f"LLM({str(self.checkpoint_dir)!r}, device={str(self.device)!r}, prompt_style={self.prompt_style.name!r})"

    def generate(self, prompt: str, max_new_tokens: int = 50, *, temperature: float = 0.8, top_k: Optional[int] = 50,
                 top_p: float = 1.0, stop: Union[str, Sequence[str], None] = None, seed: Optional[int] = None,
                 raw: bool = False, stream: bool = False) -> Union[str, Iterator[str]]:
        """The completion of ``prompt``, as ``llmtrain generate`` prints it (the defaults are its flags').

        Args:
            prompt: The instruction, written out in the model's prompt style unless ``raw``.
            max_new_tokens: Most tokens to generate (fewer if the model's block size ends first).
            temperature: Divides the logits before sampling; 0 picks the most likely token (greedy).
            top_k: Sample only among the k most likely tokens. None: all tokens.
            top_p: Sample only among the most likely tokens whose probabilities add up to top_p (nucleus).
            stop: Text (or texts) that ends the completion; it is not part of the returned text.
            seed: Seed of the sampler (the command line's default is 1234). None: torch's global generator.
            raw: Give the prompt to the model as it is, without the prompt style's template.
            stream: Return an iterator of pieces of text, each as soon as it is certain, instead of the whole text;
                joined, the pieces are the text that ``stream=False`` returns.
        """
        from llmtrain.generate import check_prompt_fits

        self._check_sampling(max_new_tokens, temperature, top_k, top_p)
        style = self.prompt_style
        prompt_ids = self.tokenizer.encode(prompt if raw else style.apply(prompt))
        check_prompt_fits(len(prompt_ids), self.config, self.model.max_seq_length)
        stop_tokens = () if raw else style.stop_tokens(self.tokenizer)
        return self._answer(prompt_ids, stop_tokens, stop, stream, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

    def chat(self, messages: Union[str, Sequence[Message]], max_new_tokens: int = 256, *, system: Optional[str] = None,
             temperature: float = 0.8, top_k: Optional[int] = 50, top_p: float = 1.0,
             stop: Union[str, Sequence[str], None] = None, seed: Optional[int] = None,
             stream: bool = False) -> Union[str, Iterator[str]]:
        """The assistant's reply to a conversation, as ``llmtrain chat`` would answer its last message.

        Args:
            messages: One user message, or the conversation: ``{"role": ..., "content": ...}`` dicts, an optional
                system message first, then user and assistant messages alternating, ending with the user's. Rendered
                in the checkpoint's prompt style; when it does not fit the model with room for the reply, the oldest
                turns are dropped (said on stderr), as in ``llmtrain chat``.
            system: The system message, for a conversation that has none (default: the prompt style's own).
            The others: as for :meth:`generate` (``max_new_tokens`` defaults to ``llmtrain chat``'s 256).
        """
        from llmtrain.chat import Chat
        from llmtrain.prompts import split_turns, to_messages

        self._check_sampling(max_new_tokens, temperature, top_k, top_p)
        opening, turns = split_turns(to_messages(messages, system=system))
        last, reply = turns[-1]
        if reply is not None:
            raise ValueError("the conversation ends with an assistant message: end it with the user message to answer")
        conversation = Chat(self.loaded, system=opening, max_new_tokens=max_new_tokens)
        conversation.history = [message for user, answer in turns[:-1]
                                for message in (user, {"role": "assistant", "content": answer})]
        prompt_ids = conversation.prompt_ids(last["content"])  # the conversation as `llmtrain chat` renders it
        stop_tokens = self.prompt_style.stop_tokens(self.tokenizer)
        return self._answer(prompt_ids, stop_tokens, stop, stream, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

    # ---- one answer
    def _check_sampling(self, max_new_tokens: int, temperature: float, top_k: Optional[int], top_p: float) -> None:
        from llmtrain.generate import check_sampling

        check_sampling(temperature, top_k, top_p)
        if max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens must be at least 1, got {max_new_tokens}")

    def _answer(self, prompt_ids: list[int], stop_tokens: Sequence[Sequence[int]], stop: Union[str, Sequence[str], None],
                stream: bool, **sampling: Any) -> Union[str, Iterator[str]]:
        """The completion of ``prompt_ids``: whole, or as an iterator of pieces."""
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if not all(isinstance(text, str) for text in stops):
            raise ValueError(f"stop= takes a text or a list of texts, got {stop!r}")
        if not stream:
            pieces: list[str] = []
            self._complete(prompt_ids, stop_tokens, stops, pieces.append, lambda: False, **sampling)
            return "".join(pieces)
        return self._stream(prompt_ids, stop_tokens, stops, sampling)

    def _complete(self, prompt_ids: list[int], stop_tokens: Sequence[Sequence[int]], stops: list[str],
                  emit: Callable[[str], None], cancelled: Callable[[], bool], *, max_new_tokens: int,
                  temperature: float, top_k: Optional[int], top_p: float, seed: Optional[int]) -> None:
        """Generate, giving ``emit`` each piece of text as soon as it is certain; ``cancelled()`` ends early."""
        import torch

        from llmtrain.chat import TextStream
        from llmtrain.generate import generate

        tokenizer, device = self.tokenizer, self.device
        text = TextStream(tokenizer, prompt_ids, stop_tokens, tokenizer.eos_id)
        cut = _StopTexts(stops)

        def on_token(token_id: int) -> None:
            if cancelled():
                raise _Ended
            emit(cut.push(text.push(token_id)))
            if cut.found:
                raise _Ended

        generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
        with self._lock:
            try:
                with self.loaded.precision.autocast(device):
                    generate(self.model, torch.tensor(prompt_ids, dtype=torch.long, device=device), max_new_tokens,
                             temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=stop_tokens,
                             eos_id=tokenizer.eos_id, generator=generator, on_token=on_token)
            except _Ended:
                if not cut.found:
                    return  # the reader went away
            if not cut.found:
                emit(cut.push(text.finish()))
            emit(cut.finish())

    def _stream(self, prompt_ids: list[int], stop_tokens: Sequence[Sequence[int]], stops: list[str],
                sampling: dict) -> Iterator[str]:
        """The pieces of ``_complete`` as an iterator: generation runs in a thread and hands each piece over.

        The prompt was checked already (by the caller, before this returns): a bad one raises at the call, not at
        the first piece. A reader that stops early (``break``, ``close()``) ends the generation at its next token.
        """
        pieces: queue.Queue = queue.Queue()
        gone = threading.Event()
        done = object()

        def work() -> None:
            try:
                self._complete(prompt_ids, stop_tokens, stops, lambda piece: piece and pieces.put(piece), gone.is_set,
                               **sampling)
                pieces.put(done)
            except BaseException as error:  # noqa: BLE001 (handed to the reader, who raises it)
                pieces.put(error)

        def read() -> Iterator[str]:
            worker = threading.Thread(target=work, name="llmtrain-generate", daemon=True)
            worker.start()
            try:
                while (item := pieces.get()) is not done:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                gone.set()
                worker.join()

        return read()


class _Ended(Exception):
    """Raised from the token callback to end generation: a stop text appeared, or the reader went away."""


class _StopTexts:
    """The completion cut at the first of ``stops``: ``push`` returns the part of the text that can no longer turn
    out to be part of a stop text."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [text for text in stops if text]
        self.text, self.given = "", 0
        self.found = False

    def push(self, piece: str) -> str:
        if self.found:
            return ""
        self.text += piece
        hits = [index for index in (self.text.find(stop) for stop in self.stops) if index >= 0]
        if hits:
            self.found = True
            return self._give(min(hits))
        held = max((length for stop in self.stops for length in range(len(stop) - 1, 0, -1)
                    if self.text.endswith(stop[:length])), default=0)
        return self._give(len(self.text) - held)

    def finish(self) -> str:
        """What is left once no token follows (nothing after a stop text)."""
        return "" if self.found else self._give(len(self.text))

    def _give(self, end: int) -> str:
        piece, self.given = self.text[self.given:max(end, self.given)], max(end, self.given)
        return piece


def _local_model_dir(model: Union[str, Path], *, access_token: Optional[str], checkpoint_dir: Path) -> Path:
    """The llmtrain model directory (or LoRA checkpoint) to load for ``model``: a transformers folder converted, a
    repository id downloaded; a path that is none of them raises the command line's message."""
    from llmtrain.convert.hf import HF_CONFIG_FILE, ensure_model_dir
    from llmtrain.checkpoint import layout
    from llmtrain.model_dir import check_model_dir

    path = Path(model)
    if not path.exists() and _looks_like_repo_id(str(model)):
        from llmtrain.download import download  # NOTE: lazy: huggingface_hub only when a repository is named

        download(str(model), checkpoint_dir=Path(checkpoint_dir), access_token=access_token)  # resumes, or checks
        path = Path(checkpoint_dir) / str(model)
    elif access_token is not None:
        raise ValueError(f"access_token is for a Hugging Face repository id, and {model} is a local path: drop it")
    if _is_lora_step(path):
        return path
    if path.is_dir() and (path / HF_CONFIG_FILE).is_file() and not (path / layout.CONFIG_FILE).is_file():
        path = ensure_model_dir(path)
    return check_model_dir(path)


def _looks_like_repo_id(name: str) -> bool:
    """``ORG/NAME`` whose ORG is not a folder here (``out/fnal`` is a mistyped path, not a repository)."""
    return bool(HUB_REPO_ID.match(name)) and not Path(name.split("/")[0]).exists()


def _is_lora_step(path: Path) -> bool:
    """A finetune_lora step checkpoint: adapters and the settings naming their base model, no merged weights."""
    from llmtrain.checkpoint import layout

    return ((path / layout.LORA_FILE).is_file() and (path / layout.LORA_SETTINGS_FILE).is_file()
            and not (path / layout.MODEL_FILE).is_file())


def _load_lora_step(path: Path, *, accelerator: str, precision: Optional[str], quantize: Optional[str]) -> LoadedModel:
    """A LoRA step checkpoint's adapters merged into its base model (``llmtrain merge_lora``'s weights, in memory)."""
    import sys
    import time

    import torch

    from llmtrain.checkpoint import layout
    from llmtrain.checkpoint.weights import load_full_model_state
    from llmtrain.config import Config
    from llmtrain.distributed.runtime import pick_device
    from llmtrain.generate import LoadedModel, default_precision
    from llmtrain.model import GPT
    from llmtrain.model_dir import merged_lora_weights
    from llmtrain.precision import Precision
    from llmtrain.prompts import checkpoint_prompt_style
    from llmtrain.tokenizer import Tokenizer

    if quantize is not None:
        raise ValueError(f"quantize={quantize!r} loads a model directory's weights; {path} holds only LoRA adapters: "
                         f"merge them first (`llmtrain merge_lora {path}`) and load the merged directory")
    if not (path / layout.TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"{path} has no {layout.TOKENIZER_FILE}: it is not a whole finetune_lora checkpoint")
    device = pick_device(accelerator, local_rank=0)
    setting = Precision(precision if precision not in (None, "auto") else default_precision(device))
    started = time.perf_counter()
    config = Config.from_file(path / layout.CONFIG_FILE)
    weights = merged_lora_weights(path)
    with torch.device("meta"):
        model = GPT(config).to(setting.param_dtype)
    model.to_empty(device=device)
    load_full_model_state(model, {name: tensor.to(setting.param_dtype) for name, tensor in weights.items()})
    model.reset_rope_cache()  # to_empty left the non-persistent RoPE tables uninitialised
    model.eval().requires_grad_(False)
    print(f"Loaded {path} (LoRA adapters merged) in {time.perf_counter() - started:.2f} s", file=sys.stderr)
    return LoadedModel(model, Tokenizer(path), checkpoint_prompt_style(path, config), device, setting)


def _check_choice(name: str, value: Optional[str], choices: Sequence[str]) -> None:
    if value is not None and value not in choices:
        raise ValueError(f"--{name} {value!r}: expected one of {', '.join(repr(choice) for choice in choices)}")


def _precision_names() -> tuple[str, ...]:
    from typing import get_args

    from llmtrain.precision import PrecisionName

    return get_args(PrecisionName)


def _quantize_modes() -> tuple[str, ...]:
    from typing import get_args

    from llmtrain.quantize import QuantizeMode

    return get_args(QuantizeMode)


# ------------------------------------------------------------------------------------------ the recipes
def pretrain(*args: Any, **kwargs: Any) -> Optional[Path]:
    """``llmtrain pretrain``, with its arguments (``llmtrain pretrain --help``); returns the run's final/ (None for
    ``dry_run=True``). ``pretrain("tiny-llama", train={"max_steps": 10})`` = ``llmtrain pretrain tiny-llama
    --train.max_steps 10``."""
    return run_command(["pretrain"], args, kwargs)


def finetune_lora(*args: Any, **kwargs: Any) -> Optional[Path]:
    """``llmtrain finetune_lora CHECKPOINT_DIR ...`` (``llmtrain finetune_lora --help``); returns the run's final/
    (None for ``dry_run=True``)."""
    return run_command(["finetune_lora"], args, kwargs)


def finetune_full(*args: Any, **kwargs: Any) -> Optional[Path]:
    """``llmtrain finetune_full CHECKPOINT_DIR ...`` (``llmtrain finetune_full --help``); returns the run's final/
    (None for ``dry_run=True``)."""
    return run_command(["finetune_full"], args, kwargs)


def merge_lora(*args: Any, **kwargs: Any) -> Path:
    """``llmtrain merge_lora CHECKPOINT_DIR [--out_dir DIR]``; returns the merged model directory."""
    return run_command(["merge_lora"], args, kwargs)


def convert_to_hf(*args: Any, **kwargs: Any) -> Path:
    """``llmtrain convert to_hf CHECKPOINT_DIR OUTPUT_DIR ...``; returns the transformers folder."""
    return run_command(["convert", "to_hf"], args, kwargs)


def convert_from_hf(*args: Any, **kwargs: Any) -> Path:
    """``llmtrain convert from_hf HF_DIR OUTPUT_DIR ...``; returns the llmtrain model directory."""
    return run_command(["convert", "from_hf"], args, kwargs)


def prepare_data(*args: Any, **kwargs: Any) -> Path:
    """``llmtrain prepare_data --data ... --out_dir DIR``; returns the prepared folder."""
    return run_command(["prepare_data"], args, kwargs)


def run_command(words: list[str], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Run the subcommand ``words`` with Python arguments, through the command line's parser.

    Positional ``args`` are the command's arguments in the order of its signature; keyword arguments are its flags.
    A value is written as the command line would take it: a dict is a group of flags (``train={"max_steps": 2}`` is
    ``--train.max_steps 2``) unless it has a ``class_path``; a data module or another dataclass is the whole value;
    a Path or a number is its text.

    Several devices (``devices=2``) start their workers as the command line does, as fresh processes that are handed
    the run (nothing of the calling script runs again in them); this call returns when they are done, and a failed
    worker raises ``WorkerFailedError``.
    """
    import inspect

    from llmtrain.cli import commands, dispatch
    from llmtrain.distributed.launch import record_invocation

    function = commands()[words[0]]
    if isinstance(function, dict):
        function = function[words[1]]
    names = [name for name, parameter in inspect.signature(function).parameters.items()
             if parameter.kind is not parameter.VAR_KEYWORD]
    if len(args) > len(names):
        raise TypeError(f"{' '.join(words)} takes at most {len(names)} positional arguments ({', '.join(names)}), "
                        f"got {len(args)}")
    given = dict(zip(names, args))
    twice = sorted(set(given) & set(kwargs))
    if twice:
        raise TypeError(f"{' '.join(words)} got {', '.join(twice)} both by position and by name")
    parameters = inspect.signature(function).parameters
    argv = list(words)
    config = kwargs.pop("config", None)
    if config is not None:  # first, so that the arguments given beside it override the file's values
        argv += ["--config", str(config)]
    values = {**given, **kwargs}
    # A required argument is positional on the command line, in the signature's order.
    argv += [_text(values.pop(name)) for name, parameter in parameters.items()
             if parameter.default is parameter.empty and values.get(name) is not None]
    for name, value in values.items():
        argv += _flags(name, value)
    record_invocation(argv)
    return dispatch(argv)


def _flags(name: str, value: Any) -> list[str]:
    """The command line words that set ``name`` to ``value``."""
    if isinstance(value, dict) and "class_path" not in value:
        if not value:
            return []
        return [word for key, item in value.items() for word in _flags(f"{name}.{key}", item)]
    return [f"--{name}", _text(value)] if not _text(value).startswith("-") else [f"--{name}={_text(value)}"]


def _text(value: Any) -> str:
    """``value`` as the command line's parser reads it."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (str, Path, int, float)):
        return str(value)
    return json.dumps(_plain(value))


def _plain(value: Any) -> Any:
    """``value`` as JSON: a data module (a subclass, chosen by its class) as class_path and init_args, another
    dataclass as its fields."""
    from llmtrain.data.base import DataModule

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value) if field.init}
        if isinstance(value, DataModule):
            return {"class_path": f"{type(value).__module__}.{type(value).__qualname__}", "init_args": fields}
        return fields
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value
