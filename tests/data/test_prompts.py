import json
import shutil
import time
from pathlib import Path

import pytest

from llmtrain.config import Config
from llmtrain.prompts import (
    PROMPT_STYLE_FILE, Alpaca, ChatML, ChatTemplate, PromptStyle, Segment, checkpoint_prompt_style, has_prompt_style,
    load_prompt_style, read_chat_template, save_prompt_style,
)
from llmtrain.tokenizer import BPE_EOS_TOKEN, Tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2 + 2?"},
]

# One instruction, as each format's public description writes it (the tokenizer adds a leading bos).
SINGLE = {
    "default": "What is 2 + 2?",
    "alpaca": "Below is an instruction that describes a task. Write a response that appropriately completes the "
              "request.\n\n### Instruction:\nWhat is 2 + 2?\n\n### Response:\n",
    "chatml": "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "llama2": "[INST] What is 2 + 2? [/INST]",
    "llama3": "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    # Llama 3.1's template opens every conversation with a system block: the knowledge cutoff, the date, then
    # the system message (none here).
    "llama3.1": "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                "Today Date: 26 Jul 2024\n\n<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "[INST] What is 2 + 2? [/INST]",
    "gemma": "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n",
    "phi": "Instruct: What is 2 + 2?\nOutput:",
    "tinyllama": "<|user|>\nWhat is 2 + 2?</s>\n<|assistant|>\n",
}

# The conversation above: a system message, one finished exchange, and a question awaiting its answer.
MULTI_TURN = {
    "default": "System: Be brief.\n\nUser: Hi\n\nAssistant: Hello!\n\nUser: What is 2 + 2?\n\nAssistant:",
    "alpaca": "Be brief.\n\n### Instruction:\nHi\n\n### Response:\nHello!\n\n"
              "### Instruction:\nWhat is 2 + 2?\n\n### Response:\n",
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
              "Hello!<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "llama2": "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] What is 2 + 2? [/INST]",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "llama3.1": "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] What is 2 + 2? [/INST]",
    "gemma": "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
             "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n",
    "phi": "Be brief.\nInstruct: Hi\nOutput: Hello!\nInstruct: What is 2 + 2?\nOutput:",
    "tinyllama": "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n"
                 "<|user|>\nWhat is 2 + 2?</s>\n<|assistant|>\n",
}


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer) -> Tokenizer:
    texts = ["<|im_start|>user\nHi<|im_end|> <end_of_turn> What is 2 + 2? 4"] * 20
    return tiny_tokenizer(texts, vocab_size=300)


def test_registry_holds_every_style() -> None:
    # chat_template is a checkpoint's own template, not a format of its own.
    assert set(PromptStyle.registry) - {"chat_template"} == set(SINGLE) == set(MULTI_TURN)


@pytest.mark.parametrize("name", sorted(SINGLE))
def test_single_instruction_renders_exactly(name: str) -> None:
    assert PromptStyle.from_name(name).apply("What is 2 + 2?") == SINGLE[name]


@pytest.mark.parametrize("name", sorted(MULTI_TURN))
def test_conversation_renders_exactly(name: str) -> None:
    style = PromptStyle.from_name(name)
    assert style.apply(CONVERSATION) == MULTI_TURN[name]
    # The same conversation from the instruction form, the system message given separately.
    assert style.apply(CONVERSATION[1:], system="Be brief.") == MULTI_TURN[name]


# The chat templates of the families' instruct models (chat_template in their Hub tokenizer_config.json), with the
# bos and eos tokens they are rendered with.
CHAT_TEMPLATES = {
    "gemma": ("<bos>", "<eos>", (  # google/gemma-7b-it
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
        "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")),
    "llama2": ("<s>", "</s>", (  # meta-llama/Llama-2-7b-chat-hf
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
        "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
        "{% if loop.index0 == 0 and system_message != false %}"
        "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
        "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
        "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
        "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", (  # meta-llama/Meta-Llama-3-8B-Instruct
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
        " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}")),
    "mistral": ("<s>", "</s>", (  # mistralai/Mistral-7B-Instruct-v0.1
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
        "{{ message['content'] + eos_token}}{% else %}"
        "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")),
    "chatml": ("", "<|im_end|>", (  # Qwen/Qwen2.5-7B-Instruct without tools, its default system message left out
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")),
    "tinyllama": ("<s>", "</s>", (  # TinyLlama/TinyLlama-1.1B-Chat-v1.0
        "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
        "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}"
        "\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
        "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
        "{% endfor %}")),
}


@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES))
def test_conversation_renders_as_the_family_chat_template(name: str, tokenizer: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    bos, eos, template = CHAT_TEMPLATES[name]
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer.checkpoint_dir / "tokenizer.json"), bos_token=bos or None, eos_token=eos)
    # Whitespace around the messages, as typed into a chat or decoded from a reply, which some templates trim.
    padded = [{"role": "user", "content": " Hi there \n"}, {"role": "assistant", "content": "\n Hello! \n"},
              {"role": "user", "content": "What is 2 + 2? "}]
    # Gemma's and Mistral's templates refuse a system message.
    conversations = [padded] + ([CONVERSATION] if name not in ("gemma", "mistral") else [])
    for messages in conversations:
        expected = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                    add_generation_prompt=True)
        # The leading bos is the tokenizer's to add, not the style's.
        assert PromptStyle.from_name(name).apply(messages) == expected.removeprefix(bos)


# Styles with a default system message or a date of their own, besides every registered one.
STYLE_VARIANTS = [ChatML(system="You are Qwen."), PromptStyle.from_name("default", system="Note: \"x\" \\ é"),
                  PromptStyle.from_name("llama3.1", date=None), PromptStyle.from_name("alpaca", system="Be kind.")]


@pytest.mark.parametrize("style", [PromptStyle.from_name(name) for name in sorted(SINGLE)] + STYLE_VARIANTS, ids=repr)
def test_chat_template_renders_as_the_style(style: PromptStyle) -> None:
    pytest.importorskip("transformers")
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(messages: list, bos: bool, add_generation_prompt: bool = True) -> str:
        (text,), _ = render_jinja_template([messages], chat_template=style.chat_template(bos), bos_token="<s>",
                                           add_generation_prompt=add_generation_prompt)
        return text

    padded = [{"role": "user", "content": " Hi there \n"}, {"role": "assistant", "content": "\n Hello! \n"},
              {"role": "user", "content": "What is 2 + 2? "}]
    with_input = [{"role": "user", "content": "Sort the numbers.", "input": "3, 1, 2"},
                  {"role": "assistant", "content": " 1, 2, 3"}, {"role": "user", "content": "Reverse them."}]
    finished = CONVERSATION + [{"role": "assistant", "content": "4"}]
    for messages in ([{"role": "user", "content": "What is 2 + 2?"}], CONVERSATION, padded, with_input, finished,
                     finished[1:3]):
        assert render(messages, bos=False) == style.apply(messages)
        assert render(messages, bos=True) == "<s>" + style.apply(messages)
        # Without the generation prompt: the user's turn, less the header of the assistant's reply.
        assert style.apply(messages).startswith(render(messages, bos=False, add_generation_prompt=False))
    assert render(finished, bos=False, add_generation_prompt=False) == style.apply(finished)
    # As ChatTemplate reads it back, the prompts and responses (what fine-tuning masks and trains on) are the same.
    assert ChatTemplate(template=style.chat_template(False)).render(finished) == style.render(finished)
    for messages, error in [([{"role": "assistant", "content": "Hi"}], "user and assistant messages must alternate"),
                            ([{"role": "system", "content": "s"}], "no user message")]:
        with pytest.raises(TemplateError, match=error):
            render(messages, bos=False)


def test_segments_split_prompt_from_response() -> None:
    finished = CONVERSATION + [{"role": "assistant", "content": "4"}]
    assert ChatML().render(finished) == [
        Segment("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                False),
        Segment("Hello!<|im_end|>", True),
        Segment("\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n", False),
        Segment("4<|im_end|>", True),
    ]
    # A finished conversation renders in full, without a new assistant header.
    assert ChatML().apply(finished) == MULTI_TURN["chatml"] + "4<|im_end|>"
    assert [s.is_response for s in PromptStyle.from_name("default").render(finished[1:3])] == [False, True]


def test_input_and_system_fields() -> None:
    assert Alpaca().apply("Sort the numbers.", input="3, 1, 2") == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nSort the numbers.\n\n### Input:\n3, 1, 2\n\n### Response:\n")
    assert PromptStyle.from_name("phi").apply("Sort the numbers.", input="3, 1, 2") == (
        "Instruct: Sort the numbers.\n\n3, 1, 2\nOutput:")
    qwen = ChatML(system="You are Qwen.")
    assert qwen.apply("Hi") == "<|im_start|>system\nYou are Qwen.<|im_end|>\n" + SINGLE["chatml"].replace(
        "What is 2 + 2?", "Hi")
    assert qwen.apply("Hi", system="Other.").startswith("<|im_start|>system\nOther.<|im_end|>")  # a message wins


@pytest.mark.parametrize("messages, error", [
    ([], "no messages"),
    ([{"role": "assistant", "content": "Hi"}], "'user' was expected"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "message 1 is from 'user'"),
    ([{"role": "robot", "content": "a"}], "role 'robot'"),
    ([{"role": "user"}], "no text 'content'"),
    ([{"role": "system", "content": "s"}], "no user message"),
])
def test_malformed_conversations_are_rejected(messages: list, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        ChatML().apply(messages)


@pytest.mark.parametrize("name, style, system", [
    ("Meta-Llama-3-8B-Instruct", "llama3", None),
    ("Llama-3.1-8B", "llama3.1", None),
    ("Llama-3.2-1B-Instruct", "llama3.1", None),
    ("Llama-2-7b-chat-hf", "llama2", None),
    ("Qwen2.5-0.5B-Instruct", "chatml", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    ("SmolLM2-135M-Instruct", "chatml", "You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
    ("gemma-2b-it", "gemma", None),
    ("Mistral-7B-Instruct-v0.3", "mistral", None),
    ("tiny-llama-1.1b-chat", "tinyllama", None),
    ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "tinyllama", None),
    ("phi-2", "phi", None),
    ("pythia-14m", "alpaca", None),
    ("llama-debug", "alpaca", None),
    ("gemma-debug", "alpaca", None),
    ("qwen2-debug", "alpaca", None),
])
def test_from_config_picks_the_family_style(name: str, style: str, system: str) -> None:
    picked = PromptStyle.from_config(Config.from_name(name))
    assert (picked.name, picked.system) == (style, system)


def test_llama_31_and_32_date_their_system_block(tmp_path: Path) -> None:
    # 3.1's template writes a fixed date unless given one; 3.2's writes the day it renders.
    assert PromptStyle.from_config(Config.from_name("Llama-3.1-70B-Instruct")).date == "26 Jul 2024"
    llama32 = PromptStyle.from_config(Config.from_name("Llama-3.2-3B-Instruct"))
    assert llama32.date is None and f"Today Date: {time.strftime('%d %b %Y')}\n\n<|eot_id|>" in llama32.apply("Hi")
    assert PromptStyle.from_name("llama3.1", date="01 Jan 2025").apply("Hi").startswith(
        "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 01 Jan 2025\n\n<|eot_id|>")
    save_prompt_style(llama32, tmp_path)
    assert load_prompt_style(tmp_path) == llama32
    assert PromptStyle.from_name("Llama-3.2").name == "llama3.1"
    # Meta's first 3.1 repositories were named Meta-Llama-3.1-*.
    custom = Config(name="my-model", hf_config={"org": "meta-llama", "name": "Meta-Llama-3.1-8B-Instruct"})
    assert PromptStyle.from_config(custom).name == "llama3.1"


def test_the_llama_32_names_give_llama_32s_format() -> None:
    """--prompt_style llama3.2 rendered Llama 3.1's fixed date, not the day of rendering that Llama 3.2's template
    writes and that a Llama-3.2 model gets by default."""
    llama32 = PromptStyle.from_config(Config.from_name("Llama-3.2-1B-Instruct"))
    for name in ("llama3.2", "Llama-3.2"):
        assert PromptStyle.from_name(name) == llama32
        assert PromptStyle.from_name(name, date="01 Jan 2025").date == "01 Jan 2025"  # a date given still counts
    assert PromptStyle.from_name("llama3.1").date == PromptStyle.from_name("llama3.3").date == "26 Jul 2024"


def test_from_config_of_a_custom_model_and_unknown_names() -> None:
    assert PromptStyle.from_config(Config(name="")).name == "alpaca"
    custom = Config(name="my-model", hf_config={"org": "Qwen", "name": "Qwen2.5-7B-Instruct"})
    assert PromptStyle.from_config(custom).name == "chatml"  # the repository name tells the family
    assert PromptStyle.from_name("Zephyr").name == "tinyllama" and PromptStyle.from_name("pythia").name == "alpaca"
    with pytest.raises(ValueError, match="Did you mean 'chatml'.*Choose from"):
        PromptStyle.from_name("chatm")


def test_stop_tokens(tokenizer: Tokenizer) -> None:
    eos = [tokenizer.eos_id]
    assert Alpaca().stop_tokens(tokenizer) == (eos,)
    assert ChatML().stop_tokens(tokenizer) == (eos, tokenizer.encode("<|im_end|>", bos=False))
    assert PromptStyle.from_name("tinyllama").stop_tokens(tokenizer) == (eos, tokenizer.encode("</s>", bos=False))

    class EndsWithEos(ChatML):  # no name: not registered
        stop_texts = ("<|im_end|>", BPE_EOS_TOKEN)

    # A marker that is one token of the vocabulary stops as that token, and none is listed twice.
    assert EndsWithEos().stop_tokens(tokenizer) == (eos, tokenizer.encode("<|im_end|>", bos=False))
    assert "" not in PromptStyle.registry


def test_save_and_load(tmp_path: Path) -> None:
    assert not has_prompt_style(tmp_path)
    qwen = PromptStyle.from_config(Config.from_name("Qwen2.5-0.5B"))
    path = save_prompt_style(qwen, tmp_path / "final")
    assert path == tmp_path / "final" / PROMPT_STYLE_FILE and has_prompt_style(tmp_path / "final")
    assert load_prompt_style(tmp_path / "final") == qwen
    save_prompt_style("llama3", tmp_path / "final")  # overwrites, by name
    assert load_prompt_style(tmp_path / "final") == PromptStyle.from_name("llama3")
    assert [p.name for p in (tmp_path / "final").iterdir()] == [PROMPT_STYLE_FILE]  # no temporary files left
    (tmp_path / "final" / PROMPT_STYLE_FILE).write_text("name: nope\n")
    with pytest.raises(ValueError, match=f"{PROMPT_STYLE_FILE}.*Unknown prompt style 'nope'"):
        load_prompt_style(tmp_path / "final")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
        load_prompt_style(tmp_path / "missing")


def test_a_custom_style_registers_and_round_trips(tmp_path: Path) -> None:
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass(frozen=True)
    class Shout(PromptStyle):
        name: ClassVar[str] = "test-shout"

        def user(self, message: dict, turn: int) -> str:
            return f"Q: {message['content'].upper()}\nA:"

    try:
        assert PromptStyle.from_name("test-shout").apply("hi") == "Q: HI\nA:"
        save_prompt_style(Shout(system="s"), tmp_path)
        assert load_prompt_style(tmp_path) == Shout(system="s")
    finally:
        PromptStyle.registry.pop("test-shout")


# A format of no family (so no built-in style writes it), written for these tests: bos once, role markers, eos after
# each answer, messages trimmed.
OWN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '@bot: ' + message['content'] | trim + eos_token + '\n' }}"
    "{% else %}{{ '@' + message['role'] + ': ' + message['content'] | trim + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '@bot:' }}{% endif %}")


def with_chat_template(tokenizer: Tokenizer, directory: Path, template: str, jinja_file: bool = False) -> Path:
    """A copy of the tokenizer's folder whose tokenizer_config.json (or chat_template.jinja) holds `template`."""
    shutil.copytree(tokenizer.checkpoint_dir, directory)
    if jinja_file:
        (directory / "chat_template.jinja").write_text(template)
    else:
        settings = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": template}))
    return directory


def test_a_checkpoints_own_chat_template_renders_as_transformers_does(tmp_path: Path, tokenizer: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    directory = with_chat_template(tokenizer, tmp_path / "model", OWN_TEMPLATE)
    # A model of no zoo family would be prompted in Alpaca's format, which it never saw.
    style = checkpoint_prompt_style(directory, Config(name="my-model"))
    assert isinstance(style, ChatTemplate)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    padded = [{"role": "user", "content": " Hi there \n"}, {"role": "assistant", "content": "\n Hello! \n"},
              {"role": "user", "content": "What is 2 + 2? "}]
    for messages in (CONVERSATION, padded, CONVERSATION + [{"role": "assistant", "content": "4"}]):
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=messages[-1]["role"] == "user")
        assert style.apply(messages) == expected.removeprefix("<|bos|>")  # the tokenizer adds the bos
    # The responses are what follows each generation prompt, through the eos: what fine-tuning trains on.
    assert [(s.text, s.is_response) for s in style.render(CONVERSATION + [{"role": "assistant", "content": "4"}])] == [
        ("@system: Be brief.\n@user: Hi\n@bot:", False), (" Hello!<|endoftext|>\n", True),
        ("@user: What is 2 + 2?\n@bot:", False), (" 4<|endoftext|>\n", True)]
    assert style.apply("Sort.", input="3, 1") == "@user: Sort.\n\n3, 1\n@bot:"
    # Exported to transformers, it renders the same, a default system message included.
    for own in (style, ChatTemplate(template=OWN_TEMPLATE, special_tokens=style.special_tokens, system="Be brief.")):
        hf_tokenizer.chat_template = own.chat_template(bos=True)
        expected = hf_tokenizer.apply_chat_template(CONVERSATION[1:], tokenize=False, add_generation_prompt=True)
        assert own.apply(CONVERSATION[1:]) == expected.removeprefix("<|bos|>")
    refuses = ChatTemplate(template="{{ raise_exception('System role not supported') }}")
    with pytest.raises(ValueError, match="chat template refuses the conversation: System role not supported"):
        refuses.apply("Hi", system="Be brief.")


# mistralai/Mistral-7B-Instruct-v0.3's template without its tool calls: the system message goes before the last user
# message only.
MISTRAL_V03_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}{%- endif %}"
    "{%- endfor %}")


def test_a_chat_template_that_refuses_a_system_message_gets_it_in_the_first_user_message() -> None:
    """Gemma's and Mistral's instruct templates refuse a system message (v0.3's moves it to the last user message):
    fine-tuning on records with a system message, which their family styles merge into the first user message,
    failed once the checkpoint's own template became its style."""
    pytest.importorskip("transformers")
    finished = CONVERSATION + [{"role": "assistant", "content": "4"}]
    for name in ("gemma", "mistral"):
        bos, eos, template = CHAT_TEMPLATES[name]
        own = ChatTemplate(template=template, special_tokens={"bos_token": bos, "eos_token": eos})
        assert own.apply(CONVERSATION) == PromptStyle.from_name(name).apply(CONVERSATION) == MULTI_TURN[name]
        assert own.apply("What is 2 + 2?", system="Be brief.") == PromptStyle.from_name(name).apply(
            "What is 2 + 2?", system="Be brief.")
    v03 = ChatTemplate(template=MISTRAL_V03_TEMPLATE, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    assert [(s.text, s.is_response) for s in v03.render(finished)] == [
        ("[INST] Be brief.\n\nHi[/INST]", False), (" Hello!</s>", True),
        ("[INST] What is 2 + 2?[/INST]", False), (" 4</s>", True)]
    # A conversation without a system message renders as the template writes it.
    assert v03.apply(CONVERSATION[1:]) == "[INST] Hi[/INST] Hello!</s>[INST] What is 2 + 2?[/INST]"


def test_a_checkpoints_chat_template_stops_on_its_end_of_turn_token(tmp_path: Path, tokenizer: Tokenizer) -> None:
    chatml = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    style = read_chat_template(with_chat_template(tokenizer, tmp_path / "model", chatml))
    assert style.apply(CONVERSATION) == MULTI_TURN["chatml"]
    assert style.stop_tokens(tokenizer) == ChatML().stop_tokens(tokenizer)
    assert read_chat_template(with_chat_template(tokenizer, tmp_path / "own", OWN_TEMPLATE)).stop_tokens(tokenizer) == (
        [tokenizer.eos_id],)  # it ends an answer with eos: no other marker


def test_which_style_a_checkpoint_gets(tmp_path: Path, tokenizer: Tokenizer) -> None:
    qwen = Config.from_name("Qwen2.5-0.5B-Instruct")
    assert checkpoint_prompt_style(tokenizer.checkpoint_dir, qwen) == PromptStyle.from_config(qwen)  # no template
    assert checkpoint_prompt_style(None, qwen) == PromptStyle.from_config(qwen)
    directory = with_chat_template(tokenizer, tmp_path / "model", OWN_TEMPLATE)
    assert checkpoint_prompt_style(directory, qwen).template == OWN_TEMPLATE  # the checkpoint's own, as transformers
    # chat_template.jinja wins over tokenizer_config.json's, as in transformers; a list holds named templates.
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert checkpoint_prompt_style(directory, qwen).apply("Hi") == "Hi"
    (directory / "chat_template.jinja").unlink()
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": OWN_TEMPLATE}]
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    style = checkpoint_prompt_style(directory, qwen)
    assert style.template == OWN_TEMPLATE and style.special_tokens["eos_token"] == "<|endoftext|>"
    # What fine-tuning saved wins, and a template style saves and loads whole.
    save_prompt_style(style, directory)
    assert load_prompt_style(directory) == style
    save_prompt_style("llama3", directory)
    assert checkpoint_prompt_style(directory, qwen) == PromptStyle.from_name("llama3")
    with pytest.raises(ValueError, match="chat_template style is a checkpoint's own chat template"):
        PromptStyle.from_name("chat_template")
