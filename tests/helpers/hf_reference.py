"""transformers as the reference: its model with a zoo config's architecture, and folders loaded strictly."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from llmtrain.config import Config


def hf_family(config: Config) -> str:
    if config.is_moe:
        return {"head": "qwen3_moe", "full": "olmoe"}.get(config.qk_norm, "mixtral")
    if config.mlp_class_name == "GemmaMLP":
        return "gemma"
    if config.mlp_class_name == "GptNeoxMLP":
        return "phi" if config.shared_attention_norm else "gpt_neox"
    if config.attn_bias:
        return "qwen2"
    return "mistral" if config.sliding_window is not None else "llama"


def hf_model(config: Config):
    """The transformers model with the architecture of `config` (fp32, eager attention)."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": config.rope_base}
    if config.rope_scaling is not None:
        scaling = config.rope_scaling
        rope = {**rope, "rope_type": "llama3", "factor": scaling["factor"],
                "low_freq_factor": scaling["low_freq_factor"], "high_freq_factor": scaling["high_freq_factor"],
                "original_max_position_embeddings": scaling["original_max_seq_len"]}
    if config.rotary_percentage < 1.0:
        rope["partial_rotary_factor"] = config.rotary_percentage
    common = dict(
        vocab_size=config.padded_vocab_size, hidden_size=config.n_embd, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
        max_position_embeddings=config.block_size, tie_word_embeddings=config.tie_embeddings,
        rope_parameters=rope, attn_implementation="eager",
    )
    llama_like = dict(common, num_key_value_heads=config.n_query_groups, head_dim=config.head_size,
                      rms_norm_eps=config.norm_eps)
    family = hf_family(config)
    moe = dict(llama_like, num_experts_per_tok=config.n_expert_per_token, sliding_window=config.sliding_window)
    if family == "mixtral":
        hf_config = transformers.MixtralConfig(**{**moe, "intermediate_size": config.moe_intermediate_size},
                                               num_local_experts=config.n_expert)
        return transformers.MixtralForCausalLM(hf_config)
    if family == "qwen3_moe":
        hf_config = transformers.Qwen3MoeConfig(**moe, num_experts=config.n_expert, norm_topk_prob=config.norm_topk_prob,
                                                moe_intermediate_size=config.moe_intermediate_size)
        return transformers.Qwen3MoeForCausalLM(hf_config)
    if family == "olmoe":
        hf_config = transformers.OlmoeConfig(**{**moe, "intermediate_size": config.moe_intermediate_size},
                                             num_experts=config.n_expert, norm_topk_prob=config.norm_topk_prob)
        return transformers.OlmoeForCausalLM(hf_config)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_like))
    if family == "mistral":
        hf_config = transformers.MistralConfig(**llama_like, sliding_window=config.sliding_window)
        return transformers.MistralForCausalLM(hf_config)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**llama_like))
    if family == "gemma":
        hf_config = transformers.GemmaConfig(**llama_like, hidden_activation="gelu_pytorch_tanh")
        return transformers.GemmaForCausalLM(hf_config)
    if family == "phi":
        hf_config = transformers.PhiConfig(**common, layer_norm_eps=config.norm_eps, hidden_act="gelu_new")
        return transformers.PhiForCausalLM(hf_config)
    hf_config = transformers.GPTNeoXConfig(**common, layer_norm_eps=config.norm_eps, hidden_act="gelu",
                                           use_parallel_residual=config.parallel_residual)
    return transformers.GPTNeoXForCausalLM(hf_config)


def load_transformers(directory: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True,
                                                                    attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def tokens(vocab_size: int = 300) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
