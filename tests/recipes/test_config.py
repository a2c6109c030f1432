import subprocess
import sys

import pytest

from llmtrain.config import ALIASES, LOCAL_MODELS, MODEL_ZOO, Config, aliases_of, resolve_name


@pytest.mark.parametrize("name", Config.names())
def test_every_zoo_entry_builds(name):
    config = Config.from_name(name)
    assert config.name == name
    assert config.padded_vocab_size >= config.vocab_size
    assert config.n_head % config.n_query_groups == 0
    assert config.rope_n_elem % 2 == 0
    if not name.endswith("-debug") and name not in LOCAL_MODELS:
        assert set(config.hf_config) == {"org", "name"}


def test_names_are_unique_and_listed():
    names = Config.names()
    assert len(names) == len(set(name.lower() for name in names)) == len(MODEL_ZOO)
    for expected in ["tiny-llama-1.1b", "Llama-2-7b-hf", "Meta-Llama-3-8B", "Llama-3.1-405B", "Llama-3.2-1B",
                     "Mistral-7B-v0.1", "Mistral-7B-v0.3", "Qwen2.5-0.5B", "Qwen2.5-72B", "gemma-2b", "gemma-7b",
                     "phi-2", "pythia-14m", "pythia-12b", "SmolLM2-135M", "SmolLM2-1.7B", "llama-debug",
                     "gpt-neox-debug", "phi-debug", "gemma-debug", "qwen2-debug", "mistral-debug"]:
        assert expected in names


def test_debug_configs_are_tiny():
    for name in Config.names():
        if name.endswith("-debug"):
            config = Config.from_name(name)
            assert (config.vocab_size, config.block_size) == (4096, 512)
            assert config.n_layer == (4 if name in ("llama-debug", "moe-debug") else 2)


def test_from_name_is_case_insensitive_and_ignores_org():
    assert Config.from_name("llama-3.2-1b").name == "Llama-3.2-1B"
    assert Config.from_name("meta-llama/Llama-3.2-1B").name == "Llama-3.2-1B"
    # Also found by the Hugging Face repository name where it differs from the zoo name.
    assert Config.from_name("TinyLlama/TinyLlama-1.1B-Chat-v1.0").name == "tiny-llama-1.1b-chat"


def test_from_name_overrides():
    config = Config.from_name("llama-debug", n_layer=1, block_size=64)
    assert (config.n_layer, config.block_size) == (1, 64)
    # Sizes derived from overridden fields are recomputed.
    assert Config.from_name("llama-debug", n_embd=128).head_size == 32


def test_from_name_unknown_suggests_close_names():
    with pytest.raises(ValueError, match="Llama-2-7b-hf") as error:
        Config.from_name("llama-2-7")
    assert "Unknown model name 'llama-2-7'" in str(error.value)
    with pytest.raises(ValueError, match="pythia-70m"):
        Config.from_name("pythia-70")


@pytest.mark.parametrize("alias, canonical", [
    ("tiny-llama", "tiny-llama-1.1b"), ("TinyLlama", "tiny-llama-1.1b"), ("pythia-160m", "pythia-160m"),
    ("llama-3.2-1b", "Llama-3.2-1B"), ("llama-3-8b", "Meta-Llama-3-8B"), ("Llama-3-8B-Instruct", "Meta-Llama-3-8B-Instruct"),
    ("mistral-7b", "Mistral-7B-v0.3"), ("qwen2.5-1.5b", "Qwen2.5-1.5B"), ("gemma-2b", "gemma-2b"), ("phi-2", "phi-2"),
    ("smollm2-135m", "SmolLM2-135M"), ("llama-2-7b", "Llama-2-7b-hf"), ("llama-2-7b-chat", "Llama-2-7b-chat-hf"),
    ("meta-llama/Meta-Llama-3-8B", "Meta-Llama-3-8B"), ("Qwen/Qwen2.5-7B-Instruct", "Qwen2.5-7B-Instruct"),
    ("mixtral-8x7b", "Mixtral-8x7B-v0.1"), ("mixtral-8x22b-instruct", "Mixtral-8x22B-Instruct-v0.1"),
    ("Qwen/Qwen3-30B-A3B", "Qwen3-30B-A3B"), ("qwen3-235b-a22b", "Qwen3-235B-A22B"), ("olmoe", "OLMoE-1B-7B-0924"),
    ("allenai/OLMoE-1B-7B-0924-Instruct", "OLMoE-1B-7B-0924-Instruct"),
])
def test_short_names_litgpt_names_and_hub_ids_resolve(alias, canonical):
    assert resolve_name(alias) == canonical
    assert Config.from_name(alias).name == canonical


def test_a_family_name_with_several_base_models_is_ambiguous_and_lists_them():
    with pytest.raises(ValueError, match="ambiguous: it may mean Llama-3.2-1B, Llama-3.2-3B"):
        resolve_name("llama-3.2")
    with pytest.raises(ValueError, match="ambiguous: it may mean Mistral-7B-v0.1, Mistral-7B-v0.3"):
        resolve_name("Mistral")
    assert resolve_name("phi") == "phi-2"  # one base model: not ambiguous


def test_every_alias_resolves_to_one_zoo_name_or_is_reported_ambiguous():
    names = set(Config.names())
    for alias, candidates in ALIASES.items():
        assert alias == alias.lower() and set(candidates) <= names
        if len(candidates) == 1:
            assert resolve_name(alias) == candidates[0]
            assert alias == candidates[0].lower() or alias in aliases_of(candidates[0])
        else:
            with pytest.raises(ValueError, match="ambiguous"):
                resolve_name(alias)
    for name in names:  # an exact zoo name always wins over an alias that happens to be spelled the same
        assert resolve_name(name) == name


def test_derived_sizes():
    config = Config(n_embd=256, n_head=8, vocab_size=1000, padding_multiple=64)
    assert config.head_size == 32
    assert config.n_query_groups == 8
    assert config.padded_vocab_size == 1024
    assert config.intermediate_size == 1024
    assert Config.from_name("phi-2").rope_n_elem == 32  # 0.4 x 80
    assert Config.from_name("pythia-70m").rope_n_elem == 16  # 0.25 x 64
    assert Config.from_name("pythia-6.9b").padded_vocab_size == 50432
    assert Config.from_name("gemma-7b").head_size == 256


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(n_head=8, n_query_groups=3), "n_head 8 is not divisible by n_query_groups 3"),
        (dict(n_embd=100, n_head=8), "n_embd 100 is not divisible by n_head 8"),
        (dict(norm_class_name="BatchNorm"), "norm_class_name must be one of"),
        (dict(qk_norm="layer"), r"qk_norm must be one of \('none', 'head', 'full'\)"),
        (dict(vocab_size=100, padded_vocab_size=64), "padded_vocab_size 64 is smaller than vocab_size 100"),
        (dict(shared_attention_norm=True), "shared_attention_norm needs parallel_residual"),
        (dict(rope_scaling={"factor": 8.0}), "rope_scaling is missing"),
        (dict(rope_scaling=dict(rope_type="linear", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_seq_len=8192)), r"rope_scaling has unknown keys \['rope_type'\]"),
        (dict(rotary_percentage=0.0), "rotary_percentage must be in"),
        (dict(n_layer=0), "n_layer must be positive"),
    ],
)
def test_validation_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        Config(**fields)


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "phi-2", "gemma-debug"])
def test_yaml_round_trip(tmp_path, name):
    config = Config.from_name(name)
    path = tmp_path / "model_config.yaml"
    config.save(path)
    assert Config.from_file(path) == config
    assert Config.from_file(path).to_dict() == config.to_dict()


def test_from_file_rejects_unknown_fields(tmp_path):
    path = tmp_path / "model_config.yaml"
    path.write_text("n_layr: 3\n")
    with pytest.raises(ValueError, match="n_layr"):
        Config.from_file(path)


def test_import_does_not_import_torch():
    code = "import sys, llmtrain.config; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
