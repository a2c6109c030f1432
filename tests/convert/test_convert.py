"""Conversion to and from transformers folders: every zoo family, both directions, exactly."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import tokenizers
import torch
from safetensors import safe_open

from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.checkpointer import Checkpointer
from llmtrain.checkpoint.lora import write_lora_settings
from llmtrain.checkpoint.weights import load_weights
from llmtrain.config import MODEL_ZOO, Config
from llmtrain.convert import ADAPTERS, adapter_for_config, ensure_model_dir, from_hf, read_hf_config, to_hf
from llmtrain.convert.adapters import architecture_differences, config_from_hf, zoo_config
from llmtrain.model import GPT
from llmtrain.prompts import (
    QWEN_SYSTEM, Alpaca, ChatML, ChatTemplate, PromptStyle, checkpoint_prompt_style, read_chat_template,
    save_prompt_style,
)
from llmtrain.tokenizer import TOKENIZER_FILES, Tokenizer

from hf_reference import load_transformers, tokens

transformers = pytest.importorskip("transformers")

# bos/eos: the ids of the tokenizer that `tokenizer_dir` trains (special tokens come first).
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, bos_token_id=1, eos_token_id=0)


def rope(theta: float = 10000.0, **fields) -> dict:
    return {"rope_type": "default", "rope_theta": theta, **fields}


# One small transformers model per zoo family and variant (RoPE scaling, tied embeddings, sliding window, ...).
HF_CASES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=2, rms_norm_eps=1e-5,
                                              rope_parameters=rope()),
    "llama-3.1-rope-scaling": lambda: transformers.LlamaConfig(
        **COMMON, num_key_value_heads=2, rope_parameters=rope(500000.0, rope_type="llama3", factor=8.0,
                                                              low_freq_factor=1.0, high_freq_factor=4.0,
                                                              original_max_position_embeddings=32)),
    "llama-3.2-rope-scaling-tied-head-dim": lambda: transformers.LlamaConfig(
        **COMMON, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
        rope_parameters=rope(500000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=32)),
    "smollm2-tied": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=True,
                                                     rope_parameters=rope(100000.0)),
    "llama-bias": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=4, attention_bias=True,
                                                   mlp_bias=True, rope_parameters=rope()),
    "mistral-sliding-window": lambda: transformers.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=8,
                                                                 rope_parameters=rope()),
    "qwen2-tied": lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True,
                                                   rope_parameters=rope(1000000.0)),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=2, rope_parameters=rope(1000000.0)),
    "gemma": lambda: transformers.GemmaConfig(**COMMON, num_key_value_heads=1, head_dim=32,
                                              hidden_act="gelu_pytorch_tanh", rope_parameters=rope()),
    "phi": lambda: transformers.PhiConfig(**COMMON, rope_parameters=rope(20000.0, partial_rotary_factor=0.5),
                                          hidden_act="gelu_new"),
    "gpt-neox-sequential-residual": lambda: transformers.GPTNeoXConfig(
        **COMMON, rope_parameters=rope(20000.0, partial_rotary_factor=0.5), hidden_act="gelu_new",
        use_parallel_residual=False),
    # Mixtures of experts: 4 experts, 2 per token; renormalised (Mixtral, Qwen3-MoE here) or not (OLMoE).
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_key_value_heads=2, num_local_experts=4,
                                                  num_experts_per_tok=2, rope_parameters=rope(1000000.0)),
    "qwen3-moe-qk-norm-per-head": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True, rope_parameters=rope(1000000.0)),
    "olmoe-qk-norm-whole": lambda: transformers.OlmoeConfig(**COMMON, num_key_value_heads=2, num_experts=4,
                                                            num_experts_per_tok=2, rope_parameters=rope()),
    # The sizes of the zoo's gpt-neox-debug, so that from_hf finds it in the zoo.
    "gpt-neox": lambda: transformers.GPTNeoXConfig(
        vocab_size=4096, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=0, rope_parameters=rope(partial_rotary_factor=0.25),
        hidden_act="gelu"),
}


def feature_family(config: Config) -> str:
    """The first family whose features fit: what a model without a Hub organization is exported as."""
    return next(adapter.family for adapter in ADAPTERS.values() if not adapter.mismatches(config))


def variant(family: str, config: Config) -> tuple:
    return (family, config.rope_scaling is not None, config.tie_embeddings, config.sliding_window is not None,
            config.bias)


def case_config(case: str) -> tuple[str, Config]:
    hf_config = HF_CASES[case]()
    hf_config.architectures = [type(hf_config).__name__.replace("Config", "ForCausalLM")]
    adapter, config = config_from_hf(hf_config.to_dict(), Path(case) / "config.json")
    return adapter.family, config


# ---- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_tokenizer) -> Path:
    texts = ["The quick brown fox jumps over the lazy dog.", "A model directory holds weights and a tokenizer.",
             "Transformers folders hold config.json and safetensors shards."] * 20
    return tiny_tokenizer(texts, vocab_size=300).checkpoint_dir


def build_hf_model(case: str, seed: int = 0):
    hf_config = HF_CASES[case]()
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, type(hf_config).__name__.replace("Config", "ForCausalLM"))(hf_config).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms and biases too, so that no wiring mistake hides
            param.normal_(0.0, 0.1)
    return model


def save_hf(model, directory: Path, tokenizer_dir: Path, **save_kwargs) -> Path:
    model.save_pretrained(directory, **save_kwargs)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory, tokenizer_dir):
    """A transformers Llama folder and its llmtrain conversion, shared by the tests that need any model."""
    root = tmp_path_factory.mktemp("llama")
    hf_dir = save_hf(build_hf_model("llama"), root / "hf", tokenizer_dir)
    return hf_dir, from_hf(hf_dir, root / "llmtrain")


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


def load_llmtrain(directory: Path) -> GPT:
    model = GPT(Config.from_file(directory / layout.CONFIG_FILE)).eval()
    load_weights(model, directory)
    return model


# ---- every family, both directions ----------------------------------------------------------------


@pytest.mark.parametrize("case", HF_CASES)
def test_round_trip_is_exact(case, tmp_path, tokenizer_dir):
    hf = build_hf_model(case)
    hf_dir = save_hf(hf, tmp_path / "hf", tokenizer_dir)
    idx = tokens()
    with torch.no_grad():
        expected = hf(idx).logits

    ours_dir = from_hf(hf_dir, tmp_path / "llmtrain")
    ours = load_llmtrain(ours_dir)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), expected, atol=1e-5, rtol=1e-5)
    assert Tokenizer(ours_dir).encode("the lazy fox") == Tokenizer(tokenizer_dir).encode("the lazy fox")

    back_dir = to_hf(ours_dir, tmp_path / "back")
    assert_same_tensors(hf_tensors(back_dir), hf_tensors(hf_dir))
    assert json.loads((back_dir / "config.json").read_text())["architectures"] == hf.config.architectures
    reloaded = load_transformers(back_dir)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(idx).logits, expected, atol=1e-6, rtol=1e-6)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(back_dir)
    assert hf_tokenizer("the lazy fox")["input_ids"] == Tokenizer(ours_dir).encode("the lazy fox")
    # And back again, now from the Hub layout of config.json that to_hf writes.
    assert not architecture_differences(read_hf_config(back_dir)[1], ours.config)


def test_zoo_debug_size_is_found_in_the_zoo(tmp_path, tokenizer_dir):
    hf_dir = save_hf(build_hf_model("gpt-neox"), tmp_path / "hf", tokenizer_dir)
    assert Config.from_file(from_hf(hf_dir, tmp_path / "found") / layout.CONFIG_FILE).name == "gpt-neox-debug"
    named = from_hf(hf_dir, tmp_path / "named", model_name="gpt-neox-debug")
    assert Config.from_file(named / layout.CONFIG_FILE).name == "gpt-neox-debug"
    with pytest.raises(ValueError, match=r"--model_name pythia-14m does not describe .*n_layer 6 vs 2"):
        from_hf(hf_dir, tmp_path / "wrong", model_name="pythia-14m")


def test_every_zoo_family_and_variant_has_a_round_trip_case():
    """A family or feature the zoo gains without a conversion case fails here, not silently in use."""
    cases = {variant(*case_config(case)) for case in HF_CASES}
    zoo = {variant(feature_family(Config(**entry)), Config(**entry)) for entry in MODEL_ZOO}
    assert not zoo - cases, f"zoo variants without a conversion test case: {sorted(zoo - cases)}"


@pytest.mark.parametrize("name", [entry["name"] for entry in MODEL_ZOO])
def test_every_zoo_config_survives_config_json(name):
    config = Config.from_name(name)
    adapter = adapter_for_config(config)
    read_adapter, read = config_from_hf(adapter.hf_config(config), Path(name) / "config.json")
    assert read_adapter is adapter
    assert not architecture_differences(read, config)
    assert zoo_config(read, hints=[config.hf_config.get("name", name)]).name == name


def _qwen25_instruct(n_layer: int, n_embd: int, n_head: int, groups: int, intermediate: int) -> dict:
    return dict(architectures=["Qwen2ForCausalLM"], hidden_act="silu", hidden_size=n_embd,
                intermediate_size=intermediate, max_position_embeddings=32768, max_window_layers=70,
                num_attention_heads=n_head, num_hidden_layers=n_layer, num_key_value_heads=groups, rms_norm_eps=1e-6,
                rope_theta=1000000.0, sliding_window=131072, tie_word_embeddings=False, use_sliding_window=False,
                vocab_size=152064)


# The architecture fields of published config.json files (the Hugging Face Hub's, as of their last revision).
PUBLISHED_CONFIGS = {
    "Qwen2.5-14B-Instruct": _qwen25_instruct(48, 5120, 40, 8, 13824),
    "Qwen2.5-32B-Instruct": _qwen25_instruct(64, 5120, 40, 8, 27648),
    "Qwen2.5-72B-Instruct": _qwen25_instruct(80, 8192, 64, 8, 29568),
    "Qwen2.5-72B": {**_qwen25_instruct(80, 8192, 64, 8, 29568), "rms_norm_eps": 1e-5, "max_window_layers": 80,
                    "max_position_embeddings": 131072},
    "Llama-3.2-1B": dict(architectures=["LlamaForCausalLM"], hidden_act="silu", hidden_size=2048, head_dim=64,
                         intermediate_size=8192, max_position_embeddings=131072, num_attention_heads=32,
                         num_hidden_layers=16, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                           original_max_position_embeddings=8192, rope_type="llama3"),
                         tie_word_embeddings=True, vocab_size=128256),
    "Mistral-7B-v0.1": dict(architectures=["MistralForCausalLM"], hidden_act="silu", hidden_size=4096,
                            intermediate_size=14336, max_position_embeddings=32768, num_attention_heads=32,
                            num_hidden_layers=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                            sliding_window=4096, tie_word_embeddings=False, vocab_size=32000),
    "phi-2": dict(architectures=["PhiForCausalLM"], hidden_act="gelu_new", hidden_size=2560, intermediate_size=10240,
                  layer_norm_eps=1e-5, max_position_embeddings=2048, num_attention_heads=32, num_hidden_layers=32,
                  num_key_value_heads=32, partial_rotary_factor=0.4, qk_layernorm=False, rope_theta=10000.0,
                  tie_word_embeddings=False, vocab_size=51200),
    "Mixtral-8x7B-v0.1": dict(architectures=["MixtralForCausalLM"], hidden_act="silu", hidden_size=4096,
                              intermediate_size=14336, max_position_embeddings=32768, num_attention_heads=32,
                              num_experts_per_tok=2, num_hidden_layers=32, num_key_value_heads=8, num_local_experts=8,
                              output_router_logits=False, rms_norm_eps=1e-5, rope_theta=1000000.0,
                              router_aux_loss_coef=0.02, sliding_window=None, tie_word_embeddings=False,
                              vocab_size=32000),
    "Qwen3-30B-A3B": dict(architectures=["Qwen3MoeForCausalLM"], attention_bias=False, decoder_sparse_step=1,
                          head_dim=128, hidden_act="silu", hidden_size=2048, intermediate_size=6144,
                          max_position_embeddings=40960, max_window_layers=48, mlp_only_layers=[],
                          moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32, num_experts=128,
                          num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4, rms_norm_eps=1e-6,
                          rope_scaling=None, rope_theta=1000000.0, router_aux_loss_coef=0.001, sliding_window=None,
                          tie_word_embeddings=False, use_sliding_window=False, vocab_size=151936),
    "OLMoE-1B-7B-0924": dict(architectures=["OlmoeForCausalLM"], attention_bias=False, clip_qkv=None,
                             hidden_act="silu", hidden_size=2048, intermediate_size=1024, max_position_embeddings=4096,
                             norm_topk_prob=False, num_attention_heads=16, num_experts=64, num_experts_per_tok=8,
                             num_hidden_layers=16, num_key_value_heads=16, rms_norm_eps=1e-5, rope_scaling=None,
                             rope_theta=10000.0, router_aux_loss_coef=0.01, tie_word_embeddings=False,
                             vocab_size=50304),
}


@pytest.mark.parametrize("name", PUBLISHED_CONFIGS)
def test_zoo_entries_agree_with_their_published_config_json(name):
    _, published = config_from_hf(PUBLISHED_CONFIGS[name], Path(name) / "config.json")
    assert not architecture_differences(Config.from_name(name), published)
    with_name = config_from_hf({**PUBLISHED_CONFIGS[name], "_name_or_path": f"org/{name}"}, Path("config.json"))[1]
    assert zoo_config(with_name, hints=[name]).name == name


def test_hub_organization_picks_the_published_architecture():
    assert adapter_for_config(Config.from_name("Mistral-7B-v0.3")).architecture == "MistralForCausalLM"
    assert adapter_for_config(Config.from_name("Llama-2-7b-hf")).architecture == "LlamaForCausalLM"
    custom = Config.from_name("Mistral-7B-v0.3", hf_config={})
    assert adapter_for_config(custom).architecture == "LlamaForCausalLM"  # the same model to transformers


# ---- layouts: shards, .bin, sharded and LoRA checkpoints, dtype ------------------------------------


def test_sharded_output_with_index_loads(tmp_path, llama_dirs):
    hf_dir, ours_dir = llama_dirs
    for size in ("0", "0KB", "five"):  # before anything is read or written
        with pytest.raises(ValueError, match="--max_shard_size"):
            to_hf(ours_dir, tmp_path / "never", max_shard_size=size)
    assert not (tmp_path / "never").exists()
    out = to_hf(ours_dir, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {shard.name for shard in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in hf_tensors(out).values())
    assert_same_tensors(hf_tensors(out), hf_tensors(hf_dir))
    load_transformers(out)


def test_from_sharded_and_bin_folders(tmp_path, tokenizer_dir, llama_dirs):
    _, ours_dir = llama_dirs
    expected = hf_tensors(ours_dir)
    sharded = save_hf(build_hf_model("llama"), tmp_path / "sharded", tokenizer_dir, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert_same_tensors(hf_tensors(from_hf(sharded, tmp_path / "from_sharded")), expected)

    bin_dir = save_hf(build_hf_model("llama"), tmp_path / "bin", tokenizer_dir)
    torch.save(hf_tensors(bin_dir), bin_dir / "pytorch_model.bin")
    (bin_dir / "model.safetensors").unlink()
    assert_same_tensors(hf_tensors(from_hf(bin_dir, tmp_path / "from_bin")), expected)


class _NoData:
    def state_dict(self) -> dict:
        return {}


def _one_adamw_step(model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    model(tokens()).float().pow(2).mean().backward()
    optimizer.step()
    return optimizer


def test_from_a_sharded_checkpoint(tmp_path, tokenizer_dir):
    from llmtrain.distributed.runtime import Runtime
    from llmtrain.train.loop import TrainState

    hf_dir = save_hf(build_hf_model("qwen2-tied"), tmp_path / "hf", tokenizer_dir)
    model = load_llmtrain(from_hf(hf_dir, tmp_path / "base")).train()
    optimizer = _one_adamw_step(model)
    step_dir = Checkpointer(runtime=Runtime(), out_dir=tmp_path / "run", model=model, optimizer=optimizer,
                            train_loader=_NoData(), model_config=model.config, tokenizer=Tokenizer(tokenizer_dir),
                            hyperparameters={}, format="sharded").save(TrainState(step=1))
    assert (step_dir / "dcp").is_dir() and not (step_dir / layout.MODEL_FILE).exists()
    full_dir = files.write_model_dir(tmp_path / "full", state_dict=model.state_dict(), model_config=model.config,
                                     hyperparameters=None, tokenizer=Tokenizer(tokenizer_dir))
    assert_same_tensors(hf_tensors(to_hf(step_dir, tmp_path / "from_dcp")),
                        hf_tensors(to_hf(full_dir, tmp_path / "from_full")))
    load_transformers(tmp_path / "from_dcp")


def test_from_a_lora_step_checkpoint(tmp_path, llama_dirs):
    from llmtrain.distributed.runtime import Runtime
    from llmtrain.lora import LoRAArgs, apply_lora, mark_only_lora_trainable
    from llmtrain.train.loop import TrainState

    _, base_dir = llama_dirs
    model = load_llmtrain(base_dir)
    lora = LoRAArgs(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_projection=True, lora_mlp=True, lora_head=True)
    apply_lora(model, lora)
    mark_only_lora_trainable(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.1)  # B starts at zero; a merge of zeros would prove nothing

    checkpointer = Checkpointer(runtime=Runtime(), out_dir=tmp_path / "run", model=model,
                                optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
                                train_loader=_NoData(), model_config=model.config, tokenizer=Tokenizer(base_dir),
                                hyperparameters={}, format="lora",
                                write_extras=lambda directory: write_lora_settings(directory, lora, base_dir, None))
    step_dir = checkpointer.save(TrainState(step=1))
    assert not (step_dir / layout.MODEL_FILE).exists()
    with torch.no_grad():
        expected = model(tokens())
    final_dir = checkpointer.save_final(TrainState(step=1))  # merges the model in place

    from_step = to_hf(step_dir, tmp_path / "from_step")
    assert_same_tensors(hf_tensors(from_step), hf_tensors(to_hf(final_dir, tmp_path / "from_final")))
    with torch.no_grad():
        torch.testing.assert_close(load_transformers(from_step)(tokens()).logits, expected, atol=1e-5, rtol=1e-5)


def test_dtype(tmp_path, llama_dirs):
    hf_dir, ours_dir = llama_dirs
    out = to_hf(ours_dir, tmp_path / "bf16", dtype="bfloat16")
    assert {t.dtype for t in hf_tensors(out).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_transformers(out).dtype == torch.bfloat16
    half = from_hf(hf_dir, tmp_path / "fp16", dtype="float16")
    assert {t.dtype for t in hf_tensors(half).values()} == {torch.float16}
    with pytest.raises(ValueError, match="--dtype 'fp8'"):
        to_hf(ours_dir, tmp_path / "fp8", dtype="fp8")


def test_token_ids_and_generation_config(tmp_path, llama_dirs):
    hf_dir, ours_dir = llama_dirs
    tokenizer = Tokenizer(ours_dir)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 0)
    out = to_hf(ours_dir, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eos_id)
    # The model's own generation settings travel through both conversions unchanged ...
    assert (out / "generation_config.json").read_text() == (hf_dir / "generation_config.json").read_text()
    # ... and a model trained by llmtrain gets them from its tokenizer.
    trained = Path(shutil.copytree(ours_dir, tmp_path / "trained"))
    (trained / "generation_config.json").unlink()
    generation = transformers.GenerationConfig.from_pretrained(to_hf(trained, tmp_path / "trained_hf"))
    assert (generation.bos_token_id, generation.eos_token_id) == (tokenizer.bos_id, tokenizer.eos_id)


# ---- chat template ---------------------------------------------------------------------------------

BASE_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""A base model's chat template (ChatML), which its tokenizer files carry into every checkpoint tuned from it."""

CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": " Hi there \n"}, {"role": "assistant", "content": "\n Hello! \n"},
     {"role": "user", "content": "What is 2 + 2? "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": " Hello!"}, {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4"}],
]
"""One turn, a system message, several turns; awaiting an answer, or finished."""


def tuned_checkpoint(directory: Path, ours_dir: Path, style, base_template: bool = True) -> Path:
    """A copy of `ours_dir` fine-tuned (as far as its files go) with `style`, from a base with a template or not."""
    shutil.copytree(ours_dir, directory)
    if base_template:
        _edit_json(directory / layout.TOKENIZER_CONFIG_FILE, chat_template=BASE_TEMPLATE)
    save_prompt_style(style, directory)
    return directory


@pytest.mark.parametrize("style", [*(PromptStyle.from_name(name) for name in sorted(PromptStyle.registry)
                                     if name != "chat_template"),
                                   PromptStyle.from_name("chatml", system=QWEN_SYSTEM),
                                   PromptStyle.from_name("llama3.1", date=None)], ids=repr)
def test_a_tuned_models_chat_template_is_its_prompt_style(tmp_path, llama_dirs, style):
    _, ours_dir = llama_dirs
    tuned = tuned_checkpoint(tmp_path / "tuned", ours_dir, style)
    out = to_hf(tuned, tmp_path / "hf")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    tokenizer = Tokenizer(tuned)
    assert tokenizer.add_bos
    for messages in CHATS:
        prompt = style.apply(messages)
        awaiting = messages[-1]["role"] == "user"
        rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=awaiting)
        # The template writes the bos token that llmtrain's tokenizer adds, as transformers encodes without it.
        assert rendered == "<|bos|>" + prompt
        ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=awaiting,
                                               return_dict=False)
        assert list(ids) == tokenizer.encode(prompt)
        if awaiting:  # without the generation prompt: the same, less the header of the assistant's reply
            bare = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
            assert rendered.startswith(bare)
    # transformers' own layout: the template in chat_template.jinja, none left in tokenizer_config.json.
    assert "chat_template" not in json.loads((out / layout.TOKENIZER_CONFIG_FILE).read_text())
    assert read_chat_template(out).render(CHATS[-1]) == style.render(CHATS[-1])  # converting back keeps it


def test_a_chat_template_without_a_base_template_or_of_the_checkpoint_itself(tmp_path, llama_dirs):
    _, ours_dir = llama_dirs
    # A base with no template: the export gets the style's.
    out = to_hf(tuned_checkpoint(tmp_path / "alpaca", ours_dir, Alpaca(), base_template=False), tmp_path / "hf")
    assert transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(
        CHATS[0], tokenize=False, add_generation_prompt=True) == "<|bos|>" + Alpaca().apply(CHATS[0])
    # Tuned in the base's own template: written back unchanged.
    own = tuned_checkpoint(tmp_path / "own", ours_dir, ChatTemplate(template=BASE_TEMPLATE))
    assert (to_hf(own, tmp_path / "own_hf") / layout.CHAT_TEMPLATE_FILE).read_text() == BASE_TEMPLATE
    # A model never fine-tuned (no prompt_style.yaml) keeps its tokenizer's template.
    base = Path(shutil.copytree(ours_dir, tmp_path / "base"))
    _edit_json(base / layout.TOKENIZER_CONFIG_FILE, chat_template=BASE_TEMPLATE)
    assert read_chat_template(to_hf(base, tmp_path / "base_hf")).template == BASE_TEMPLATE


def test_transformers_generate_ends_a_reply_at_the_styles_end_of_turn_token(tmp_path, llama_dirs):
    _, ours_dir = llama_dirs
    tuned = tuned_checkpoint(tmp_path / "tuned", ours_dir, ChatML())
    hf_tokenizer = tokenizers.Tokenizer.from_file(str(tuned / layout.TOKENIZER_FILE))
    hf_tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])  # as ChatML models have them: one token each
    hf_tokenizer.save(str(tuned / layout.TOKENIZER_FILE))
    tokenizer = Tokenizer(tuned)
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert ChatML().stop_tokens(tokenizer) == ([tokenizer.eos_id], [im_end])  # where llmtrain's generate stops
    out = to_hf(tuned, tmp_path / "hf")
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [tokenizer.eos_id, im_end]

    class Writes(transformers.LogitsProcessor):  # a model that answers with <|im_end|> and would then go on
        def __call__(self, input_ids, scores):
            scores[:] = -float("inf")
            scores[:, im_end if input_ids.shape[1] == prompt.shape[1] else 5] = 0.0
            return scores

    prompt = torch.tensor([tokenizer.encode(ChatML().apply("Hi"))])
    reply = load_transformers(out).generate(prompt, max_new_tokens=4, do_sample=False,
                                            logits_processor=transformers.LogitsProcessorList([Writes()]))
    assert reply[0, prompt.shape[1]:].tolist() == [im_end]
    # Converted back, llmtrain stops there too, as before.
    back = from_hf(out, tmp_path / "back")
    assert checkpoint_prompt_style(back, Config.from_file(back / layout.CONFIG_FILE)).stop_tokens(
        Tokenizer(back)) == ([tokenizer.eos_id], [im_end])


def test_a_style_without_a_jinja_form_exports_no_template(tmp_path, llama_dirs, capsys):
    _, ours_dir = llama_dirs

    @dataclass(frozen=True)
    class Shout(PromptStyle):  # a user's own style, which has no Jinja form
        name: ClassVar[str] = "test-shout"

        def user(self, message, turn):
            return message["content"].upper() + "\n"

    try:
        out = to_hf(tuned_checkpoint(tmp_path / "shout", ours_dir, Shout()), tmp_path / "hf")
    finally:
        PromptStyle.registry.pop("test-shout")
    warning = capsys.readouterr().err
    assert "'test-shout' prompt style has no Jinja form; the converted model has no chat template" in warning
    # Not the base's template, which the model was not tuned on.
    with pytest.raises(ValueError, match="chat_template is not set"):
        transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(CHATS[0], tokenize=False)

    @dataclass(frozen=True)
    class Human(ChatML):  # a built-in style changed: the Jinja form it inherits renders ChatML's turns
        name: ClassVar[str] = "test-human"

        def user(self, message, turn):
            return f"<|im_start|>human\n{message['content']}<|im_end|>\n<|im_start|>assistant\n"

    try:
        out = to_hf(tuned_checkpoint(tmp_path / "human", ours_dir, Human()), tmp_path / "human_hf")
    finally:
        PromptStyle.registry.pop("test-human")
    assert "'test-human' prompt style's chat template renders" in capsys.readouterr().err
    assert not (out / layout.CHAT_TEMPLATE_FILE).exists()


# ---- ensure_model_dir -----------------------------------------------------------------------------


def test_ensure_model_dir_converts_once(tmp_path, llama_dirs):
    hf_dir, ours_dir = llama_dirs
    assert ensure_model_dir(ours_dir) == ours_dir
    converted = ensure_model_dir(hf_dir, cache_dir=tmp_path / "cache")
    assert layout.is_complete(converted) and converted.parent == tmp_path / "cache"
    assert_same_tensors(hf_tensors(converted), hf_tensors(ours_dir))
    written = (converted / layout.MARKER_FILE).stat().st_mtime_ns
    assert ensure_model_dir(hf_dir, cache_dir=tmp_path / "cache") == converted
    assert (converted / layout.MARKER_FILE).stat().st_mtime_ns == written
    with pytest.raises(FileNotFoundError, match="neither a llmtrain model directory"):
        ensure_model_dir(tmp_path)


# ---- bad input ------------------------------------------------------------------------------------


# config.json fields that change what transformers computes and that llmtrain does not implement:
# (case, field, value, the error's words).
UNSUPPORTED_FIELDS = [
    ("gemma", "use_bidirectional_attention", True, "use_bidirectional_attention=true"),
    ("llama", "rope_parameters", rope(rope_type="linear", factor=2.0), "RoPE type 'linear' is not supported"),
    ("phi", "qk_layernorm", True, "qk_layernorm=true"),
]


@pytest.mark.parametrize("case, field, value, message", UNSUPPORTED_FIELDS)
def test_a_field_that_changes_the_model_and_llmtrain_lacks_is_refused(case, field, value, message, tmp_path):
    """from_hf must refuse it, not convert a model that silently computes something else."""
    idx = tokens()
    logits = []
    for name, changes in (("plain", {}), ("changed", {field: value})):
        hf_config = type(HF_CASES[case]())(**{**HF_CASES[case]().to_dict(), **changes})
        torch.manual_seed(0)
        # NOTE: transformers' default attention (sdpa): eager attention ignores use_bidirectional_attention.
        hf = getattr(transformers, type(hf_config).__name__.replace("Config", "ForCausalLM"))(hf_config).eval()
        with torch.no_grad():
            for param in hf.parameters():
                param.normal_(0.0, 0.1)
            logits.append(hf(idx).logits)
        hf.save_pretrained(tmp_path / name)
    assert not torch.allclose(logits[0], logits[1], atol=1e-5), f"{field}={value!r} does not change the model"
    with pytest.raises(ValueError, match=f"changed/config.json: {message}"):
        from_hf(tmp_path / "changed", tmp_path / "out")


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_bad_transformers_folders(tmp_path, llama_dirs):
    hf_dir, _ = llama_dirs
    with pytest.raises(FileNotFoundError, match=r"no_config/config.json does not exist"):
        (tmp_path / "no_config").mkdir()
        from_hf(tmp_path / "no_config", tmp_path / "out")

    unknown = Path(shutil.copytree(hf_dir, tmp_path / "unknown"))
    _edit_json(unknown / "config.json", architectures=["BertForMaskedLM"], model_type="bert")
    with pytest.raises(ValueError, match=r"unknown/config.json: architecture \['BertForMaskedLM'\] is not supported"):
        from_hf(unknown, tmp_path / "out")

    resized = Path(shutil.copytree(hf_dir, tmp_path / "resized"))
    _edit_json(resized / "config.json", intermediate_size=128)
    with pytest.raises(ValueError, match=r"resized/model.safetensors: 'model.layers.0.mlp.\w+_proj.weight' has shape "
                                         r"\(\d+, \d+\), but .*resized/config.json implies"):
        from_hf(resized, tmp_path / "out")

    no_weights = Path(shutil.copytree(hf_dir, tmp_path / "no_weights"))
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="holds no transformers weights"):
        from_hf(no_weights, tmp_path / "out")

    # transformers 5 writes rope_parameters; a rope_scaling added next to it (as model cards say) is what it reads.
    rescaled = Path(shutil.copytree(hf_dir, tmp_path / "rescaled"))
    _edit_json(rescaled / "config.json", rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert transformers.AutoConfig.from_pretrained(rescaled).rope_parameters["rope_type"] == "linear"
    with pytest.raises(ValueError, match=r"rescaled/config.json: RoPE type 'linear' is not supported"):
        from_hf(rescaled, tmp_path / "out")

    unscaled = Path(shutil.copytree(hf_dir, tmp_path / "unscaled"))
    _edit_json(unscaled / "config.json", rope_parameters=rope(rope_type="llama3", factor=8.0))
    with pytest.raises(ValueError, match=r"unscaled/config.json: the 'llama3' RoPE scaling lacks \['low_freq_factor', "
                                         r"'high_freq_factor', 'original_max_position_embeddings'\]"):
        from_hf(unscaled, tmp_path / "out")

    with pytest.raises(FileExistsError, match="not empty"):
        from_hf(hf_dir, hf_dir)


def test_bad_llmtrain_checkpoints(tmp_path, llama_dirs):
    hf_dir, ours_dir = llama_dirs
    with pytest.raises(FileNotFoundError, match="is a transformers folder: use from_hf"):
        to_hf(hf_dir, tmp_path / "out")

    resized = Path(shutil.copytree(ours_dir, tmp_path / "resized"))
    config = Config.from_file(resized / layout.CONFIG_FILE)
    Config(**{**config.to_dict(), "intermediate_size": 128}).save(resized / layout.CONFIG_FILE)
    with pytest.raises(ValueError, match=r"resized/model.safetensors: 'blocks.0.mlp.\w+_proj.weight' has shape "
                                         r"\(\d+, \d+\), but .*resized/model_config.yaml implies"):
        to_hf(resized, tmp_path / "out")

    custom = Path(shutil.copytree(ours_dir, tmp_path / "custom"))
    Config(**{**config.to_dict(), "norm_class_name": "LayerNorm"}).save(custom / layout.CONFIG_FILE)
    with pytest.raises(ValueError, match="matches no transformers architecture .* Closest is LlamaForCausalLM, "
                                         "which needs norm_class_name='RMSNorm'"):
        to_hf(custom, tmp_path / "out")
    assert not any(name.startswith(".") for name in os.listdir(tmp_path))  # no temporary folders left behind


# ---- mixtures of experts ----------------------------------------------------------------------------

MOE_CASES = ("mixtral", "qwen3-moe-qk-norm-per-head", "olmoe-qk-norm-whole")


@pytest.mark.parametrize("case", MOE_CASES)
def test_an_moe_generates_what_transformers_generates(case, tmp_path, tokenizer_dir):
    """Greedy decoding with the KV cache on both sides: the router, the experts and QK-norm, token by token."""
    from llmtrain.generate import generate

    hf = build_hf_model(case)
    hf.generation_config.eos_token_id = None  # random weights: both run the full count
    ours = load_llmtrain(from_hf(save_hf(hf, tmp_path / "hf", tokenizer_dir), tmp_path / "ours"))
    prompt = tokens()[0, :9]
    expected = hf.generate(prompt[None], attention_mask=torch.ones(1, 9, dtype=torch.long), do_sample=False,
                           max_new_tokens=6, pad_token_id=0)[0]
    assert generate(ours, prompt, 6, temperature=0.0).tolist() == expected.tolist()


@pytest.mark.parametrize("case", MOE_CASES)
def test_transformers_in_memory_experts_load(case):
    """transformers 5 keeps each layer's experts fused in memory (gate_up_proj): state_dict_from_hf splits them."""
    from llmtrain.convert import state_dict_from_hf

    hf = build_hf_model(case)
    assert any(name.endswith("experts.gate_up_proj") for name in hf.state_dict())
    config = case_config(case)[1]
    ours = GPT(config).eval()
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), config), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens()), hf(tokens()).logits, atol=1e-5, rtol=1e-5)


def test_llmtrain_moe_exports_as_mixtral_in_shards(tmp_path, tokenizer_dir):
    """moe-debug's kind of model, trained with llmtrain, opens in transformers with our logits; experts split over
    shards as the Hub's checkpoints keep them, one tensor per expert."""
    config = Config.from_name("moe-debug", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, n_expert=4,
                              moe_intermediate_size=32, vocab_size=320, block_size=64, router_bias_update_rate=1e-3)
    torch.manual_seed(0)
    model = GPT(config).eval()
    model.init_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)  # not all ones: a norm wired wrongly shows
    ours_dir = files.write_model_dir(tmp_path / "ours", state_dict=model.state_dict(), model_config=config,
                                     hyperparameters=None, tokenizer=Tokenizer(tokenizer_dir))
    out = to_hf(ours_dir, tmp_path / "hf", max_shard_size="60KB")
    hf_config = json.loads((out / "config.json").read_text())
    assert (hf_config["architectures"], hf_config["num_local_experts"], hf_config["intermediate_size"]) == (
        ["MixtralForCausalLM"], 4, 32)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards_of = [{weight_map[f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"] for e in range(4)}
                 for i in range(2) for w in ("w1", "w2", "w3")]
    assert max(map(len, shards_of)) > 1  # a stacked weight's experts in two shards: from_hf collects them
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in weight_map
    assert not any("expert_bias" in name for name in weight_map)
    with torch.no_grad():
        torch.testing.assert_close(load_transformers(out)(tokens()).logits, model(tokens()), atol=1e-5, rtol=1e-5)
    back = load_llmtrain(from_hf(out, tmp_path / "back"))
    assert_same_tensors(back.state_dict(), model.state_dict())

    # Trained with aux-loss-free balancing: its experts are chosen with a bias that Mixtral has no place for.
    with torch.no_grad():
        model.blocks[1].mlp.expert_bias[2] = 0.25
    biased = files.write_model_dir(tmp_path / "biased", state_dict=model.state_dict(), model_config=config,
                                   hyperparameters=None, tokenizer=None)
    with pytest.raises(ValueError, match=r"blocks.1.mlp.expert_bias is not zero: .*router_bias_update_rate .*"
                                         "MixtralForCausalLM has no place for"):
        to_hf(biased, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


# config.json values of the three families that llmtrain cannot compute: (case, fields, the error's words).
UNMATCHED_MOE_FIELDS = [
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ("qwen3-moe-qk-norm-per-head", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] .* dense MLP layers"),
    ("qwen3-moe-qk-norm-per-head", {"decoder_sparse_step": 2}, "decoder_sparse_step=2 .* dense MLP layers"),
    ("qwen3-moe-qk-norm-per-head", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=true"),
    ("qwen3-moe-qk-norm-per-head", {"attention_bias": True}, "attention_bias=true"),
    ("olmoe-qk-norm-whole", {"clip_qkv": 8.0}, "clip_qkv=8.0 .* does not clamp"),
]


@pytest.mark.parametrize("case, fields, message", UNMATCHED_MOE_FIELDS)
def test_moe_fields_llmtrain_lacks_are_refused(case, fields, message):
    hf_config = {**HF_CASES[case]().to_dict(), **fields}
    hf_config["architectures"] = [type(HF_CASES[case]()).__name__.replace("Config", "ForCausalLM")]
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        config_from_hf(hf_config, Path(case) / "config.json")


@pytest.mark.parametrize("architecture, reason", [
    ("DeepseekV3ForCausalLM", "multi-head latent attention"), ("Qwen2MoeForCausalLM", "shared_expert_gate"),
    ("GptOssForCausalLM", "clamped SwiGLU"),
])
def test_moe_architectures_llmtrain_lacks_are_refused_with_the_reason(architecture, reason, tmp_path):
    from llmtrain.download import _check_architecture

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    with pytest.raises(ValueError, match=f"org/model cannot be used by llmtrain.*{architecture} cannot be converted "
                                         f"exactly: .*{reason}"):
        _check_architecture(tmp_path, "org/model")  # llmtrain download asks before fetching the weights


def test_download_accepts_the_moe_families(tmp_path):
    from llmtrain.download import _check_architecture

    for case in MOE_CASES:
        hf_config = HF_CASES[case]()
        hf_config.architectures = [type(hf_config).__name__.replace("Config", "ForCausalLM")]
        hf_config.save_pretrained(tmp_path / case)
        _check_architecture(tmp_path / case, f"org/{case}")


def test_an_moe_no_family_has_is_refused_on_export():
    config = Config.from_name("moe-debug", n_shared_expert=1)
    with pytest.raises(ValueError, match="matches no transformers architecture .* Closest is MixtralForCausalLM, "
                                         "which needs n_shared_expert=0"):
        adapter_for_config(config)
