import shutil

import pytest
import torch
from hf_reference import hf_model
from llmtrain.convert import state_dict_from_hf

from llmtrain.checkpoint.files import write_model_dir
from llmtrain.generate import generate, generate_text, load_model_dir, sample, setup, top_p_filter
from llmtrain.model import GPT
from llmtrain.prompts import ChatML, save_prompt_style

from conftest import build_model, tiny_config

CACHE_CASES = {
    "mha": tiny_config("llama-debug", n_query_groups=4),
    "gqa": tiny_config("llama-debug"),  # 4 heads, 2 groups
    "mqa": tiny_config("llama-debug", n_query_groups=1),
    "gpt-neox-partial-rope": tiny_config("gpt-neox-debug"),
    "sliding-window": tiny_config("mistral-debug", sliding_window=5),
    "gemma": tiny_config("gemma-debug"),
}


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(1234)


class ScriptedModel(GPT):
    """A GPT whose next token is always the next one of `script`, whatever the input."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(tiny_config("llama-debug", n_layer=1))
        self.script = script

    def forward(self, idx, input_pos=None):
        next_index = int(input_pos[-1]) + 1 - self.prompt_length
        logits = torch.zeros(*idx.shape, self.config.padded_vocab_size)
        logits[:, -1, self.script[next_index]] = 1.0
        return logits


def random_weights(model: torch.nn.Module, std: float = 0.1) -> torch.nn.Module:
    """Randomise every parameter, norms and biases included, so that logits are far from uniform."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
    return model.eval()


def greedy_without_cache(model: GPT, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    tokens = prompt
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_token = model(tokens[None])[0, -1].argmax()
            tokens = torch.cat((tokens, next_token[None]))
    return tokens


# ---- the KV cache in the model --------------------------------------------------------------------


@pytest.mark.parametrize("case", CACHE_CASES)
def test_cached_logits_match_the_full_forward(case):
    config = CACHE_CASES[case]
    model = random_weights(GPT(config))
    idx = torch.randint(0, config.vocab_size, (2, 20))
    with torch.no_grad():
        expected = model(idx)
        model.set_kv_cache(batch_size=2, max_seq_length=24)
        # A prefill, a chunk of three, then one token at a time.
        chunks = [range(0, 9), range(9, 12), *[range(t, t + 1) for t in range(12, 20)]]
        actual = torch.cat([model(idx[:, chunk], input_pos=torch.tensor(chunk)) for chunk in chunks], dim=1)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_kv_cache_is_not_state_and_leaves_training_forward_alone():
    model = build_model(tiny_config("llama-debug"))
    idx = torch.randint(0, 128, (1, 12))
    before = model(idx)
    keys = set(model.state_dict())
    model.set_kv_cache(batch_size=1)
    cache = model.blocks[0].attn.kv_cache
    assert cache.k.shape == (1, 2, 64, 64)  # (B, n_query_groups, max_seq_length, head_size)
    assert set(model.state_dict()) == keys
    torch.testing.assert_close(model(idx), before, rtol=0, atol=0)
    model.clear_kv_cache()
    assert all(block.attn.kv_cache is None for block in model.blocks)
    with pytest.raises(ValueError, match="set_kv_cache"):
        model(idx, input_pos=torch.arange(12))
    with pytest.raises(ValueError, match="block_size 64"):
        model.set_kv_cache(batch_size=1, max_seq_length=65)


# ---- sampling -------------------------------------------------------------------------------------


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    probs = torch.tensor([0.125, 0.5, 0.125, 0.25])  # sorted: 0.5, 0.25, 0.125, 0.125
    assert top_p_filter(probs, 0.75).tolist() == [0.0, 0.5, 0.0, 0.25]  # 0.5 + 0.25 reaches 0.75 exactly
    assert top_p_filter(probs, 0.76).tolist() == [0.125, 0.5, 0.0, 0.25] or \
        top_p_filter(probs, 0.76).tolist() == [0.0, 0.5, 0.125, 0.25]  # a tie: either 0.125 completes the set
    assert top_p_filter(probs, 0.5).tolist() == [0.0, 0.5, 0.0, 0.0]
    assert top_p_filter(probs, 0.1).tolist() == [0.0, 0.5, 0.0, 0.0]  # the most likely token always stays
    assert top_p_filter(probs, 0.99).tolist() == probs.tolist()
    batch = torch.stack((probs, probs.flip(0)))
    assert top_p_filter(batch, 0.75).tolist() == [[0.0, 0.5, 0.0, 0.25], [0.25, 0.0, 0.5, 0.0]]


def test_sample_draws_only_from_the_nucleus_and_top_k():
    logits = torch.tensor([0.125, 0.5, 0.125, 0.25]).log()
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, top_p=0.75, generator=generator) for _ in range(600)])
    counts = torch.bincount(draws, minlength=4)
    assert counts[0] == counts[2] == 0
    assert counts[1] / counts[3] == pytest.approx(2.0, rel=0.25)
    draws = torch.stack([sample(logits, top_k=2, generator=generator) for _ in range(200)])
    assert set(draws.tolist()) == {1, 3}
    assert sample(logits.repeat(3, 1), temperature=0.0).tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="--top_p"):
        sample(logits, top_p=0.0)
    with pytest.raises(ValueError, match="--temperature"):
        sample(logits, temperature=-1.0)


# ---- generate ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return random_weights(GPT(tiny_config("llama-debug")))


def test_greedy_generate_equals_the_argmax_loop_without_cache(model):
    prompt = torch.randint(0, 128, (7,))
    expected = greedy_without_cache(model, prompt, 15)
    assert generate(model, prompt, 15, temperature=0.0).tolist() == expected.tolist()
    # top_k=1 leaves one token to sample: greedy again, through the sampling path.
    generator = torch.Generator().manual_seed(1)
    assert generate(model, prompt, 15, top_k=1, generator=generator).tolist() == expected.tolist()
    assert all(block.attn.kv_cache is None for block in model.blocks)  # the cache lives for one call


def test_sampling_is_reproducible_with_a_seed(model):
    prompt = torch.randint(0, 128, (5,))
    first = generate(model, prompt, 10, temperature=0.0)
    assert generate(model, prompt, 10, temperature=0.0).tolist() == first.tolist()

    def sampled(seed):
        return generate(model, prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(seed)).tolist()

    assert sampled(3) == sampled(3)
    assert sampled(3) != sampled(4)


def test_generation_stops_on_eos_and_on_stop_sequences():
    model = ScriptedModel([5, 6, 5, 7, 2, 8, 9, 10])
    prompt = torch.tensor([5, 7, 11])  # a stop sequence inside the prompt does not count
    model.prompt_length = 3

    def run(**stops):
        return generate(model, prompt, 8, temperature=0.0, **stops).tolist()[3:]

    assert run() == [5, 6, 5, 7, 2, 8, 9, 10]
    assert run(eos_id=2) == [5, 6, 5, 7, 2]
    # The first 5 is not followed by 7: only the second one ends the sequence.
    assert run(stop_tokens=([99, 98], [5, 7])) == [5, 6, 5, 7]
    assert run(stop_tokens=([8, 9],), eos_id=2) == [5, 6, 5, 7, 2]


def test_on_token_sees_each_new_token_as_it_comes_and_can_stop_generation():
    model = ScriptedModel([5, 6, 5, 7, 2, 8])
    model.prompt_length = 2
    seen = []
    out = generate(model, torch.tensor([1, 1]), 8, temperature=0.0, eos_id=2, on_token=seen.append)
    assert seen == out.tolist()[2:] == [5, 6, 5, 7, 2]

    def stop_after_two(token):
        seen.append(token)
        if len(seen) == 2:
            raise KeyboardInterrupt

    seen.clear()
    with pytest.raises(KeyboardInterrupt):
        generate(model, torch.tensor([1, 1]), 8, temperature=0.0, on_token=stop_after_two)
    assert seen == [5, 6]
    assert all(block.attn.kv_cache is None for block in model.blocks)  # the cache went with the call


def test_prompt_too_long_errors_and_output_stops_at_block_size(model):
    with pytest.raises(ValueError, match="64 tokens.*at most 64.*shorten the prompt"):
        generate(model, torch.zeros(64, dtype=torch.long), 5)
    out = generate(model, torch.zeros(60, dtype=torch.long), 20, temperature=0.0)
    assert out.numel() == 64


# ---- against transformers ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-debug", "gpt-neox-debug"])
def test_greedy_generate_matches_transformers(name):
    config = tiny_config(name, n_layer=2)
    torch.manual_seed(0)
    hf = random_weights(hf_model(config))
    hf.generation_config.eos_token_id = None  # random weights: let both run the full 20 tokens
    ours = GPT(config).eval()
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), config), strict=True)

    prompt = torch.randint(0, config.vocab_size, (9,))
    expected = hf.generate(prompt[None], attention_mask=torch.ones(1, 9, dtype=torch.long), do_sample=False,
                           max_new_tokens=20, pad_token_id=0)[0]
    assert expected.numel() == 9 + 20
    assert generate(ours, prompt, 20, temperature=0.0).tolist() == expected.tolist()


# ---- a model directory, end to end ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("generate")
    texts = ["Llamas eat grass and hay. " * 4, "What food do llamas eat? They eat leaves.", "Alpacas hum. " * 3]
    tokenizer = tiny_tokenizer(texts, vocab_size=300)
    config = tiny_config("llama-debug", n_layer=2, block_size=256, vocab_size=tokenizer.vocab_size)
    model = random_weights(GPT(config), std=0.05)
    return write_model_dir(root / "final", state_dict=model.state_dict(), model_config=config,
                           hyperparameters=None, tokenizer=tokenizer)


def test_setup_prints_the_completion(model_dir, capsys):
    setup(model_dir, "What do llamas eat?", max_new_tokens=8, temperature=0.0, accelerator="cpu")
    out, err = capsys.readouterr()
    model, _, tokenizer, prompt_style = load_model_dir(model_dir)
    expected = generate_text(model, tokenizer, prompt_style, "What do llamas eat?", max_new_tokens=8)
    assert out == expected + "\n"
    assert "What do llamas eat?" not in out  # the completion only
    assert "tokens/s" in err


@pytest.mark.parametrize("flags, message", [({"num_samples": 0}, "--num_samples must be at least 1"),
                                            ({"max_new_tokens": -5}, "--max_new_tokens must be at least 1"),
                                            ({"top_p": 1.5}, "top_p"),
                                            ({"prompt": "hay " * 300}, "The prompt has .* tokens.*at most 256")])
def test_setup_refuses_bad_values_before_loading_the_model(model_dir, monkeypatch, flags, message):
    """Nothing printed and exit 0 was what -2 samples did; now every value is checked before the model loads, the
    prompt's length too."""
    import llmtrain.generate as generate_module

    monkeypatch.setattr(generate_module, "load_for_generation", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match=message):
        setup(model_dir, **{"prompt": "Hi", **flags}, accelerator="cpu")


def test_setup_samples_and_quantizes(model_dir, capsys):
    setup(model_dir, "Hi", max_new_tokens=6, num_samples=2, quantize="bnb.nf4", accelerator="cpu", raw=True)
    out, err = capsys.readouterr()
    assert err.count("tokens/s") == 2
    model, *_ = load_model_dir(model_dir, quantize="bnb.nf4")
    assert type(model.blocks[0].attn.q_proj).__name__ == "Linear4bit"


def test_command_line_parses_the_flags(model_dir, capsys):
    from jsonargparse import CLI

    CLI(setup, args=[str(model_dir), "--prompt", "Hi", "--max_new_tokens", "3", "--temperature", "0",
                     "--top_k", "null", "--accelerator", "cpu", "--precision", "32-true"])
    out, err = capsys.readouterr()
    model, _, tokenizer, prompt_style = load_model_dir(model_dir)
    assert out == generate_text(model, tokenizer, prompt_style, "Hi", max_new_tokens=3) + "\n"


def test_load_model_dir_reads_the_prompt_style_and_names_missing_files(model_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    # A checkpoint's own chat template is the one transformers would prompt it with, whatever its family's is.
    (copy / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                                              "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert load_model_dir(copy)[3].apply("Hi") == "<user>Hi<assistant>"
    save_prompt_style("chatml", copy)  # what fine-tuning wrote wins
    assert isinstance(load_model_dir(copy)[3], ChatML)
    for name in ("tokenizer.json", "model.safetensors", "model_config.yaml"):
        (copy / name).unlink()
        with pytest.raises(FileNotFoundError, match=str(copy / name)):
            load_model_dir(copy)
