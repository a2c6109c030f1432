"""Prompt styles: how an instruction or a conversation is written out for a given model family.

A style renders a conversation into *segments*: prompt text (what the model is given) and
response text (what it should learn to write, including any end-of-turn marker). Fine-tuning
tokenizes the segments and masks the prompt; generation renders the prompt with `apply()` and
stops on `stop_tokens()`. Both come from the same rendering, so what the model learns is what
it is asked.

The leading bos token is never part of the rendered text: `Tokenizer.encode` adds it (as the
model's tokenizer_config.json says), so it is not doubled.

A conversation is a list of messages ``{"role": "system" | "user" | "assistant", "content": str}``.
A user message may carry an ``"input"`` (Alpaca's context field); Alpaca gives it its own section,
the other styles append it to the instruction after a blank line.

Importing this module must not import torch: the CLI resolves styles before anything heavy loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Optional, Union

import yaml

from llmtrain.checkpoint.layout import CHAT_TEMPLATE_FILE, PROMPT_STYLE_FILE, TOKENIZER_CONFIG_FILE
from llmtrain.yaml_file import read_yaml

"""Written beside the weights, so that generation and further fine-tuning use the style a model was tuned with."""

Message = dict[str, str]
Prompt = Union[str, list[Message]]
ROLES = ("system", "user", "assistant")


class Segment(NamedTuple):
    """A piece of a rendered conversation."""

    text: str
    is_response: bool
    """True for an assistant turn (the text the loss covers when the prompt is masked)."""


class JinjaTurns(NamedTuple):
    """A style's turns as Jinja expressions, for `PromptStyle.chat_template`. They read `system` (None in a format
    without a system role), `first_user` (the first user message), `message` (the user message), `text` (its
    content, the system message merged in where the format has no system role), `content` (`text` with its `input`)
    and `answer` (an assistant message's content)."""

    prefix: str
    """Text before the first user turn (`PromptStyle.prefix`)."""
    user: str
    """A user turn, without the header that opens the assistant's reply."""
    header: str
    """The header that opens the assistant's reply (`PromptStyle.user` ends with it)."""
    assistant: str
    """An assistant turn (`PromptStyle.assistant`)."""
    merge_system: str = r"merged_system + '\n\n' + text"
    """The first user message's text in a format without a system role (`PromptStyle.merge_system`)."""


@dataclass(frozen=True)
class PromptStyle:
    """Base of every style. Subclasses set `name` and the four pieces of a turn, and are registered by name."""

    system: Optional[str] = None
    """System message for conversations that bring none (e.g. Qwen2.5's "You are Qwen, ...")."""

    name: ClassVar[str] = ""
    supports_system: ClassVar[bool] = True
    """False: the format has no system role; a system message is prepended to the first user message."""
    separator: ClassVar[str] = ""
    """Text between the end of an assistant turn and the next user turn."""
    stop_texts: ClassVar[tuple[str, ...]] = ()
    """End-of-turn markers that end generation, besides the tokenizer's eos token."""

    registry: ClassVar[dict[str, type[PromptStyle]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            PromptStyle.registry[cls.name] = cls

    # ------------------------------------------------------------------------------ what a style defines
    def prefix(self, system: Optional[str], first_user: Message) -> str:
        """Text before the first user turn (typically the system block)."""
        return ""

    def user(self, message: Message, turn: int) -> str:
        """A user turn, through the header that opens the assistant's reply."""
        raise NotImplementedError

    def assistant(self, content: str) -> str:
        """An assistant turn, including its end-of-turn marker."""
        return content

    def merge_system(self, system: str, content: str) -> str:
        """The first user message of a format without a system role."""
        return f"{system}\n\n{content}"

    def jinja_turns(self) -> JinjaTurns:
        """The four pieces of a turn as Jinja expressions (see `JinjaTurns`), for `chat_template`."""
        raise ValueError(f"the {self.name or type(self).__name__!r} prompt style has no Jinja form")

    # ------------------------------------------------------------------------------ shared machinery
    def apply(self, prompt: Prompt, *, input: str = "", system: Optional[str] = None) -> str:
        """The text to give the model: a single instruction (with optional `input`) or a conversation.

        A conversation that ends with a user message ends with the header of the assistant's reply;
        one that ends with an assistant message is rendered in full.
        """
        messages = to_messages(prompt, input=input, system=system)
        return "".join(segment.text for segment in self.render(messages))

    def render(self, messages: list[Message]) -> list[Segment]:
        """Prompt and response segments of a conversation, alternating, in order."""
        system, turns = split_turns(messages)
        system = system if system is not None else self.system
        if system is not None and not self.supports_system:
            first = dict(turns[0][0])
            first["content"] = self.merge_system(system, first["content"])
            turns[0] = (first, turns[0][1])
            system = None
        segments: list[Segment] = []
        text = self.prefix(system, turns[0][0])
        for turn, (user, answer) in enumerate(turns):
            if turn:
                text += self.separator
            text += self.user(user, turn)
            if answer is None:
                break
            segments += [Segment(text, False), Segment(self.assistant(answer), True)]
            text = ""
        if text:
            segments.append(Segment(text, False))
        return segments

    def end_of_turn_texts(self) -> tuple[str, ...]:
        """The markers that end an assistant turn (`stop_texts`)."""
        return self.stop_texts

    def stop_tokens(self, tokenizer: Any) -> tuple[list[int], ...]:
        """Token sequences that end generation: the eos token (and any other that generation_config.json lists)
        and this style's end-of-turn markers."""
        stops = [[token_id] for token_id in tokenizer.stop_ids]
        for text in self.end_of_turn_texts():
            token_id = tokenizer.token_to_id(text)
            ids = [token_id] if token_id is not None else tokenizer.encode(text, bos=False)
            if ids and ids not in stops:
                stops.append(ids)
        return tuple(stops)

    def chat_template(self, bos: bool) -> str:
        """This style as a Jinja chat template: transformers' `apply_chat_template` renders what `apply` renders.

        `bos`: whether the template opens with the bos token. transformers encodes a rendered chat without adding
        special tokens, so it must where llmtrain's tokenizer adds one (`Tokenizer.add_bos`).
        A conversation that ends with a user message gets the assistant's header only with `add_generation_prompt`.
        """
        turns = self.jinja_turns()
        merge = "" if self.supports_system else (
            "{%- set merged_system = system -%}\n{%- set system = none -%}\n")
        merged_text = "" if self.supports_system else (
            "    {%- if loop.first and merged_system is not none -%}\n"
            f"      {{%- set text = {turns.merge_system} -%}}\n"
            "    {%- endif -%}\n")
        return (
            f"{{#- llmtrain's {self.name!r} prompt style -#}}\n"
            "{%- if messages and messages[0]['role'] == 'system' -%}\n"
            "  {%- set system = messages[0]['content'] -%}\n"
            "  {%- set loop_messages = messages[1:] -%}\n"
            "{%- else -%}\n"
            f"  {{%- set system = {_jinja_string(self.system) if self.system is not None else 'none'} -%}}\n"
            "  {%- set loop_messages = messages -%}\n"
            "{%- endif -%}\n"
            "{%- for message in loop_messages -%}\n"
            "  {%- if message['role'] != ['user', 'assistant'][loop.index0 % 2] -%}\n"
            "    {{- raise_exception('after an optional system message, user and assistant messages must alternate, "
            "user first') -}}\n"
            "  {%- endif -%}\n"
            "{%- endfor -%}\n"
            "{%- if not loop_messages -%}\n"
            "  {{- raise_exception('the conversation has no user message') -}}\n"
            "{%- endif -%}\n"
            + ("{{- bos_token -}}\n" if bos else "")
            + merge
            + "{%- set first_user = loop_messages[0] -%}\n"
            f"{{{{- {turns.prefix} -}}}}\n"
            "{%- for message in loop_messages -%}\n"
            "  {%- if message['role'] == 'user' -%}\n"
            "    {%- set text = message['content'] -%}\n"
            + merged_text
            + "    {%- set content = text + ('\\n\\n' + message['input'] if message['input'] else '') -%}\n"
            f"    {{%- if not loop.first -%}}{{{{- {_jinja_string(self.separator)} -}}}}{{%- endif -%}}\n"
            f"    {{{{- {turns.user} -}}}}\n"
            f"    {{%- if not loop.last or add_generation_prompt -%}}{{{{- {turns.header} -}}}}{{%- endif -%}}\n"
            "  {%- else -%}\n"
            "    {%- set answer = message['content'] -%}\n"
            f"    {{{{- {turns.assistant} -}}}}\n"
            "  {%- endif -%}\n"
            "{%- endfor -%}\n")

    # ------------------------------------------------------------------------------ construction
    @classmethod
    def from_name(cls, name: str, **fields: Any) -> PromptStyle:
        """The style registered as `name` ("alpaca", "chatml", ...), with optional fields (`system=`)."""
        key = ALIASES.get(name.lower(), name.lower())
        fields = {**ALIAS_FIELDS.get(name.lower(), {}), **fields}
        if key not in cls.registry:
            close = difflib.get_close_matches(key, list(cls.registry) + list(ALIASES), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"Unknown prompt style {name!r}.{hint} Choose from {sorted(cls.registry)}.")
        return cls.registry[key](**fields)

    @classmethod
    def from_config(cls, config: Any) -> PromptStyle:
        """The style a zoo model was trained with, found from its name (or its Hugging Face repository name).

        Base models get their family's chat format too, so that a fine-tuned base model and the
        family's instruct models are prompted the same way. Debug sizes and unknown models get Alpaca.
        """
        names = [getattr(config, "name", "") or "", (getattr(config, "hf_config", None) or {}).get("name", "")]
        for name in filter(None, names):
            for pattern, style, fields in FAMILY_STYLES:
                if re.search(pattern, name, flags=re.IGNORECASE):
                    return cls.from_name(style, **fields)
        return Alpaca()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PromptStyle:
        values = dict(values)
        if "name" not in values:
            raise ValueError(f"A prompt style needs a 'name' (one of {sorted(cls.registry)}); got {values}")
        return cls.from_name(values.pop("name"), **values)


# ------------------------------------------------------------------------------------------ the styles
@dataclass(frozen=True)
class Default(PromptStyle):
    """Plain continuation: the prompt as it is, the response right after it.

    A longer conversation (a system message, or several turns) cannot be told apart without
    speakers, so it is written as a transcript: "System: ...", "User: ...", "Assistant: ...".
    """

    name: ClassVar[str] = "default"
    separator: ClassVar[str] = "\n\n"

    def render(self, messages: list[Message]) -> list[Segment]:
        system, turns = split_turns(messages)
        if (system if system is not None else self.system) is None and len(turns) == 1:
            user, answer = turns[0]
            return [Segment(user_content(user), False)] + ([Segment(answer, True)] if answer is not None else [])
        return _Transcript(system=self.system).render(messages)

    def user(self, message: Message, turn: int) -> str:
        return user_content(message)

    def jinja_turns(self) -> JinjaTurns:
        plain = "(system is none and loop_messages|length <= 2)"
        return JinjaTurns(prefix=r"'System: ' + system + '\n\n' if system is not none else ''",
                          user=rf"content if {plain} else 'User: ' + content + '\n\n'",
                          header=f"'' if {plain} else 'Assistant:'",
                          assistant=f"answer if {plain} else {JINJA_SPACE_BEFORE}")


@dataclass(frozen=True)
class _Transcript(PromptStyle):
    """Default's form for conversations (not registered: it has no name)."""

    separator: ClassVar[str] = "\n\n"

    def prefix(self, system: Optional[str], first_user: Message) -> str:
        return f"System: {system}\n\n" if system is not None else ""

    def user(self, message: Message, turn: int) -> str:
        return f"User: {user_content(message)}\n\nAssistant:"

    def assistant(self, content: str) -> str:
        return space_before(content)


ALPACA_PREAMBLE = ("Below is an instruction that describes a task. "
                   "Write a response that appropriately completes the request.")
ALPACA_PREAMBLE_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides "
                              "further context. Write a response that appropriately completes the request.")


@dataclass(frozen=True)
class Alpaca(PromptStyle):
    """Stanford Alpaca's template; a system message replaces the preamble, later turns repeat the sections."""

    name: ClassVar[str] = "alpaca"
    separator: ClassVar[str] = "\n\n"

    def prefix(self, system: Optional[str], first_user: Message) -> str:
        if system is None:
            system = ALPACA_PREAMBLE_WITH_INPUT if first_user.get("input") else ALPACA_PREAMBLE
        return f"{system}\n\n"

    def user(self, message: Message, turn: int) -> str:
        text = f"### Instruction:\n{message['content']}\n\n"
        if message.get("input"):
            text += f"### Input:\n{message['input']}\n\n"
        return text + "### Response:\n"

    def jinja_turns(self) -> JinjaTurns:
        preamble = (f"{_jinja_string(ALPACA_PREAMBLE_WITH_INPUT)} if first_user['input'] "
                    f"else {_jinja_string(ALPACA_PREAMBLE)}")
        return JinjaTurns(prefix=rf"(system if system is not none else ({preamble})) + '\n\n'",
                          user=r"'### Instruction:\n' + text + '\n\n' + "
                               r"('### Input:\n' + message['input'] + '\n\n' if message['input'] else '')",
                          header=r"'### Response:\n'", assistant="answer")


@dataclass(frozen=True)
class ChatML(PromptStyle):
    """ChatML, as used by Qwen2.5 and SmolLM2."""

    name: ClassVar[str] = "chatml"
    separator: ClassVar[str] = "\n"
    stop_texts: ClassVar[tuple[str, ...]] = ("<|im_end|>",)

    def prefix(self, system: Optional[str], first_user: Message) -> str:
        return f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""

    def user(self, message: Message, turn: int) -> str:
        return f"<|im_start|>user\n{user_content(message)}<|im_end|>\n<|im_start|>assistant\n"

    def assistant(self, content: str) -> str:
        return f"{content}<|im_end|>"

    def jinja_turns(self) -> JinjaTurns:
        return JinjaTurns(prefix=r"'<|im_start|>system\n' + system + '<|im_end|>\n' if system is not none else ''",
                          user=r"'<|im_start|>user\n' + content + '<|im_end|>\n'",
                          header=r"'<|im_start|>assistant\n'", assistant="answer + '<|im_end|>'")


@dataclass(frozen=True)
class Llama2(PromptStyle):
    """Llama 2 chat: [INST] turns, the system message in a <<SYS>> block inside the first one."""

    name: ClassVar[str] = "llama2"
    supports_system: ClassVar[bool] = False
    separator: ClassVar[str] = "<s>"  # every turn after the first opens with a bos of its own

    def merge_system(self, system: str, content: str) -> str:
        return f"<<SYS>>\n{system}\n<</SYS>>\n\n{content}"

    def user(self, message: Message, turn: int) -> str:
        return f"[INST] {user_content(message).strip()} [/INST]"

    def assistant(self, content: str) -> str:
        return f" {content.strip()} </s>"

    def jinja_turns(self) -> JinjaTurns:
        return JinjaTurns(prefix="''", user="'[INST] ' + content|trim + ' [/INST]'", header="''",
                          assistant="' ' + answer|trim + ' </s>'",
                          merge_system=r"'<<SYS>>\n' + merged_system + '\n<</SYS>>\n\n' + text")


@dataclass(frozen=True)
class Llama3(PromptStyle):
    """Llama 3 instruct: header tokens around each role, <|eot_id|> after each turn (3.1 and later: `Llama31`)."""

    name: ClassVar[str] = "llama3"
    stop_texts: ClassVar[tuple[str, ...]] = ("<|eot_id|>",)

    def prefix(self, system: Optional[str], first_user: Message) -> str:
        return self._header("system") + f"{system.strip()}<|eot_id|>" if system is not None else ""

    def user(self, message: Message, turn: int) -> str:
        return self._header("user") + f"{user_content(message).strip()}<|eot_id|>" + self._header("assistant")

    def assistant(self, content: str) -> str:
        return f"{content.strip()}<|eot_id|>"

    def jinja_turns(self) -> JinjaTurns:
        header = self._jinja_header
        return JinjaTurns(prefix=f"{header('system')} + system|trim + '<|eot_id|>' if system is not none else ''",
                          user=f"{header('user')} + content|trim + '<|eot_id|>'", header=header("assistant"),
                          assistant="answer|trim + '<|eot_id|>'")

    @staticmethod
    def _header(role: str) -> str:
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n"

    @classmethod
    def _jinja_header(cls, role: str) -> str:
        return _jinja_string(cls._header(role))


LLAMA31_DATE = "26 Jul 2024"
"""The "Today Date" Llama 3.1's chat template writes when it is given none."""


@dataclass(frozen=True)
class Llama31(Llama3):
    """Llama 3.1, 3.2 and 3.3 instruct: Llama 3's turns, opened by a system block that is always there and begins
    with the model's knowledge cutoff and today's date, as their chat templates write it."""

    date: Optional[str] = LLAMA31_DATE
    """The "Today Date" line, e.g. "26 Jul 2024". None: the day of rendering, as Llama 3.2's template writes it."""

    name: ClassVar[str] = "llama3.1"

    def prefix(self, system: Optional[str], first_user: Message) -> str:
        date = self.date if self.date is not None else time.strftime("%d %b %Y")
        return (self._header("system") + f"Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
                + f"{(system or '').strip()}<|eot_id|>")

    def jinja_turns(self) -> JinjaTurns:
        # NOTE: transformers gives templates strftime_now, which Llama 3.2's own template uses for the date.
        date = _jinja_string(self.date) if self.date is not None else "strftime_now('%d %b %Y')"
        prefix = (f"{self._jinja_header('system')} + 'Cutting Knowledge Date: December 2023\\nToday Date: ' + {date}"
                  r" + '\n\n' + (system or '')|trim + '<|eot_id|>'")
        return super().jinja_turns()._replace(prefix=prefix)


@dataclass(frozen=True)
class Mistral(PromptStyle):
    """Mistral instruct: [INST] turns, eos after each answer; no system role."""

    name: ClassVar[str] = "mistral"
    supports_system: ClassVar[bool] = False

    def user(self, message: Message, turn: int) -> str:
        return f"[INST] {user_content(message)} [/INST]"

    def assistant(self, content: str) -> str:
        return f"{content}</s>"

    def jinja_turns(self) -> JinjaTurns:
        return JinjaTurns(prefix="''", user="'[INST] ' + content + ' [/INST]'", header="''",
                          assistant="answer + '</s>'")


@dataclass(frozen=True)
class Gemma(PromptStyle):
    """Gemma instruct: user and model turns, each message trimmed (as Gemma's chat template does); no system role."""

    name: ClassVar[str] = "gemma"
    supports_system: ClassVar[bool] = False
    separator: ClassVar[str] = "\n"
    stop_texts: ClassVar[tuple[str, ...]] = ("<end_of_turn>",)

    def user(self, message: Message, turn: int) -> str:
        return f"<start_of_turn>user\n{user_content(message).strip()}<end_of_turn>\n<start_of_turn>model\n"

    def assistant(self, content: str) -> str:
        return f"{content.strip()}<end_of_turn>"

    def jinja_turns(self) -> JinjaTurns:
        return JinjaTurns(prefix="''", user=r"'<start_of_turn>user\n' + content|trim + '<end_of_turn>\n'",
                          header=r"'<start_of_turn>model\n'", assistant="answer|trim + '<end_of_turn>'")


@dataclass(frozen=True)
class Phi(PromptStyle):
    """Phi-2's QA format: "Instruct: ...\\nOutput:"."""

    name: ClassVar[str] = "phi"
    separator: ClassVar[str] = "\n"

    def prefix(self, system: Optional[str], first_user: Message) -> str:
        return f"{system}\n" if system else ""

    def user(self, message: Message, turn: int) -> str:
        return f"Instruct: {user_content(message)}\nOutput:"

    def assistant(self, content: str) -> str:
        return space_before(content)

    def jinja_turns(self) -> JinjaTurns:
        return JinjaTurns(prefix=r"system + '\n' if system else ''", user=r"'Instruct: ' + content + '\n'",
                          header="'Output:'", assistant=JINJA_SPACE_BEFORE)


@dataclass(frozen=True)
class TinyLlama(PromptStyle):
    """TinyLlama chat (Zephyr's format): <|system|>, <|user|>, <|assistant|>, each turn closed by </s>."""

    name: ClassVar[str] = "tinyllama"
    separator: ClassVar[str] = "\n"
    stop_texts: ClassVar[tuple[str, ...]] = ("</s>",)

    def prefix(self, system: Optional[str], first_user: Message) -> str:
        return f"<|system|>\n{system}</s>\n" if system is not None else ""

    def user(self, message: Message, turn: int) -> str:
        return f"<|user|>\n{user_content(message)}</s>\n<|assistant|>\n"

    def assistant(self, content: str) -> str:
        return f"{content}</s>"

    def jinja_turns(self) -> JinjaTurns:
        return JinjaTurns(prefix=r"'<|system|>\n' + system + '</s>\n' if system is not none else ''",
                          user=r"'<|user|>\n' + content + '</s>\n'", header=r"'<|assistant|>\n'",
                          assistant="answer + '</s>'")


@dataclass(frozen=True)
class ChatTemplate(PromptStyle):
    """A checkpoint's own chat template (Jinja), rendered as transformers' `apply_chat_template` renders it.

    The prompt and response segments come from rendering the conversation up to each assistant message
    (with the generation prompt) and through it: the difference is the response.
    """

    template: str = ""
    """The Jinja source, as chat_template.jinja or tokenizer_config.json's chat_template holds it."""
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)
    """bos_token, eos_token, ...: the special tokens' text, which the template may write."""

    name: ClassVar[str] = "chat_template"

    def __post_init__(self) -> None:
        if not self.template:
            raise ValueError("the chat_template style is a checkpoint's own chat template (its chat_template.jinja or "
                             "tokenizer_config.json's chat_template), used when the checkpoint has one; it cannot be "
                             f"named: pass one of {sorted(set(self.registry) - {self.name})}")

    def render(self, messages: list[Message]) -> list[Segment]:
        split_turns(messages)  # the same conversations as every other style, with the same errors
        messages = [{"role": m["role"], "content": user_content(m) if m["role"] == "user" else m["content"]}
                    for m in messages]
        if self.system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system}, *messages]
        try:
            return self._segments(messages)
        except ValueError:
            if messages[0]["role"] != "system":
                raise
        # NOTE: Gemma's and Mistral's instruct templates refuse a system message (Mistral v0.3's writes it before
        # the last user message only, so an answered prompt is not the prompt it answered): it goes before the first
        # user message's text, as the built-in styles of formats without a system role write it.
        system, first, *rest = messages
        return self._segments([{"role": "user", "content": self.merge_system(system["content"], first["content"])},
                               *rest])

    def _segments(self, messages: list[Message]) -> list[Segment]:
        segments: list[Segment] = []
        done = ""
        for end, message in enumerate(messages):
            if message["role"] == "assistant":
                prompt, full = self._render(messages[:end], True), self._render(messages[:end + 1], False)
                segments += [Segment(self._after(done, prompt), False), Segment(self._after(prompt, full), True)]
                done = full
        if messages[-1]["role"] != "assistant":
            segments.append(Segment(self._after(done, self._render(messages, True)), False))
        return segments

    def chat_template(self, bos: bool) -> str:
        """The template itself (it writes its own bos); a `system` default goes before conversations without one."""
        if self.system is None:
            return self.template
        system = f"{{'role': 'system', 'content': {_jinja_string(self.system)}}}"
        return ("{%- if not messages or messages[0]['role'] != 'system' -%}\n"
                f"  {{%- set messages = [{system}] + messages -%}}\n"
                "{%- endif %}" + self.template)

    def end_of_turn_texts(self) -> tuple[str, ...]:
        """What the template writes after an assistant's answer (<|im_end|>, <|eot_id|>, ...), if anything."""
        probe = "PROBE"
        answer = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": probe}])[-1].text
        marker = answer.partition(probe)[2].strip()
        return (marker,) if marker else ()

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            (text,), _ = render_jinja_template([messages], chat_template=self.template,
                                               add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except TemplateError as error:
            raise ValueError(f"the checkpoint's chat template refuses the conversation: {error}") from error
        # The tokenizer adds the leading bos (see the module's docstring).
        return text.removeprefix(self.special_tokens.get("bos_token") or "")

    @staticmethod
    def _after(earlier: str, later: str) -> str:
        if not later.startswith(earlier):
            raise ValueError("the checkpoint's chat template writes a conversation's earlier turns differently once "
                             "later ones follow, so its prompts cannot be told from its responses: pass a built-in "
                             "--prompt_style")
        return later[len(earlier):]


ALIASES = {"plain": "default", "zephyr": "tinyllama", "qwen": "chatml", "qwen2.5": "chatml", "smollm2": "chatml",
           "phi-2": "phi", "phi2": "phi", "llama-2": "llama2", "llama-3": "llama3",
           "llama-3.1": "llama3.1", "llama3.2": "llama3.1", "llama-3.2": "llama3.1", "llama3.3": "llama3.1",
           "llama-3.3": "llama3.1",
           # NOTE: Pythia and GPT-NeoX base models have no chat format; Alpaca is the usual one to tune them with.
           "pythia": "alpaca", "gpt-neox": "alpaca"}
"""Other names users reach for."""

ALIAS_FIELDS: dict[str, dict[str, Any]] = {name: {"date": None} for name in ("llama3.2", "llama-3.2")}
"""Fields an alias sets (those passed along win): Llama 3.2's template writes the day it renders."""

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

FAMILY_STYLES: list[tuple[str, str, dict[str, Any]]] = [
    # Debug sizes come first: "gemma-debug" is not Gemma's tokenizer or format.
    (r"-debug$", "alpaca", {}),
    (r"^(meta-)?llama-3\.[13]", "llama3.1", {}),
    (r"^(meta-)?llama-3\.2", "llama3.2", {}),
    (r"^(meta-)?llama-3", "llama3", {}),
    (r"^llama-2", "llama2", {}),
    (r"^tiny-?llama", "tinyllama", {}),
    (r"^mistral", "mistral", {}),
    (r"^qwen2", "chatml", {"system": QWEN_SYSTEM}),
    (r"^smollm2", "chatml", {"system": SMOLLM2_SYSTEM}),
    (r"^gemma", "gemma", {}),
    (r"^phi-2", "phi", {}),
    (r"^pythia", "alpaca", {}),
]
"""(pattern on the zoo or repository name, style, fields): the first match wins."""


# ------------------------------------------------------------------------------------------ messages
def to_messages(prompt: Prompt, input: str = "", system: Optional[str] = None) -> list[Message]:
    """A conversation from an instruction string or a list of messages."""
    if isinstance(prompt, str):
        user: Message = {"role": "user", "content": prompt}
        if input:
            user["input"] = input
        messages = [user]
    else:
        messages = list(prompt)
        if input:
            raise ValueError("`input` goes with a single instruction; put it in the conversation's user message")
    if system is not None:
        if messages and messages[0].get("role") == "system":
            raise ValueError("the conversation has a system message already; do not pass system= as well")
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def split_turns(messages: list[Message]) -> tuple[Optional[str], list[tuple[Message, Optional[str]]]]:
    """The system message (or None) and (user message, assistant reply or None) pairs.

    Raises ValueError unless the conversation is: an optional system message, then user and
    assistant messages alternating, starting with a user.
    """
    if not messages:
        raise ValueError("the conversation has no messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else type(message).__name__
            raise ValueError(f"message {index} has role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"message {index} ({message['role']}) has no text 'content'")
    system = None
    if messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    turns: list[tuple[Message, Optional[str]]] = []
    for index, message in enumerate(messages):
        expected = "user" if index % 2 == 0 else "assistant"
        if message["role"] != expected:
            where = index + (system is not None)
            raise ValueError(f"message {where} is from {message['role']!r} but {expected!r} was expected: after an "
                             "optional system message, user and assistant messages must alternate, user first")
        if expected == "user":
            turns.append((message, None))
        else:
            turns[-1] = (turns[-1][0], message["content"])
    if not turns:
        raise ValueError("the conversation has no user message")
    return system, turns


def space_before(content: str) -> str:
    """An answer after the one space that separates it from the prompt's last word.

    NOTE: the model learns to write that space, so a reply decoded from it (what chat's history keeps) begins with
    it already; a second one would show the model a conversation it did not write.
    """
    return " " + content.removeprefix(" ")


def user_content(message: Message) -> str:
    """A user message's text, with its `input` (if any) after a blank line."""
    return f"{message['content']}\n\n{message['input']}" if message.get("input") else message["content"]


JINJA_SPACE_BEFORE = "' ' + (answer[1:] if answer.startswith(' ') else answer)"
"""`space_before` in Jinja."""


def _jinja_string(text: str) -> str:
    """`text` as a Jinja string literal (a JSON string is one: Jinja reads its escapes as Python does)."""
    return json.dumps(text, ensure_ascii=False)


# ------------------------------------------------------------------------------------------ files
def save_prompt_style(style: Union[PromptStyle, str], checkpoint_dir: Union[Path, str]) -> Path:
    """Write `prompt_style.yaml` into `checkpoint_dir` atomically; returns its path."""
    style = PromptStyle.from_name(style) if isinstance(style, str) else style
    path = Path(checkpoint_dir) / PROMPT_STYLE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    temp.write_text(yaml.safe_dump(style.to_dict(), sort_keys=False), encoding="utf-8")
    os.replace(temp, path)
    return path


def load_prompt_style(checkpoint_dir: Union[Path, str]) -> PromptStyle:
    path = Path(checkpoint_dir) / PROMPT_STYLE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass the prompt style by name instead")
    values = read_yaml(path)
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a mapping like 'name: alpaca', not {values!r}")
    try:
        return PromptStyle.from_dict(values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from error


def has_prompt_style(checkpoint_dir: Union[Path, str]) -> bool:
    return (Path(checkpoint_dir) / PROMPT_STYLE_FILE).is_file()


def read_chat_template(checkpoint_dir: Union[Path, str]) -> Optional[ChatTemplate]:
    """The directory's own chat template as a style, or None: chat_template.jinja, else tokenizer_config.json's
    chat_template (its "default" one where it holds several), as transformers reads them."""
    from llmtrain.tokenizer import read_settings, read_special_tokens

    checkpoint_dir = Path(checkpoint_dir)
    template = None
    if (checkpoint_dir / CHAT_TEMPLATE_FILE).is_file():
        template = (checkpoint_dir / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    elif (checkpoint_dir / TOKENIZER_CONFIG_FILE).is_file():
        template = read_settings(checkpoint_dir / TOKENIZER_CONFIG_FILE).get("chat_template")
        if isinstance(template, list):  # named ones: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = next((named.get("template") for named in template
                             if isinstance(named, dict) and named.get("name") == "default"), None)
    if not isinstance(template, str) or not template.strip():
        return None
    return ChatTemplate(template=template, special_tokens=read_special_tokens(checkpoint_dir))


def checkpoint_prompt_style(checkpoint_dir: Union[Path, str, None], config: Any) -> PromptStyle:
    """The style a model directory is prompted in: its prompt_style.yaml (written by fine-tuning), else its own chat
    template (which transformers' apply_chat_template would use), else its family's (`PromptStyle.from_config`)."""
    if checkpoint_dir is not None and has_prompt_style(checkpoint_dir):
        return load_prompt_style(checkpoint_dir)
    template = read_chat_template(checkpoint_dir) if checkpoint_dir is not None else None
    return template if template is not None else PromptStyle.from_config(config)


CHAT_TEMPLATE_PROBES: tuple[list[Message], ...] = (
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": " Hello! "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2 + 2?"}],
)
"""Conversations on which a style's chat template must render what the style renders."""


def checked_chat_template(style: PromptStyle, special_tokens: dict[str, str], bos: bool) -> str:
    """`style.chat_template(bos)`, once transformers' rendering of it gives the style's prompts and responses on
    `CHAT_TEMPLATE_PROBES`; raises ValueError naming the style where it does not (or where it has no Jinja form)."""
    template = style.chat_template(bos)
    if isinstance(style, ChatTemplate):
        return template  # the checkpoint's own, as transformers renders it already
    as_rendered = ChatTemplate(template=template, special_tokens=special_tokens)
    for messages in CHAT_TEMPLATE_PROBES:
        if as_rendered.render(messages) != style.render(messages):
            raise ValueError(f"the {style.name!r} prompt style's chat template renders {messages} differently")
    return template
