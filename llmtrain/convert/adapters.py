"""How each transformers architecture names, lays out and configures the weights of a llmtrain `GPT`.

One `Adapter` per family. It knows three things:

* `modules`: llmtrain module name -> transformers module name (`{i}` is the layer index); the
  parameter suffix (`.weight`, `.bias`) is the same on both sides.
* `fixed`: the `Config` fields that every model of the family has (Gemma: GeGLU, (1 + w) RMSNorm,
  scaled embeddings, ...). A `Config` whose fields all agree is exported as this family.
* how the remaining fields map to config.json, in both directions.

GPT-NeoX is the only family that stores q, k and v in one tensor; its rows are laid out per head as
(n_head, 3, head_size). Every other family uses separate projections and the "rotate_half" RoPE
layout, as llmtrain does, so their weights are copied without any permutation.

config.json is written in the layout the Hugging Face Hub uses (`rope_theta`, `rope_scaling`,
`rotary_pct`, ...), which every transformers release reads; reading accepts it and the
`rope_parameters` layout that transformers 5 writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from llmtrain.config import MODEL_ZOO, Config, architecture_differences

if TYPE_CHECKING:
    import torch

IGNORED_HF_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|\.attention\.(bias|masked_bias)$")
"""Buffers that old transformers checkpoints saved (RoPE frequencies, GPT-NeoX causal masks): derived, not weights."""

_GELU_FROM_HF = {"gelu": "none", "gelu_python": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh",
                 "gelu_fast": "tanh"}
_SILU = ("silu", "swish")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class HFConfig:
    """config.json of a transformers folder, read with the family's defaults for absent keys."""

    def __init__(self, values: dict[str, Any], path: Path, defaults: Optional[dict[str, Any]] = None) -> None:
        self.values = values
        self.path = path
        self.defaults = defaults or {}

    def get(self, key: str) -> Any:
        if self.values.get(key) is not None:
            return self.values[key]
        return self.defaults.get(key)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path} has no {key!r}; a {self.get('architectures')} config needs it")
        return value

    def rope(self) -> tuple[float, Optional[dict], float]:
        """RoPE base, llama3 scaling (or None) and the fraction of each head that rotates."""
        # transformers 5 gathers everything under rope_parameters; the Hub layout spreads it over
        # rope_theta (rotary_emb_base), rope_scaling and partial_rotary_factor (rotary_pct).
        # NOTE: as transformers 5 reads a file with both, a rope_scaling replaces rope_parameters whole (e.g. the
        # YaRN scaling that Qwen2.5's model card says to add to config.json, in a folder transformers 5 saved).
        params = self.values.get("rope_scaling") or self.values.get("rope_parameters") or {}
        base = params.get("rope_theta", self.get("rope_theta") or self.get("rotary_emb_base") or 10000.0)
        partial = params.get("partial_rotary_factor",
                             self.get("partial_rotary_factor") or self.get("rotary_pct") or 1.0)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            return float(base), None, float(partial)
        if rope_type == "llama3":
            missing = [key for key in _LLAMA3_ROPE_KEYS if key not in params]
            if missing:
                raise ValueError(f"{self.path}: the 'llama3' RoPE scaling lacks {missing}; it needs "
                                 f"{list(_LLAMA3_ROPE_KEYS)}")
            scaling = dict(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                           high_freq_factor=float(params["high_freq_factor"]),
                           original_max_seq_len=int(params["original_max_position_embeddings"]))
            return float(base), scaling, float(partial)
        raise ValueError(f"{self.path}: RoPE type {rope_type!r} is not supported; llmtrain implements the "
                         "default RoPE and Llama 3's 'llama3' scaling")

    def gelu_approximate(self, key: str = "hidden_act") -> str:
        act = self.require(key)
        if act not in _GELU_FROM_HF:
            raise ValueError(f"{self.path}: {key} {act!r} is not supported for {self.get('architectures')}; "
                             f"llmtrain implements {sorted(_GELU_FROM_HF)}")
        return _GELU_FROM_HF[act]

    def expect(self, key: str, allowed: tuple) -> None:
        if self.get(key) not in allowed:
            raise ValueError(f"{self.path}: {key} {self.get(key)!r} is not supported for "
                             f"{self.get('architectures')}; llmtrain implements {allowed}")


@dataclass(frozen=True)
class Adapter:
    """One transformers architecture: names, fixed features and config.json fields."""

    family: str
    """Short name: llama, mistral, qwen2, gemma, phi or gpt_neox."""
    architecture: str
    """The transformers class, as config.json's `architectures` names it."""
    model_type: str
    """config.json's `model_type`."""
    modules: dict[str, str]
    """llmtrain module -> transformers module; `{i}` stands for the layer index. Several llmtrain
    modules on one transformers module are fused: q, k, v interleaved per head, as (n_head, 3, head_size)."""
    fixed: dict[str, Any]
    """Config fields every model of this family has; the others come from config.json."""
    hf_defaults: dict[str, Any]
    """transformers' defaults for config.json keys that a file may leave out."""
    read_fields: Callable[[HFConfig], dict[str, Any]]
    """The family's own Config fields from config.json (the common sizes are read for every family)."""
    write_fields: Callable[[Config], dict[str, Any]]
    """The family's own config.json fields."""
    norm_eps_key: str = "rms_norm_eps"
    """config.json key of the normalization epsilon."""
    rope_base_key: str = "rope_theta"
    """config.json key of the RoPE base (GPT-NeoX: rotary_emb_base)."""
    check: Callable[[Config], list[str]] = lambda config: []
    """Problems, beyond `fixed`, that keep a Config from being exported as this family."""
    read_aliases: dict[str, str] = field(default_factory=dict)
    """Other spellings of transformers modules, accepted when reading (in-memory vs Hub names)."""
    hub_orgs: tuple[str, ...] = ()
    """Hub organizations that publish this architecture: it wins for their zoo models when features tie
    (Mistral v0.2 has Llama's features, but is published as MistralForCausalLM)."""

    # ---- names -----------------------------------------------------------------------------------

    @cached_property
    def _from_hf(self) -> dict[str, list[str]]:
        inverse: dict[str, list[str]] = {}
        for ours, theirs in self.modules.items():
            inverse.setdefault(theirs, []).append(ours)
        for alias, canonical in self.read_aliases.items():
            inverse[alias] = inverse[canonical]
        return inverse

    def hf_name(self, name: str) -> str:
        """transformers name of llmtrain tensor `name` (for q/k/v of GPT-NeoX: the fused tensor)."""
        module, param = name.rsplit(".", 1)
        template, layer = _template(module)
        if template not in self.modules:
            raise KeyError(f"{name} has no counterpart in {self.architecture}")
        return self.modules[template].replace("{i}", layer or "") + "." + param

    def canonical_hf_name(self, hf_name: str) -> str:
        """Hub spelling of a transformers tensor name (e.g. GPT-NeoX's `lm_head` is `embed_out` on the Hub)."""
        module, param = hf_name.rsplit(".", 1)
        template, layer = _template(module)
        if template in self.read_aliases:
            return self.read_aliases[template].replace("{i}", layer or "") + "." + param
        return hf_name

    def tensors_from_hf(self, config: Config, hf_name: str, tensor: "torch.Tensor") -> list[tuple[str, "torch.Tensor"]]:
        """llmtrain (name, tensor) pairs held in transformers tensor `hf_name` (three for a fused QKV)."""
        module, param = hf_name.rsplit(".", 1)
        template, layer = _template(module)
        if template not in self._from_hf:
            raise KeyError(f"{hf_name} is not a {self.architecture} weight that llmtrain knows")
        names = [ours.replace("{i}", layer or "") + "." + param for ours in self._from_hf[template]]
        if len(names) == 1:
            return [(names[0], tensor)]
        per_head = tensor.reshape(config.n_head, 3, config.head_size, *tensor.shape[1:])  # (nh, 3, hs, ...)
        return [(name, per_head[:, i].reshape(-1, *tensor.shape[1:])) for i, name in enumerate(names)]

    def hf_layout(self, names: list[str]) -> dict[str, list[str]]:
        """transformers tensor -> the llmtrain tensors it is made of (q, k, v in that order), ordered as `names`."""
        layout: dict[str, list[str]] = {}
        for name in names:
            layout.setdefault(self.hf_name(name), []).append(name)
        order = list(self.modules)
        for parts in layout.values():
            parts.sort(key=lambda name: order.index(_template(name.rsplit(".", 1)[0])[0]))
        return layout

    def fuse(self, config: Config, tensors: list["torch.Tensor"]) -> "torch.Tensor":
        """One transformers tensor from its llmtrain parts: a plain copy, or q, k, v interleaved per head."""
        if len(tensors) == 1:
            return tensors[0]
        import torch

        rest = tensors[0].shape[1:]
        parts = [t.reshape(config.n_head, 1, config.head_size, *rest) for t in tensors]  # (nh, 1, hs, ...) each
        return torch.cat(parts, dim=1).reshape(-1, *rest)  # rows (nh, 3, hs)

    # ---- config ----------------------------------------------------------------------------------

    def mismatches(self, config: Config) -> list[str]:
        """Why `config` cannot be exported as this family; empty when it can."""
        problems = [f"{key}={value!r} (has {getattr(config, key)!r})"
                    for key, value in self.fixed.items() if getattr(config, key) != value]
        return problems + self.check(config)

    def config_fields(self, hf: HFConfig) -> dict[str, Any]:
        """Every Config field of the model that config.json describes."""
        n_embd, n_head = hf.require("hidden_size"), hf.require("num_attention_heads")
        rope_base, rope_scaling, rotary_percentage = hf.rope()
        vocab = hf.require("vocab_size")
        values = dict(
            n_layer=hf.require("num_hidden_layers"), n_embd=n_embd, n_head=n_head,
            n_query_groups=hf.get("num_key_value_heads") or n_head, head_size=hf.get("head_dim") or n_embd // n_head,
            intermediate_size=hf.require("intermediate_size"), vocab_size=vocab, padded_vocab_size=vocab,
            block_size=hf.require("max_position_embeddings"), tie_embeddings=bool(hf.get("tie_word_embeddings")),
            norm_eps=float(hf.require(self.norm_eps_key)), rope_base=rope_base, rope_scaling=rope_scaling,
            rotary_percentage=rotary_percentage, **self.read_fields(hf),
        )
        for key, value in self.fixed.items():
            if key in values and values[key] != value:
                raise ValueError(f"{hf.path}: {key} would be {values[key]!r}, but {self.architecture} in llmtrain "
                                 f"supports only {value!r}")
        return {**values, **self.fixed}

    def hf_config(self, config: Config) -> dict[str, Any]:
        """config.json fields for `config` (token ids and dtype are added by the caller)."""
        problems = self.mismatches(config)
        if problems:
            raise ValueError(f"Model config {config.name or '(custom)'} cannot be written as {self.architecture}: "
                             f"it needs {', '.join(problems)}")
        rope: dict[str, Any] = {self.rope_base_key: config.rope_base, "rope_scaling": None}
        if config.rope_scaling is not None:
            scaling = config.rope_scaling
            rope["rope_scaling"] = {"rope_type": "llama3", "factor": scaling["factor"],
                                    "low_freq_factor": scaling["low_freq_factor"],
                                    "high_freq_factor": scaling["high_freq_factor"],
                                    "original_max_position_embeddings": scaling["original_max_seq_len"]}
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": config.padded_vocab_size, "hidden_size": config.n_embd,
            "intermediate_size": config.intermediate_size, "num_hidden_layers": config.n_layer,
            "num_attention_heads": config.n_head, "max_position_embeddings": config.block_size,
            self.norm_eps_key: config.norm_eps, "tie_word_embeddings": config.tie_embeddings,
            "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0,
            **rope, **self.write_fields(config),
        }


def _template(module: str) -> tuple[str, Optional[str]]:
    """'blocks.3.attn.q_proj' -> ('blocks.{i}.attn.q_proj', '3')."""
    match = re.search(r"\.(\d+)(?=\.|$)", module)
    if match is None:
        return module, None
    return module[:match.start()] + ".{i}" + module[match.end():], match.group(1)


# ---- the families ---------------------------------------------------------------------------------

_LLAMA_MODULES = {
    "wte": "model.embed_tokens",
    "blocks.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    **{f"blocks.{{i}}.attn.{p}_proj": f"model.layers.{{i}}.self_attn.{p}_proj" for p in "qkvo"},
    "blocks.{i}.mlp_norm": "model.layers.{i}.post_attention_layernorm",
    **{f"blocks.{{i}}.mlp.{p}_proj": f"model.layers.{{i}}.mlp.{p}_proj" for p in ("gate", "up", "down")},
    "norm_f": "model.norm",
    "lm_head": "lm_head",
}
_PHI_MODULES = {
    "wte": "model.embed_tokens",
    "blocks.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    **{f"blocks.{{i}}.attn.{p}_proj": f"model.layers.{{i}}.self_attn.{p}_proj" for p in "qkv"},
    "blocks.{i}.attn.o_proj": "model.layers.{i}.self_attn.dense",
    "blocks.{i}.mlp.fc": "model.layers.{i}.mlp.fc1",
    "blocks.{i}.mlp.proj": "model.layers.{i}.mlp.fc2",
    "norm_f": "model.final_layernorm",
    "lm_head": "lm_head",
}
_GPT_NEOX_QKV = "gpt_neox.layers.{i}.attention.query_key_value"
_GPT_NEOX_MODULES = {
    "wte": "gpt_neox.embed_in",
    "blocks.{i}.attn_norm": "gpt_neox.layers.{i}.input_layernorm",
    **{f"blocks.{{i}}.attn.{p}_proj": _GPT_NEOX_QKV for p in "qkv"},
    "blocks.{i}.attn.o_proj": "gpt_neox.layers.{i}.attention.dense",
    "blocks.{i}.mlp_norm": "gpt_neox.layers.{i}.post_attention_layernorm",
    "blocks.{i}.mlp.fc": "gpt_neox.layers.{i}.mlp.dense_h_to_4h",
    "blocks.{i}.mlp.proj": "gpt_neox.layers.{i}.mlp.dense_4h_to_h",
    "norm_f": "gpt_neox.final_layer_norm",
    "lm_head": "embed_out",
}

# Features shared by Llama, Mistral and Qwen2: RMSNorm, SwiGLU, full RoPE, sequential residual.
_LLAMA_LIKE = dict(norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", norm_unit_offset=False,
                   scale_embeddings=False, parallel_residual=False, shared_attention_norm=False,
                   lm_head_bias=False, rotary_percentage=1.0)
_LLAMA_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
                   "tie_word_embeddings": False}


def _read_llama(hf: HFConfig) -> dict[str, Any]:
    hf.expect("hidden_act", _SILU)
    attention_bias, mlp_bias = bool(hf.get("attention_bias")), bool(hf.get("mlp_bias"))
    if attention_bias != mlp_bias:
        raise ValueError(f"{hf.path}: attention_bias={attention_bias} with mlp_bias={mlp_bias} is not supported; "
                         "llmtrain's `bias` puts a bias on every linear layer or on none")
    return dict(bias=attention_bias)


def _write_llama(config: Config) -> dict[str, Any]:
    return dict(num_key_value_heads=config.n_query_groups, head_dim=config.head_size, hidden_act="silu",
                attention_bias=config.bias, mlp_bias=config.bias, pretraining_tp=1)


def _read_mistral(hf: HFConfig) -> dict[str, Any]:
    hf.expect("hidden_act", _SILU)
    # NOTE: an absent key means transformers' default window (4096); an explicit null means none.
    window = hf.values["sliding_window"] if "sliding_window" in hf.values else hf.defaults["sliding_window"]
    return dict(sliding_window=window)


def _write_mistral(config: Config) -> dict[str, Any]:
    return dict(num_key_value_heads=config.n_query_groups, head_dim=config.head_size, hidden_act="silu",
                sliding_window=config.sliding_window)


def _read_qwen2(hf: HFConfig) -> dict[str, Any]:
    hf.expect("hidden_act", _SILU)
    n_layer = hf.require("num_hidden_layers")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        # Layers from max_window_layers on use the window, and only with use_sliding_window.
        sliding = hf.get("use_sliding_window") and hf.get("sliding_window") is not None
        first = hf.get("max_window_layers") if sliding else n_layer
        layer_types = ["full_attention"] * min(first, n_layer) + ["sliding_attention"] * max(n_layer - first, 0)
    if len(set(layer_types)) > 1:
        raise ValueError(f"{hf.path}: a sliding window on some layers only ({layer_types}) is not supported; "
                         "llmtrain applies sliding_window to every layer or none")
    return dict(sliding_window=hf.get("sliding_window") if layer_types[0] == "sliding_attention" else None)


def _write_qwen2(config: Config) -> dict[str, Any]:
    sliding = config.sliding_window is not None
    values = dict(num_key_value_heads=config.n_query_groups, hidden_act="silu", use_sliding_window=sliding,
                  sliding_window=config.sliding_window, max_window_layers=0 if sliding else config.n_layer)
    if config.head_size != config.n_embd // config.n_head:
        values["head_dim"] = config.head_size
    return values


def _read_gemma(hf: HFConfig) -> dict[str, Any]:
    # NOTE: Gemma's first configs said "gelu" but meant the tanh approximation; transformers reads
    # `hidden_activation` (4.x) or `hidden_act` (5.x) and maps plain "gelu" to tanh, as we do.
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        raise ValueError(f"{hf.path}: hidden_activation {act!r} is not supported for Gemma; llmtrain implements "
                         "the tanh-approximated GELU")
    if hf.get("attention_bias"):
        raise ValueError(f"{hf.path}: attention_bias=true is not supported for GemmaForCausalLM")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{hf.path}: use_bidirectional_attention=true (every token attends to the whole sequence) "
                         "is not supported for GemmaForCausalLM; llmtrain's attention is causal")
    return {}


def _write_gemma(config: Config) -> dict[str, Any]:
    return dict(num_key_value_heads=config.n_query_groups, head_dim=config.head_size,
                hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", attention_bias=False)


def _read_phi(hf: HFConfig) -> dict[str, Any]:
    if hf.get("qk_layernorm"):
        raise ValueError(f"{hf.path}: qk_layernorm=true is not supported for PhiForCausalLM")
    return dict(gelu_approximate=hf.gelu_approximate())


def _write_phi(config: Config) -> dict[str, Any]:
    values = dict(num_key_value_heads=config.n_query_groups, partial_rotary_factor=config.rotary_percentage,
                  hidden_act="gelu_new" if config.gelu_approximate == "tanh" else "gelu", qk_layernorm=False,
                  resid_pdrop=0.0, embd_pdrop=0.0)
    if config.head_size != config.n_embd // config.n_head:
        values["head_dim"] = config.head_size
    return values


def _read_gpt_neox(hf: HFConfig) -> dict[str, Any]:
    if not hf.get("attention_bias"):
        raise ValueError(f"{hf.path}: attention_bias=false is not supported for GPTNeoXForCausalLM (its MLP "
                         "always has biases; llmtrain's `bias` covers every linear layer)")
    return dict(parallel_residual=bool(hf.get("use_parallel_residual")), gelu_approximate=hf.gelu_approximate())


def _write_gpt_neox(config: Config) -> dict[str, Any]:
    return dict(rotary_pct=config.rotary_percentage, use_parallel_residual=config.parallel_residual,
                attention_bias=True, hidden_act="gelu_new" if config.gelu_approximate == "tanh" else "gelu",
                hidden_dropout=0.0)


def _check_gpt_neox(config: Config) -> list[str]:
    problems = []
    if config.n_query_groups != config.n_head:
        problems.append(f"n_query_groups == n_head (has {config.n_query_groups} and {config.n_head})")
    if config.head_size != config.n_embd // config.n_head:
        problems.append(f"head_size == n_embd // n_head (has {config.head_size})")
    return problems


ADAPTERS: dict[str, Adapter] = {adapter.family: adapter for adapter in (
    Adapter("llama", "LlamaForCausalLM", "llama", _LLAMA_MODULES,
            fixed=dict(_LLAMA_LIKE, attn_bias=False, sliding_window=None),
            hf_defaults=_LLAMA_DEFAULTS, read_fields=_read_llama, write_fields=_write_llama,
            hub_orgs=("meta-llama", "TinyLlama", "HuggingFaceTB")),
    Adapter("mistral", "MistralForCausalLM", "mistral", _LLAMA_MODULES,
            fixed=dict(_LLAMA_LIKE, attn_bias=False, bias=False),
            hf_defaults=dict(_LLAMA_DEFAULTS, max_position_embeddings=131072, sliding_window=4096),
            read_fields=_read_mistral, write_fields=_write_mistral, hub_orgs=("mistralai",)),
    Adapter("qwen2", "Qwen2ForCausalLM", "qwen2", _LLAMA_MODULES,
            fixed=dict(_LLAMA_LIKE, attn_bias=True, bias=False),
            hf_defaults=dict(_LLAMA_DEFAULTS, max_position_embeddings=32768, max_window_layers=28),
            read_fields=_read_qwen2, write_fields=_write_qwen2, hub_orgs=("Qwen",)),
    Adapter("gemma", "GemmaForCausalLM", "gemma", _LLAMA_MODULES,
            fixed=dict(norm_class_name="RMSNorm", mlp_class_name="GemmaMLP", gelu_approximate="tanh",
                       norm_unit_offset=True, scale_embeddings=True, parallel_residual=False,
                       shared_attention_norm=False, bias=False, attn_bias=False, lm_head_bias=False,
                       rotary_percentage=1.0, sliding_window=None),
            hf_defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True,
                             head_dim=256),
            read_fields=_read_gemma, write_fields=_write_gemma, hub_orgs=("google",)),
    Adapter("phi", "PhiForCausalLM", "phi", _PHI_MODULES,
            fixed=dict(norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", parallel_residual=True,
                       shared_attention_norm=True, bias=True, attn_bias=False, lm_head_bias=True,
                       norm_unit_offset=False, scale_embeddings=False, sliding_window=None),
            hf_defaults=dict(hidden_act="gelu_new", layer_norm_eps=1e-5, max_position_embeddings=2048,
                             tie_word_embeddings=False, partial_rotary_factor=0.5),
            read_fields=_read_phi, write_fields=_write_phi, norm_eps_key="layer_norm_eps", hub_orgs=("microsoft",)),
    Adapter("gpt_neox", "GPTNeoXForCausalLM", "gpt_neox", _GPT_NEOX_MODULES,
            fixed=dict(norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", shared_attention_norm=False,
                       bias=True, attn_bias=False, lm_head_bias=False, norm_unit_offset=False,
                       scale_embeddings=False, sliding_window=None),
            hf_defaults=dict(hidden_act="gelu", layer_norm_eps=1e-5, max_position_embeddings=2048,
                             tie_word_embeddings=False, rotary_pct=0.25, use_parallel_residual=True,
                             attention_bias=True),
            read_fields=_read_gpt_neox, write_fields=_write_gpt_neox, norm_eps_key="layer_norm_eps",
            rope_base_key="rotary_emb_base", check=_check_gpt_neox,
            # transformers 5 names the output layer lm_head in memory and embed_out on the Hub.
            read_aliases={"lm_head": "embed_out"}, hub_orgs=("EleutherAI",)),
)}
"""Every supported transformers architecture, by family; `adapter_for_config` tries them in this order."""


def adapter_for_config(config: Config) -> Adapter:
    """The transformers architecture with exactly the features of `config`, or a ValueError saying what differs.

    Among the architectures that fit, the one the model's Hub organization publishes comes first.
    """
    fitting = [adapter for adapter in ADAPTERS.values() if not adapter.mismatches(config)]
    org = (config.hf_config or {}).get("org")
    for adapter in fitting:
        if org in adapter.hub_orgs:
            return adapter
    if fitting:
        return fitting[0]
    closest = min(ADAPTERS.values(), key=lambda adapter: len(adapter.mismatches(config)))
    raise ValueError(
        f"Model config {config.name or '(custom)'} matches no transformers architecture that llmtrain converts "
        f"to ({', '.join(a.architecture for a in ADAPTERS.values())}). Closest is {closest.architecture}, "
        f"which needs {', '.join(closest.mismatches(config))}"
    )


def adapter_for_hf(values: dict[str, Any], path: Path) -> Adapter:
    """The adapter for a config.json, by its `architectures` (or `model_type`)."""
    architectures = values.get("architectures") or []
    for adapter in ADAPTERS.values():
        by_type = not architectures and values.get("model_type") == adapter.model_type
        if adapter.architecture in architectures or by_type:
            return adapter
    found = architectures or values.get("model_type")
    if values.get("auto_map"):
        raise ValueError(f"{path}: architecture {found} is defined by remote code (auto_map in config.json), which "
                         "llmtrain never runs (no trust_remote_code); convert only models whose architecture "
                         f"transformers ships: {', '.join(a.architecture for a in ADAPTERS.values())}")
    raise ValueError(f"{path}: architecture {found} is not supported; llmtrain converts "
                     f"{', '.join(a.architecture for a in ADAPTERS.values())}")


def config_from_hf(values: dict[str, Any], path: Path) -> tuple[Adapter, Config]:
    """The adapter and the exact llmtrain Config of the model a config.json describes (not matched to the zoo)."""
    adapter = adapter_for_hf(values, path)
    hf = HFConfig(values, path, adapter.hf_defaults)
    # A Hub id ("org/name") names the model; a local path says only the folder's name.
    name_or_path = str(values.get("_name_or_path") or "").rstrip("/")
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/")):
        org, name = name_or_path.split("/")
    else:
        org, name = "", Path(name_or_path).name or path.parent.name
    hf_config = {"org": org, "name": name}
    try:
        config = Config(hf_config=hf_config, **adapter.config_fields(hf))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path} does not describe a valid model: {error}") from error
    return adapter, config


# ---- the zoo ---------------------------------------------------------------------------------------

def zoo_config(config: Config, hints: list[str]) -> Config:
    """The zoo entry with the architecture of `config` (preferring one named like a hint), else `config`.

    NOTE: a matched entry is taken whole, block_size included: the zoo's value is the context the
    model really supports (Qwen2.5-7B says 131072 in config.json, but reaches it only with YaRN).
    """
    candidates = [Config(**entry) for entry in MODEL_ZOO]
    candidates = [entry for entry in candidates if not architecture_differences(entry, config)]
    wanted = {hint.lower() for hint in hints if hint}
    for entry in candidates:
        if entry.name.lower() in wanted or entry.hf_config.get("name", "").lower() in wanted:
            return entry
    return candidates[0] if candidates else config


def named_config(config: Config, model_name: str, where: Path) -> Config:
    """The zoo entry `model_name`, after checking that it describes the same model as `config` (read from `where`)."""
    named = Config.from_name(model_name)
    differences = architecture_differences(named, config)
    if differences:
        raise ValueError(f"--model_name {model_name} does not describe the model in {where} (zoo vs file): "
                         f"{'; '.join(differences)}. Leave out --model_name to take the architecture from the file")
    return named


def state_dict_from_hf(hf_state_dict: dict[str, "torch.Tensor"], config: Config) -> dict[str, "torch.Tensor"]:
    """Rename a transformers state dict (in memory or from files) to llmtrain names; GPT-NeoX's QKV is split."""
    adapter = adapter_for_config(config)
    ours: dict[str, "torch.Tensor"] = {}
    for hf_name, tensor in hf_state_dict.items():
        if not IGNORED_HF_TENSORS.search(hf_name):
            ours.update(adapter.tensors_from_hf(config, hf_name, tensor))
    return ours
