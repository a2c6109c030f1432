"""``llmtrain generate``: sample text from a model directory, with a KV cache.

The pieces, each usable alone:

- `sample`: one token from the logits (greedy, temperature, top-k, top-p).
- `generate`: token ids in, token ids out; one prefill of the prompt, then one token per step.
- `generate_batch`: the same for several prompts at once, padded on the left (`llmtrain evaluate`'s).
- `load_model_dir` (from llmtrain.model_dir): model, config, tokenizer and prompt style.
- `load_for_generation`: the same on the device and in the precision the flags ask for (also `llmtrain chat`'s).
- `generate_text`: a prompt string in, the completion out (what fine-tuning prints during validation).
- `setup`: the command line.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal, NamedTuple, Optional, Sequence

import torch

from llmtrain.convert.hf import ensure_model_dir
from llmtrain.model_dir import check_model_dir, load_model_dir, read_model_dir
from llmtrain.distributed.parallelize import unwrap
from llmtrain.quantize import QuantizeMode
from llmtrain.precision import PrecisionName

if TYPE_CHECKING:
    from llmtrain.config import Config
    from llmtrain.model import GPT
    from llmtrain.prompts import PromptStyle
    from llmtrain.tokenizer import Tokenizer
    from llmtrain.precision import Precision


class PromptTooLongError(ValueError):
    """The prompt leaves no room for an answer within the model's max_seq_length."""


def setup(
    checkpoint_dir: Path,
    prompt: str = "What food do llamas eat?",
    *,
    max_new_tokens: int = 50,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    num_samples: int = 1,
    quantize: Optional[QuantizeMode] = None,
    precision: Optional[PrecisionName] = None,
    accelerator: Literal["auto", "cpu", "cuda"] = "auto",
    seed: int = 1234,
    raw: bool = False,
) -> None:
    """Generate text from a model directory (e.g. `out/finetune/final`) and print the completion.

    Args:
        checkpoint_dir: Model directory with model.safetensors, model_config.yaml and tokenizer.json, or a
            transformers folder (config.json + safetensors, e.g. from `llmtrain download`).
        prompt: The instruction, written out in the model's prompt style unless --raw.
        max_new_tokens: Most tokens to generate per sample (fewer if the model's block_size ends first).
        temperature: Divides the logits before sampling; 0 picks the most likely token (greedy).
        top_k: Sample only among the k most likely tokens. None: all tokens.
        top_p: Sample only among the most likely tokens whose probabilities add up to top_p (nucleus).
        num_samples: Number of completions to generate, one after the other.
        quantize: Quantize the transformer blocks' weights with bitsandbytes (4-bit NF4/FP4, -dq for
            double quantization, or int8) to save memory.
        precision: auto, 32-true, bf16-true, 16-true, bf16-mixed or 16-mixed. Default (auto): bf16-true on a GPU
            that supports it, else 32-true.
        accelerator: Where to run: auto (GPU if there is one), cpu or cuda.
        seed: Seed of the sampler.
        raw: Give the prompt to the model as it is, without the prompt style's template.
    """
    check_sampling(temperature, top_k, top_p)  # before anything loads: the flags' errors, then the model's
    for name, value in (("--max_new_tokens", max_new_tokens), ("--num_samples", num_samples)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    # A transformers folder (e.g. from `llmtrain download`) is converted once, on the fly, and cached.
    checkpoint_dir = check_model_dir(ensure_model_dir(Path(checkpoint_dir)))
    # The prompt is checked before the weights load (a large model takes minutes).
    config, tokenizer, prompt_style = read_model_dir(checkpoint_dir)
    prompt_ids = tokenizer.encode(prompt if raw else prompt_style.apply(prompt))
    check_prompt_fits(len(prompt_ids), config, config.block_size)
    model, tokenizer, prompt_style, device, precision_setting = load_for_generation(
        checkpoint_dir, quantize=quantize, precision=precision, accelerator=accelerator)
    prompt_ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    stop_tokens = prompt_style.stop_tokens(tokenizer) if not raw else ()
    generator = torch.Generator(device).manual_seed(seed)
    for sample_index in range(num_samples):
        started = time.perf_counter()
        with precision_setting.autocast(device):
            output = generate(
                model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                stop_tokens=stop_tokens, eos_id=tokenizer.eos_id, generator=generator,
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
        new_ids = output[prompt_ids.numel():].tolist()
        print(decode_completion(tokenizer, prompt_ids.tolist(), new_ids, stop_tokens, tokenizer.eos_id), flush=True)
        print(f"Sample {sample_index + 1}: {len(new_ids)} tokens in {elapsed:.2f} s, "
              f"{len(new_ids) / elapsed:.2f} tokens/s", file=sys.stderr)
    if device.type == "cuda":
        print(f"Memory used: {torch.cuda.max_memory_allocated(device) / 1e9:.2f} GB", file=sys.stderr)


class LoadedModel(NamedTuple):
    """A model directory ready to generate from."""

    model: GPT
    tokenizer: Tokenizer
    prompt_style: PromptStyle
    device: torch.device
    precision: Precision


def load_for_generation(checkpoint_dir: Path, *, quantize: Optional[QuantizeMode] = None,
                        precision: Optional[PrecisionName] = None,
                        accelerator: Literal["auto", "cpu", "cuda"] = "auto") -> LoadedModel:
    """The model directory (or transformers folder, converted once) on the device `accelerator` picks, in
    `precision` (default: `default_precision`).

    Says on stderr how long loading took. The flags have the meaning of `llmtrain generate`'s.
    """
    from llmtrain.distributed.runtime import pick_device
    from llmtrain.precision import Precision

    device = pick_device(accelerator, local_rank=0)
    # auto (or unset): bf16 weights where the GPU has them; generation keeps no fp32 master copy to mix with
    precision_setting = Precision(precision if precision not in (None, "auto") else default_precision(device))
    started = time.perf_counter()
    checkpoint_dir = ensure_model_dir(Path(checkpoint_dir))
    model, _, tokenizer, prompt_style = load_model_dir(
        checkpoint_dir, device=device, dtype=precision_setting.param_dtype, quantize=quantize
    )
    print(f"Loaded {checkpoint_dir} in {time.perf_counter() - started:.2f} s", file=sys.stderr)
    return LoadedModel(model, tokenizer, prompt_style, device, precision_setting)


# ------------------------------------------------------------------------------------------ sampling
def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Draw one token id from logits (..., V); returns a long tensor of shape (...).

    temperature 0 is greedy (argmax). Otherwise the logits are divided by `temperature`, cut to the
    `top_k` largest, then to the smallest set of tokens whose probabilities add up to at least `top_p`.
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        probs = top_p_filter(probs, top_p)
    flat = probs.reshape(-1, probs.size(-1))  # (N, V): multinomial wants at most 2 dims
    return torch.multinomial(flat, num_samples=1, generator=generator).view(probs.shape[:-1])


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every probability outside the smallest set of most likely tokens whose sum is >= top_p.

    The result is not renormalised (torch.multinomial does not need it).
    """
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    # A token stays if the tokens more likely than it add up to less than top_p, so the most
    # likely token always stays and the set stops at the first token that reaches top_p.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def check_sampling(temperature: float, top_k: Optional[int], top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"--top_k must be a positive number of tokens or None (all tokens), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"--top_p must be in (0, 1] (1 keeps every token), got {top_p}")


# ------------------------------------------------------------------------------------------ decoding
@torch.inference_mode()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    stop_tokens: Sequence[Sequence[int]] = (),
    eos_id: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    on_token: Optional[Callable[[int], None]] = None,
) -> torch.Tensor:
    """Continue `prompt` (T,) by up to `max_new_tokens` tokens; returns prompt + new tokens (1-D).

    The prompt is run through the model once (prefill), then each new token alone, reusing the
    keys and values in a KV cache that lives only for this call. Generation ends after `eos_id` or
    after any sequence in `stop_tokens` (both are kept in the output), or when the sequence reaches
    the model's max_seq_length, whichever comes first. `on_token` is called with each new token id
    as soon as it is sampled (for streaming); an exception it raises ends generation.
    """
    model = unwrap(model)
    check_sampling(temperature, top_k, top_p)
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(f"generate takes one non-empty prompt of shape (T,), got shape {tuple(prompt.shape)}")
    prompt_length = prompt.numel()
    limit = model.max_seq_length
    check_prompt_fits(prompt_length, model.config, limit)
    max_new_tokens = min(max_new_tokens, limit - prompt_length)
    if max_new_tokens <= 0:
        return prompt.clone()
    stop_sequences = [list(sequence) for sequence in stop_tokens if len(sequence)]
    if eos_id is not None:
        stop_sequences.append([eos_id])

    device = prompt.device
    # NOTE: the last token is returned but never fed back, so the cache needs one slot less.
    model.set_kv_cache(batch_size=1, max_seq_length=prompt_length + max_new_tokens - 1, device=device)
    try:
        input_pos = torch.arange(prompt_length, device=device)
        logits = model(prompt.view(1, -1), input_pos=input_pos)[0, -1]  # (V,)
        new_tokens: list[torch.Tensor] = []
        new_ids: list[int] = []
        while True:
            token = sample(logits, temperature, top_k, top_p, generator)  # ()
            new_tokens.append(token)
            new_ids.append(int(token))
            if on_token is not None:
                on_token(new_ids[-1])
            if len(new_ids) == max_new_tokens or ends_with_stop(new_ids, stop_sequences):
                break
            input_pos = input_pos[-1:] + 1
            logits = model(token.view(1, 1), input_pos=input_pos)[0, -1]
    finally:
        model.clear_kv_cache()
    return torch.cat((prompt, torch.stack(new_tokens).to(prompt.dtype)))


@torch.inference_mode()
def generate_batch(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    done: Optional[Callable[[int, list[int]], bool]] = None,
    generator: Optional[torch.Generator] = None,
) -> list[list[int]]:
    """Continue several prompts together; returns each one's new tokens (a stop id it ended with kept).

    The prompts are padded on the left to the longest, prefilled in one forward and decoded one token per step for
    all rows at once, with one KV cache; the padding is masked (`GPT.forward`'s ``padding``), and a row's positions
    are shifted by its padding, which RoPE's relative positions do not see. A row ends after one of `stop_ids`,
    when ``done(row, new_ids)`` says so, or after `max_new_tokens` (fewer if the longest prompt reaches the
    model's max_seq_length first); the batch ends when every row has.
    """
    model = unwrap(model)
    check_sampling(temperature, top_k, top_p)
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("generate_batch takes one or more non-empty prompts")
    longest, limit = max(map(len, prompts)), model.max_seq_length
    check_prompt_fits(longest, model.config, limit)
    max_new_tokens = min(max_new_tokens, limit - longest)
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    device = model.wte.weight.device
    batch, cache_length = len(prompts), longest + max_new_tokens - 1
    idx = torch.zeros(batch, longest, dtype=torch.long, device=device)
    padding = torch.zeros(batch, cache_length, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        idx[row, longest - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long, device=device)
        padding[row, :longest - len(prompt)] = True
    stops = set(stop_ids)
    new_ids: list[list[int]] = [[] for _ in prompts]
    finished = [False] * batch
    model.set_kv_cache(batch_size=batch, max_seq_length=cache_length, device=device)
    try:
        input_pos = torch.arange(longest, device=device)
        logits = model(idx, input_pos=input_pos, padding=padding)[:, -1]  # (B, V)
        while True:
            tokens = sample(logits, temperature, top_k, top_p, generator)  # (B,)
            for row, token in enumerate(tokens.tolist()):
                if finished[row]:
                    continue
                new_ids[row].append(token)
                finished[row] = (token in stops or len(new_ids[row]) == max_new_tokens
                                 or (done is not None and done(row, new_ids[row])))
            if all(finished):
                break
            input_pos = input_pos[-1:] + 1
            logits = model(tokens.view(batch, 1), input_pos=input_pos, padding=padding)[:, -1]
    finally:
        model.clear_kv_cache()
    return new_ids


def check_prompt_fits(prompt_length: int, config: Config, limit: int) -> None:
    """Raise PromptTooLongError unless a prompt of `prompt_length` tokens leaves room for an answer within `limit`
    tokens (the max_seq_length of a model of `config`)."""
    if prompt_length >= limit:
        raise PromptTooLongError(
            f"The prompt has {prompt_length} tokens, but model {config.name!r} holds at most {limit} "
            f"(block_size {config.block_size}) including the answer; shorten the prompt"
        )


def ends_with_stop(ids: list[int], stop_sequences: Sequence[Sequence[int]]) -> bool:
    """Whether `ids` ends with one of `stop_sequences`."""
    return any(len(ids) >= len(stop) and ids[-len(stop):] == list(stop) for stop in stop_sequences)


def strip_stop(ids: list[int], stop_tokens: Sequence[Sequence[int]], eos_id: Optional[int]) -> list[int]:
    """`ids` without the stop sequence (or eos) it ends with, if any."""
    stops = [list(stop) for stop in stop_tokens if len(stop)] + ([[eos_id]] if eos_id is not None else [])
    for stop in sorted(stops, key=len, reverse=True):
        if len(ids) >= len(stop) and ids[-len(stop):] == stop:
            return ids[:-len(stop)]
    return ids


def decode_completion(tokenizer: Tokenizer, prompt_ids: list[int], new_ids: list[int],
                      stop_tokens: Sequence[Sequence[int]] = (), eos_id: Optional[int] = None) -> str:
    """The text of `new_ids` as it reads after the prompt, without a final stop sequence.

    NOTE: decoding the new ids alone can lose a leading space (SentencePiece tokenizers drop it at
    the start of a text), so decode prompt + completion and cut the prompt's text off the front.
    """
    new_ids = strip_stop(new_ids, stop_tokens, eos_id)
    prompt_text = tokenizer.decode(prompt_ids)
    full_text = tokenizer.decode(prompt_ids + new_ids)
    if full_text.startswith(prompt_text):
        return full_text[len(prompt_text):]
    return tokenizer.decode(new_ids)


def generate_text(
    model: GPT,
    tokenizer: Tokenizer,
    prompt_style: PromptStyle,
    prompt: str,
    *,
    max_new_tokens: int = 100,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> str:
    """The model's answer to `prompt`, written out in `prompt_style` (the stop marker removed).

    Greedy by default, so every rank of a sharded (FSDP) model takes the same number of steps:
    under FSDP all ranks must call this together, with the same prompt and sampling settings.
    The model is put in eval mode for the call and given back in the mode it came in.
    """
    model = unwrap(model)
    device = model.wte.weight.device
    prompt_ids = tokenizer.encode(prompt_style.apply(prompt))
    stop_tokens = prompt_style.stop_tokens(tokenizer)
    was_training = model.training
    model.eval()
    try:
        output = generate(
            model, torch.tensor(prompt_ids, dtype=torch.long, device=device), max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=stop_tokens,
            eos_id=tokenizer.eos_id, generator=generator,
        )
    finally:
        model.train(was_training)
    return decode_completion(tokenizer, prompt_ids, output[len(prompt_ids):].tolist(), stop_tokens, tokenizer.eos_id)


def default_precision(device: torch.device) -> str:
    """bf16 weights on a GPU that supports them, full precision elsewhere."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):  # V100, T4: emulated
        return "bf16-true"
    return "32-true"
