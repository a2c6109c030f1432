"""``llmtrain chat``: talk to a model directory, turn by turn, in its prompt style.

- `TextStream`: the text of a completion as its tokens arrive, printable piece by piece.
- `Chat`: the conversation; each turn renders the whole of it again and streams the reply.
- `setup`: the command line.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional, Sequence, TextIO

import torch

from llmtrain.generate import (PromptTooLongError, check_sampling, decode_completion, generate, strip_stop,
                               load_for_generation)
from llmtrain.convert.hf import ensure_model_dir
from llmtrain.model_dir import check_model_dir
from llmtrain.quantize import QuantizeMode
from llmtrain.precision import PrecisionName

if TYPE_CHECKING:
    from llmtrain.generate import LoadedModel
    from llmtrain.prompts import Message
    from llmtrain.tokenizer import Tokenizer

PROMPT = ">>> "
EXIT_COMMANDS = ("/exit", "/quit", "exit", "quit", "!exit", "!quit")
"""Lines that end the chat instead of going to the model (LitGPT's are !quit and !exit)."""


def setup(
    checkpoint_dir: Path,
    *,
    system: Optional[str] = None,
    max_new_tokens: int = 256,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    quantize: Optional[QuantizeMode] = None,
    precision: Optional[PrecisionName] = None,
    accelerator: Literal["auto", "cpu", "cuda"] = "auto",
    seed: int = 1234,
) -> None:
    """Chat with a model directory, one message per line; a line /exit, /quit, exit, quit, !exit or !quit ends it.

    The model directory is e.g. `out/finetune/lora/final`; replies are streamed. Ctrl-D and Ctrl-C at the prompt end
    the chat too; Ctrl-C during a reply stops that reply. The whole
    conversation is the model's input each turn; when it no longer fits the model's block size, the
    oldest turns are dropped.

    Args:
        checkpoint_dir: Model directory with model.safetensors, model_config.yaml and tokenizer.json, or a
            transformers folder (config.json + safetensors, e.g. from `llmtrain download`).
        system: System message that opens the conversation. Default: the prompt style's own, if any.
        max_new_tokens: Most tokens per reply (fewer if the model's block size ends first).
        temperature: Divides the logits before sampling; 0 picks the most likely token (greedy).
        top_k: Sample only among the k most likely tokens. None: all tokens.
        top_p: Sample only among the most likely tokens whose probabilities add up to top_p (nucleus).
        quantize: Quantize the transformer blocks' weights with bitsandbytes (4-bit NF4/FP4, -dq for
            double quantization, or int8) to save memory.
        precision: auto, 32-true, bf16-true, 16-true, bf16-mixed or 16-mixed. Default (auto): bf16-true on a GPU
            that supports it, else 32-true.
        accelerator: Where to run: auto (GPU if there is one), cpu or cuda.
        seed: Seed of the sampler.
    """
    check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be at least 1, got {max_new_tokens}")
    checkpoint_dir = check_model_dir(ensure_model_dir(Path(checkpoint_dir)))  # a transformers folder: converted
    loaded = load_for_generation(checkpoint_dir, quantize=quantize, precision=precision, accelerator=accelerator)
    chat = Chat(loaded, system=system, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                top_p=top_p, generator=torch.Generator(loaded.device).manual_seed(seed))
    print(f"Chatting in the {loaded.prompt_style.name} prompt style. "
          "/exit or Ctrl-D ends the chat; Ctrl-C stops a reply.", file=sys.stderr)
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):  # not on every platform
            import readline  # noqa: F401  (input() gets line editing and history)
    chat.run(prompt=PROMPT if interactive else "")


class Chat:
    """A conversation with a loaded model: the turns so far, and how to answer the next message."""

    def __init__(self, loaded: LoadedModel, *, system: Optional[str] = None, max_new_tokens: int = 256,
                 temperature: float = 0.8, top_k: Optional[int] = 50, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None, out: Optional[TextIO] = None,
                 notices: Optional[TextIO] = None) -> None:
        self.loaded = loaded
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        self.max_new_tokens = max_new_tokens
        self.out = out if out is not None else sys.stdout
        """Where replies go."""
        self.notices = notices if notices is not None else sys.stderr
        """Where everything else goes: dropped turns, stopped replies, messages too long."""
        self.opening: list[Message] = [{"role": "system", "content": system}] if system is not None else []
        self.history: list[Message] = []
        """The finished turns: a user message and the assistant's reply each."""

    def run(self, prompt: str = PROMPT) -> None:
        """Read messages with input() until an exit command (EXIT_COMMANDS), end of input or Ctrl-C at the prompt,
        answering each."""
        while True:
            try:
                line = input(prompt)
            except (EOFError, KeyboardInterrupt):
                if prompt:
                    self.out.write("\n")  # the shell's prompt starts on a line of its own
                return
            if not line.strip():
                continue
            if line.strip().lower() in EXIT_COMMANDS:
                return
            try:
                self.reply(line)
            except PromptTooLongError as error:
                print(f"error: {error}", file=self.notices)
            except KeyboardInterrupt:  # Ctrl-C before the reply's first token; reply() handles the rest
                print("(stopped)", file=self.notices)

    def reply(self, message: str) -> str:
        """Stream the answer to `message` to `out`; returns it, as the history keeps it.

        Ctrl-C stops the answer where it is: what was printed of it stays in the history (nothing
        does when nothing was printed).
        """
        tokenizer = self.loaded.tokenizer
        prompt_ids = self.prompt_ids(message)
        stop_tokens = self.loaded.prompt_style.stop_tokens(tokenizer)
        stream = TextStream(tokenizer, prompt_ids, stop_tokens, tokenizer.eos_id)

        def show(token_id: int) -> None:
            self.out.write(stream.push(token_id))
            self.out.flush()

        device = self.loaded.device
        stopped = False
        try:
            with self.loaded.precision.autocast(device):
                generate(self.loaded.model, torch.tensor(prompt_ids, dtype=torch.long, device=device),
                         self.max_new_tokens, stop_tokens=stop_tokens, eos_id=tokenizer.eos_id, on_token=show,
                         **self.sampling)
            self.out.write(stream.finish())
            answer = stream.text
        except KeyboardInterrupt:
            answer, stopped = stream.printed, True
        self.out.write("\n")
        self.out.flush()
        if stopped:
            print("(stopped)", file=self.notices)
        if answer or not stopped:
            self.history += [{"role": "user", "content": message}, {"role": "assistant", "content": answer}]
        return answer

    def prompt_ids(self, message: str) -> list[int]:
        """The conversation so far and `message`, rendered and tokenized, within the model's block size.

        While the prompt leaves less room than a reply may take, the oldest turn goes (saying so once);
        the system message and `message` itself always stay. A message too long even alone raises
        PromptTooLongError and leaves the history as it was.
        """
        limit = self.loaded.model.max_seq_length
        # NOTE: a reply as long as max_new_tokens may need most of the block size; keeping half of it
        # for the conversation stops a large --max_new_tokens from dropping every earlier turn.
        room = min(self.max_new_tokens, limit // 2)
        kept = list(self.history)
        while True:
            messages = self.opening + kept + [{"role": "user", "content": message}]
            ids = self.loaded.tokenizer.encode(self.loaded.prompt_style.apply(messages))
            if len(ids) + room <= limit or not kept:
                break
            del kept[:2]
        if len(ids) >= limit:
            raise PromptTooLongError(f"this message makes a prompt of {len(ids)} tokens, but the model holds at "
                                     f"most {limit} including the reply; send a shorter one")
        dropped = (len(self.history) - len(kept)) // 2
        if dropped:
            print(f"(the conversation outgrew the model's {limit} tokens: dropped the oldest "
                  f"{'turn' if dropped == 1 else f'{dropped} turns'})", file=self.notices)
        self.history = kept
        return ids


class TextStream:
    """The text of a completion as its tokens arrive: `push` returns the part that is safe to print now.

    Each push decodes the tokens not yet printed whole, after the prompt and the printed ones (as
    `decode_completion` does), and returns their text, holding back what may still change: a trailing
    "\\ufffd" (a character whose bytes span several tokens) and tokens that may be the start of a stop
    sequence.

    NOTE: printed tokens are never decoded again: a byte-fallback decoder (Llama 2, Mistral, Gemma) turns a whole
    run of byte tokens into "\\ufffd"s once one of them is invalid, which would rewrite text already on the screen.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop_tokens: Sequence[Sequence[int]] = (),
                 eos_id: Optional[int] = None) -> None:
        self.tokenizer, self.prompt_ids = tokenizer, prompt_ids
        self.stop_tokens, self.eos_id = stop_tokens, eos_id
        self.new_ids: list[int] = []
        self.printed = ""
        """What push and finish have returned so far."""
        self.text = ""
        """The whole completion as printed, without its stop sequence, once `finish` has been called."""
        self._done_ids = 0
        """How many of `new_ids` have their whole text in `_done_text` (no character of theirs is incomplete)."""
        self._done_text = ""

    def push(self, token_id: int) -> str:
        self.new_ids.append(token_id)
        return self._advance(len(self.new_ids) - self._stop_prefix_length(), final=False)

    def finish(self) -> str:
        """The rest of the completion, now that no token will follow."""
        new = self._advance(len(self.new_ids), final=True)
        self.text = self.printed
        return new

    def _advance(self, end: int, final: bool) -> str:
        settled = strip_stop(self.new_ids[:end], self.stop_tokens, self.eos_id)
        pending = settled[self._done_ids:]
        text = decode_completion(self.tokenizer, self.prompt_ids + settled[:self._done_ids], pending)
        complete = final or not text.endswith("\ufffd")
        shown = self._done_text + (text if complete else text.rstrip("\ufffd"))
        if complete:
            self._done_ids, self._done_text = len(settled), shown
        # A decoding that rewrote what was printed already prints nothing until it agrees again.
        if not shown.startswith(self.printed):
            return ""
        new, self.printed = shown[len(self.printed):], shown
        return new

    def _stop_prefix_length(self) -> int:
        """How many of the last tokens are the beginning (not the whole) of a stop sequence."""
        longest = 0
        for stop in self.stop_tokens:
            for length in range(min(len(stop) - 1, len(self.new_ids)), longest, -1):
                if self.new_ids[-length:] == list(stop[:length]):
                    longest = length
                    break
        return longest
