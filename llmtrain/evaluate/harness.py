"""llmtrain's model as an lm-evaluation-harness language model: `LLMtrainLM`, an ``lm_eval`` `TemplateLM`.

It reads any model directory llmtrain opens (a pretraining or fine-tuning ``final/``, a merged LoRA, a converted
transformers model), without a conversion, and answers lm-eval's three kinds of request:

- ``loglikelihood`` (multiple choice, ...): batches of context + continuation, padded on the right, one forward each;
- ``loglikelihood_rolling`` (perplexity): the text cut into lm-eval's disjoint windows of max_length tokens, scored
  as above;
- ``generate_until``: batches of prompts decoded together with one KV cache (`llmtrain.generate.generate_batch`),
  each row stopping at a stop string, the eos token or ``max_gen_toks``.

Tokenization, truncation, windows, stop strings and the post-processing of answers follow lm-eval's own HFLM, so
that a model scores the same here as HFLM scores its converted transformers folder (tests/evaluate/).
Imported only by ``llmtrain evaluate``: it needs the ``eval`` extra (lm-eval).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from llmtrain.generate import generate_batch

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance

    from llmtrain.generate import LoadedModel

MAX_GEN_TOKS = 256
"""Most tokens a generate_until request gets when its task does not say (lm-eval's HFLM default)."""


class LLMtrainLM(TemplateLM):
    """A loaded llmtrain model directory (`llmtrain.generate.load_for_generation`) answering lm-eval's requests,
    ``batch_size`` requests per forward."""

    def __init__(self, loaded: LoadedModel, batch_size: int = 8, name: str = "llmtrain") -> None:
        super().__init__()
        self.model, self.llm_tokenizer = loaded.model, loaded.tokenizer
        self._device, self.precision = loaded.device, loaded.precision
        self.batch_size = batch_size
        self.name = name
        if self.llm_tokenizer.eos_id is None and self.llm_tokenizer.bos_id is None:
            raise ValueError(f"The tokenizer of {name} defines neither an eos nor a bos token; lm-eval needs one to "
                             "score a text from its start: add eos_token to its tokenizer_config.json")

    # ---- what lm-eval asks of a model ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        tokenizer = self.llm_tokenizer
        return tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.bos_id

    @property
    def prefix_token_id(self) -> int:
        """The token in front of a text scored from its start (HFLM's: bos, else eos)."""
        tokenizer = self.llm_tokenizer
        return tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self.model.max_seq_length

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.name

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        """Token ids of ``string``. None or True: with the tokenizer's own special tokens (a bos where it adds one),
        unless the text already starts with the prefix token; False: without."""
        if add_special_tokens is None and string.startswith(self.llm_tokenizer.decode([self.prefix_token_id])):
            add_special_tokens = False
        return self.llm_tokenizer.encode(string, bos=None if add_special_tokens in (None, True) else False)

    # ---- scoring ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests: list[tuple[Optional[tuple[str, str]], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether greedy decoding gives it) for each (key, context ids,
        continuation ids); longest first, ``batch_size`` at a time, cut on the left to max_length.

        Requests that differ only in their last token (the choices of a multiple-choice question, one token each)
        share one forward: the logits of the longest serve them all, as in HFLM."""
        collator = Collator(requests, sort_fn=lambda request: (-len(request[1] + request[2]),
                                                               tuple(request[1] + request[2])),
                            group_by="contexts", group_fn=lambda request: request[1] + request[2][:-1])
        answers = []
        for chunk in collator.get_batched(n=self.batch_size):
            inputs = []
            for _, context, continuation in chunk:
                if not context or not continuation or len(continuation) > self.max_length:
                    raise ValueError(f"lm-eval asked to score a continuation of {len(continuation)} tokens after "
                                     f"{len(context)}: it must be 1 to max_length {self.max_length} tokens, after "
                                     "at least one")
                inputs.append((context + continuation)[-(self.max_length + 1):][:-1])
            idx = torch.zeros(len(inputs), max(map(len, inputs)), dtype=torch.long)
            for row, ids in enumerate(inputs):
                idx[row, :len(ids)] = torch.tensor(ids)
            with self.precision.autocast(self.device):
                logits = self.model(idx.to(self.device))  # (B, T, V)
            for row, ((key, context, continuation), ids) in enumerate(zip(chunk, inputs)):
                window = logits[row, len(ids) - len(continuation):len(ids)].float().log_softmax(dim=-1)  # (C, V)
                for key, continuation, scores in collator.get_cache(req_str=key, cxt_toks=context,
                                                                    cont_toks=continuation, logits=window[None]):
                    scores = scores[0, -len(continuation):]
                    target = torch.tensor(continuation, device=scores.device)
                    answer = (float(scores.gather(-1, target[:, None]).sum()),
                              bool((scores.argmax(-1) == target).all()))
                    answers.append(answer)
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, answer)
        return collator.get_original(answers)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """The log-probability of each whole text, scored in lm-eval's disjoint windows of max_length tokens."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for window in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, *window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ---- generation ------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each request's answer: its context continued until one of its stop strings (``until``, and the eos
        token's text) or ``max_gen_toks`` tokens, cut before the first stop string. Requests with the same
        generation settings are decoded ``batch_size`` at a time, longest first."""
        tokenizer = self.llm_tokenizer
        eos_text = tokenizer.decode([self.eot_token_id])
        collator = Collator([request.args for request in requests], group_by="gen_kwargs",
                            sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
                            group_fn=lambda args: args[1])
        answers = []
        for chunk in collator.get_batched(n=self.batch_size):
            contexts, settings = zip(*chunk)
            kwargs = normalize_gen_kwargs(settings[0], MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen_toks = kwargs.pop("max_gen_toks")
            room = self.max_length - max_gen_toks
            if room <= 0:
                raise ValueError(f"the task asks for up to {max_gen_toks} generated tokens, but the model holds "
                                 f"{self.max_length} in all; set max_gen_toks lower in the task's generation_kwargs")
            prompts = [self.tok_encode(context)[-room:] for context in contexts]
            stops = [term for term in until if term]

            def done(row: int, new_ids: list[int]) -> bool:
                text = tokenizer.decode(new_ids)
                return any(term in text for term in stops)

            with self.precision.autocast(self.device):
                outputs = generate_batch(
                    self.model, prompts, max_gen_toks, temperature=float(kwargs.get("temperature", 0.0)),
                    top_k=kwargs.get("top_k"), top_p=float(kwargs.get("top_p", 1.0)), stop_ids=tokenizer.stop_ids,
                    done=done)
            for context, setting, new_ids in zip(contexts, settings, outputs):
                text = postprocess_generated_text(tokenizer.decode(new_ids, skip_special_tokens=True), until, None)
                answers.append(text)
                self.cache_hook.add_partial("generate_until", (context, setting), text)
        return collator.get_original(answers)
