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

Mixtures of experts (Mixtral, Qwen3-MoE, OLMoE): llmtrain stacks each expert weight of a layer into one 3-D
tensor (`blocks.{i}.mlp.experts.gate_proj`, experts first); the Hub's checkpoints, and what transformers'
`save_pretrained` writes, keep one 2-D tensor per expert (`...experts.{e}.gate_proj.weight`, Mixtral's
`w1`/`w3`/`w2`), which is what `to_hf` writes and `from_hf` reads. transformers 5 fuses them in memory
(`experts.gate_up_proj`, gate rows first), which `state_dict_from_hf` also reads. The aux-loss-free selection
bias (`expert_bias`) has no counterpart: read as zeros, and a non-zero one is refused on export.

config.json is written in the layout the Hugging Face Hub uses (`rope_theta`, `rope_scaling`,
`rotary_pct`, ...), which every transformers release reads; reading accepts it and the
`rope_parameters` layout that transformers 5 writes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

from llmtrain.config import MODEL_ZOO, Config, architecture_differences

if TYPE_CHECKING:
    import torch

EXPERT_BIAS = re.compile(r"^blocks\.(\d+)\.mlp\.expert_bias$")
"""llmtrain's per-layer aux-loss-free selection bias, which no transformers family has."""
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

    def refuse_if(self, key: str, why: str) -> None:
        """A ValueError naming ``key`` when config.json sets it (not false, null, 0 or empty): llmtrain lacks it."""
        if self.get(key):
            raise ValueError(f"{self.path}: {key}={json.dumps(self.get(key))} is not supported for "
                             f"{self.get('architectures')}: {why}")


@dataclass(frozen=True)
class Adapter:
    """One transformers architecture: names, fixed features and config.json fields."""

    family: str
    """Short name: llama, mistral, qwen2, gemma, phi, gpt_neox, mixtral, qwen3_moe or olmoe."""
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
    experts: dict[str, str] = field(default_factory=dict)
    """A mixture of experts: llmtrain's stacked expert tensor -> the Hub's tensor of one expert (`{e}`)."""
    fused_experts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """transformers' in-memory expert tensor -> the llmtrain tensors concatenated in it along dim 1 (read only)."""
    needs_moe: bool = False
    """Only mixtures of experts are this family (`fixed` says n_expert=0 for the dense families)."""

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

    @cached_property
    def _expert_patterns(self) -> list[tuple[re.Pattern, str]]:
        """(regex of the Hub's per-expert tensor, with groups i and e; the llmtrain tensor template)."""
        return [(re.compile("^" + re.escape(theirs).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
                            + "$"), ours) for ours, theirs in self.experts.items()]

    def expert_slot(self, hf_name: str) -> Optional[tuple[str, int]]:
        """(llmtrain tensor, expert) that the Hub's per-expert tensor `hf_name` is one slice of; None for others."""
        for pattern, ours in self._expert_patterns:
            match = pattern.match(hf_name)
            if match:
                return ours.replace("{i}", match["i"]), int(match["e"])
        return None

    def weights_from_hf(self, config: Config,
                        named: Iterable[tuple[str, "torch.Tensor"]]) -> Iterator[tuple[str, "torch.Tensor"]]:
        """llmtrain (name, tensor) pairs from transformers (name, tensor) pairs, as they come. The experts of a
        weight are stacked once all have come (the Hub's files keep one tensor per expert); only those wait."""
        import torch

        pending: dict[str, dict[int, "torch.Tensor"]] = {}
        for hf_name, tensor in named:
            slot = self.expert_slot(hf_name)
            if slot is None:
                yield from self.tensors_from_hf(config, hf_name, tensor)
                continue
            name, expert = slot
            experts = pending.setdefault(name, {})
            experts[expert] = tensor
            if len(experts) == config.n_expert:
                yield name, torch.stack([experts[e] for e in range(config.n_expert)])
                del pending[name]
        if pending:
            name, experts = next(iter(pending.items()))
            raise ValueError(f"the weights hold {len(experts)} of the {config.n_expert} experts of {name}")
        for layer in range(config.n_layer if config.is_moe else 0):
            yield f"blocks.{layer}.mlp.expert_bias", torch.zeros(config.n_expert, dtype=torch.float32)

    def tensors_from_hf(self, config: Config, hf_name: str, tensor: "torch.Tensor") -> list[tuple[str, "torch.Tensor"]]:
        """llmtrain (name, tensor) pairs held in transformers tensor `hf_name` (three for a fused QKV, two for
        transformers' in-memory gate_up_proj)."""
        template, layer = _template(hf_name)
        if template in self.fused_experts:
            names = [ours.replace("{i}", layer or "") for ours in self.fused_experts[template]]
            return list(zip(names, tensor.chunk(len(names), dim=1)))
        module, param = hf_name.rsplit(".", 1)
        template, layer = _template(module)
        if template not in self._from_hf:
            raise KeyError(f"{hf_name} is not a {self.architecture} weight that llmtrain knows")
        names = [ours.replace("{i}", layer or "") + "." + param for ours in self._from_hf[template]]
        if len(names) == 1:
            return [(names[0], tensor)]
        per_head = tensor.reshape(config.n_head, 3, config.head_size, *tensor.shape[1:])  # (nh, 3, hs, ...)
        return [(name, per_head[:, i].reshape(-1, *tensor.shape[1:])) for i, name in enumerate(names)]

    def hf_layout(self, config: Config, names: list[str]) -> dict[str, "HFSource"]:
        """transformers tensor -> what it is made of, ordered as `names`: the llmtrain tensors (q, k, v in that
        order) or one expert's slice of a stacked expert tensor (consecutive, expert by expert). `expert_bias`
        has no transformers tensor (it is checked to be zero instead)."""
        layout: dict[str, HFSource] = {}
        for name in names:
            if EXPERT_BIAS.match(name):
                continue
            template, layer = _template(name)
            if template in self.experts:
                for expert in range(config.n_expert):
                    hf_name = self.experts[template].replace("{i}", layer or "").replace("{e}", str(expert))
                    layout[hf_name] = HFSource([name], expert)
                continue
            layout.setdefault(self.hf_name(name), HFSource([])).parts.append(name)
        order = list(self.modules)
        for source in layout.values():
            source.parts.sort(key=lambda name: order.index(_template(name.rsplit(".", 1)[0])[0])
                              if source.expert is None else 0)
        return layout

    def fuse(self, config: Config, tensors: list["torch.Tensor"], expert: Optional[int] = None) -> "torch.Tensor":
        """One transformers tensor from its llmtrain parts: a plain copy, one expert of a stacked expert tensor,
        or q, k, v interleaved per head."""
        if expert is not None:
            return tensors[0][expert]
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
        if self.needs_moe and not config.is_moe:
            problems.append("a mixture of experts (n_expert > 0)")
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


@dataclass
class HFSource:
    """What one transformers tensor is made of: llmtrain tensors (several for GPT-NeoX's fused QKV), or the slice
    `expert` of one stacked expert tensor."""

    parts: list[str]
    expert: Optional[int] = None


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

_ROUTER = "model.layers.{i}.mlp.gate"
_MOE_ATTENTION = {key: value for key, value in _LLAMA_MODULES.items() if ".mlp." not in key}
_QK_NORMS = {f"blocks.{{i}}.attn.{p}_norm": f"model.layers.{{i}}.self_attn.{p}_norm" for p in "qk"}
_MIXTRAL_MOE = "model.layers.{i}.block_sparse_moe"
_MIXTRAL_MODULES = {**_MOE_ATTENTION, "blocks.{i}.mlp.router": f"{_MIXTRAL_MOE}.gate"}
_QWEN3_MOE_MODULES = {**_MOE_ATTENTION, **_QK_NORMS, "blocks.{i}.mlp.router": _ROUTER}
_EXPERTS = {f"blocks.{{i}}.mlp.experts.{p}_proj": f"model.layers.{{i}}.mlp.experts.{{e}}.{p}_proj.weight"
            for p in ("gate", "up", "down")}
_MIXTRAL_EXPERTS = {f"blocks.{{i}}.mlp.experts.{p}_proj": f"{_MIXTRAL_MOE}.experts.{{e}}.{w}.weight"
                    for p, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))}
# transformers 5 in memory: every family as model.layers.{i}.mlp, the experts fused (gate rows, then up rows).
_FUSED_EXPERTS = {"model.layers.{i}.mlp.experts.gate_up_proj": ("blocks.{i}.mlp.experts.gate_proj",
                                                                "blocks.{i}.mlp.experts.up_proj"),
                  "model.layers.{i}.mlp.experts.down_proj": ("blocks.{i}.mlp.experts.down_proj",)}

# Features shared by Llama, Mistral and Qwen2: RMSNorm, SwiGLU, full RoPE, sequential residual.
_LLAMA_LIKE = dict(norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", norm_unit_offset=False,
                   scale_embeddings=False, parallel_residual=False, shared_attention_norm=False,
                   lm_head_bias=False, rotary_percentage=1.0)
_DENSE = dict(n_expert=0, qk_norm="none")
"""The dense families: one MLP per block, no norm on q and k."""
# The mixtures of experts: Llama's features, no biases, softmax routing, no shared expert.
_MOE = dict(_LLAMA_LIKE, bias=False, attn_bias=False, router_score="softmax", n_shared_expert=0)
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


def _moe_fields(hf: HFConfig, width_key: str) -> dict[str, Any]:
    """The experts' fields of a config.json: their number, how many per token, their width (under `width_key`) and
    the load-balancing loss's weight."""
    # NOTE: transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map), the Hub num_experts.
    keys = ("num_experts", "num_local_experts")
    n_expert = next((hf.values[key] for key in keys if hf.values.get(key)), None) or next(
        (hf.get(key) for key in keys if hf.get(key)), None)
    if not n_expert:
        raise ValueError(f"{hf.path}: num_experts is {n_expert!r}; a {hf.get('architectures')} config needs experts")
    return dict(n_expert=n_expert, n_expert_per_token=hf.require("num_experts_per_tok"),
                moe_intermediate_size=hf.require(width_key),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0))


def _write_moe(config: Config, experts_key: str) -> dict[str, Any]:
    return {experts_key: config.n_expert, "num_experts_per_tok": config.n_expert_per_token,
            "router_aux_loss_coef": config.router_aux_loss_coef, "output_router_logits": False,
            "num_key_value_heads": config.n_query_groups, "hidden_act": "silu"}


def _read_mixtral(hf: HFConfig) -> dict[str, Any]:
    hf.expect("hidden_act", _SILU)
    hf.refuse_if("router_jitter_noise", "llmtrain's router does not multiply its input by noise in training, so "
                                        "fine-tuning would differ; set it to 0.0")
    return dict(sliding_window=hf.get("sliding_window"), **_moe_fields(hf, "intermediate_size"))


def _write_mixtral(config: Config) -> dict[str, Any]:
    # The experts' width is Mixtral's intermediate_size.
    return dict(_write_moe(config, "num_local_experts"), intermediate_size=config.moe_intermediate_size,
                head_dim=config.head_size, sliding_window=config.sliding_window, router_jitter_noise=0.0)


def _read_qwen3_moe(hf: HFConfig) -> dict[str, Any]:
    hf.expect("hidden_act", _SILU)
    hf.refuse_if("attention_bias", "llmtrain's mixtures of experts have no biases (here on q, k, v and o)")
    hf.refuse_if("use_sliding_window", "llmtrain applies a sliding window to every layer or none, Qwen3-MoE to the "
                                       "layers from max_window_layers on")
    dense = ("llmtrain's mixture of experts is the MLP of every layer; a model with dense MLP layers between them "
             "(as this setting makes) cannot be matched")
    hf.refuse_if("mlp_only_layers", dense)
    if hf.get("decoder_sparse_step") != 1:
        raise ValueError(f"{hf.path}: decoder_sparse_step={hf.get('decoder_sparse_step')} is not supported for "
                         f"Qwen3MoeForCausalLM: {dense}")
    return dict(norm_topk_prob=bool(hf.get("norm_topk_prob")), **_moe_fields(hf, "moe_intermediate_size"))


def _write_qwen3_moe(config: Config) -> dict[str, Any]:
    return dict(_write_moe(config, "num_experts"), moe_intermediate_size=config.moe_intermediate_size,
                head_dim=config.head_size, norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1,
                mlp_only_layers=[], attention_bias=False, use_sliding_window=False, sliding_window=None,
                max_window_layers=config.n_layer)


def _read_olmoe(hf: HFConfig) -> dict[str, Any]:
    hf.expect("hidden_act", _SILU)
    hf.refuse_if("clip_qkv", "llmtrain's attention does not clamp q, k and v")
    hf.refuse_if("attention_bias", "llmtrain's mixtures of experts have no biases (here on q, k, v and o)")
    return dict(norm_topk_prob=bool(hf.get("norm_topk_prob")), **_moe_fields(hf, "intermediate_size"))


def _write_olmoe(config: Config) -> dict[str, Any]:
    return dict(_write_moe(config, "num_experts"), intermediate_size=config.moe_intermediate_size,
                norm_topk_prob=config.norm_topk_prob, clip_qkv=None, attention_bias=False)


def _check_olmoe(config: Config) -> list[str]:
    # transformers' OLMoE sizes its heads and its q norm from hidden_size alone.
    if config.head_size != config.n_embd // config.n_head:
        return [f"head_size == n_embd // n_head (has {config.head_size})"]
    return []


def _check_gpt_neox(config: Config) -> list[str]:
    problems = []
    if config.n_query_groups != config.n_head:
        problems.append(f"n_query_groups == n_head (has {config.n_query_groups} and {config.n_head})")
    if config.head_size != config.n_embd // config.n_head:
        problems.append(f"head_size == n_embd // n_head (has {config.head_size})")
    return problems


ADAPTERS: dict[str, Adapter] = {adapter.family: adapter for adapter in (
    Adapter("llama", "LlamaForCausalLM", "llama", _LLAMA_MODULES,
            fixed=dict(_LLAMA_LIKE, **_DENSE, attn_bias=False, sliding_window=None),
            hf_defaults=_LLAMA_DEFAULTS, read_fields=_read_llama, write_fields=_write_llama,
            hub_orgs=("meta-llama", "TinyLlama", "HuggingFaceTB")),
    Adapter("mistral", "MistralForCausalLM", "mistral", _LLAMA_MODULES,
            fixed=dict(_LLAMA_LIKE, **_DENSE, attn_bias=False, bias=False),
            hf_defaults=dict(_LLAMA_DEFAULTS, max_position_embeddings=131072, sliding_window=4096),
            read_fields=_read_mistral, write_fields=_write_mistral, hub_orgs=("mistralai",)),
    Adapter("qwen2", "Qwen2ForCausalLM", "qwen2", _LLAMA_MODULES,
            fixed=dict(_LLAMA_LIKE, **_DENSE, attn_bias=True, bias=False),
            hf_defaults=dict(_LLAMA_DEFAULTS, max_position_embeddings=32768, max_window_layers=28),
            read_fields=_read_qwen2, write_fields=_write_qwen2, hub_orgs=("Qwen",)),
    Adapter("gemma", "GemmaForCausalLM", "gemma", _LLAMA_MODULES,
            fixed=dict(norm_class_name="RMSNorm", mlp_class_name="GemmaMLP", gelu_approximate="tanh",
                       norm_unit_offset=True, scale_embeddings=True, parallel_residual=False,
                       shared_attention_norm=False, bias=False, attn_bias=False, lm_head_bias=False,
                       rotary_percentage=1.0, sliding_window=None, **_DENSE),
            hf_defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True,
                             head_dim=256),
            read_fields=_read_gemma, write_fields=_write_gemma, hub_orgs=("google",)),
    Adapter("phi", "PhiForCausalLM", "phi", _PHI_MODULES,
            fixed=dict(norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", parallel_residual=True,
                       shared_attention_norm=True, bias=True, attn_bias=False, lm_head_bias=True,
                       norm_unit_offset=False, scale_embeddings=False, sliding_window=None, **_DENSE),
            hf_defaults=dict(hidden_act="gelu_new", layer_norm_eps=1e-5, max_position_embeddings=2048,
                             tie_word_embeddings=False, partial_rotary_factor=0.5),
            read_fields=_read_phi, write_fields=_write_phi, norm_eps_key="layer_norm_eps", hub_orgs=("microsoft",)),
    Adapter("gpt_neox", "GPTNeoXForCausalLM", "gpt_neox", _GPT_NEOX_MODULES,
            fixed=dict(norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", shared_attention_norm=False,
                       bias=True, attn_bias=False, lm_head_bias=False, norm_unit_offset=False,
                       scale_embeddings=False, sliding_window=None, **_DENSE),
            hf_defaults=dict(hidden_act="gelu", layer_norm_eps=1e-5, max_position_embeddings=2048,
                             tie_word_embeddings=False, rotary_pct=0.25, use_parallel_residual=True,
                             attention_bias=True),
            read_fields=_read_gpt_neox, write_fields=_write_gpt_neox, norm_eps_key="layer_norm_eps",
            rope_base_key="rotary_emb_base", check=_check_gpt_neox,
            # transformers 5 names the output layer lm_head in memory and embed_out on the Hub.
            read_aliases={"lm_head": "embed_out"}, hub_orgs=("EleutherAI",)),
    Adapter("mixtral", "MixtralForCausalLM", "mixtral", _MIXTRAL_MODULES,
            fixed=dict(_MOE, qk_norm="none", norm_topk_prob=True),
            hf_defaults=dict(_LLAMA_DEFAULTS, rms_norm_eps=1e-5, max_position_embeddings=131072,
                             num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001),
            read_fields=_read_mixtral, write_fields=_write_mixtral, hub_orgs=("mistralai",),
            # transformers 5 names the router model.layers.{i}.mlp.gate in memory.
            read_aliases={_ROUTER: f"{_MIXTRAL_MOE}.gate"}, experts=_MIXTRAL_EXPERTS, fused_experts=_FUSED_EXPERTS,
            needs_moe=True),
    Adapter("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", _QWEN3_MOE_MODULES,
            fixed=dict(_MOE, qk_norm="head", sliding_window=None),
            hf_defaults=dict(_LLAMA_DEFAULTS, max_position_embeddings=32768, num_experts=128, num_experts_per_tok=8,
                             moe_intermediate_size=768, norm_topk_prob=False, decoder_sparse_step=1,
                             router_aux_loss_coef=0.001),
            read_fields=_read_qwen3_moe, write_fields=_write_qwen3_moe, hub_orgs=("Qwen",), experts=_EXPERTS,
            fused_experts=_FUSED_EXPERTS, needs_moe=True),
    Adapter("olmoe", "OlmoeForCausalLM", "olmoe", _QWEN3_MOE_MODULES,
            fixed=dict(_MOE, qk_norm="full", sliding_window=None),
            hf_defaults=dict(_LLAMA_DEFAULTS, rms_norm_eps=1e-5, max_position_embeddings=4096, num_experts=64,
                             num_experts_per_tok=8, norm_topk_prob=False, router_aux_loss_coef=0.01),
            read_fields=_read_olmoe, write_fields=_write_olmoe, check=_check_olmoe, hub_orgs=("allenai",),
            experts=_EXPERTS, fused_experts=_FUSED_EXPERTS, needs_moe=True),
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
    same_kind = [adapter for adapter in ADAPTERS.values() if adapter.needs_moe == config.is_moe]  # dense or MoE
    closest = min(same_kind, key=lambda adapter: len(adapter.mismatches(config)))
    raise ValueError(
        f"Model config {config.name or '(custom)'} matches no transformers architecture that llmtrain converts "
        f"to ({', '.join(a.architecture for a in ADAPTERS.values())}). Closest is {closest.architecture}, "
        f"which needs {', '.join(closest.mismatches(config))}"
    )


UNMATCHED_ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "its attention is multi-head latent attention (MLA: low-rank q and kv with a separate "
                             "RoPE part), its first layers have dense MLPs (first_k_dense_replace), and its router "
                             "picks experts within groups (n_group, topk_group)",
    "DeepseekV2ForCausalLM": "its attention is multi-head latent attention (MLA), its first layers have dense MLPs "
                             "(first_k_dense_replace), and its router picks experts within groups",
    "Qwen2MoeForCausalLM": "its shared expert's output is scaled by a sigmoid gate of its own "
                           "(shared_expert_gate), which llmtrain's shared experts do not have",
    "GptOssForCausalLM": "its experts have biases and a clamped SwiGLU (alpha 1.702, limit 7.0), and its attention "
                         "has learned sinks and a sliding window on every other layer",
    "Qwen3NextForCausalLM": "most of its layers are Gated DeltaNet linear attention, and its shared expert has a "
                            "sigmoid gate",
    "Llama4ForConditionalGeneration": "its layers alternate chunked attention with RoPE and global attention without "
                                      "it, and its top-1 router scales the expert's input by a sigmoid",
    "PhimoeForCausalLM": "its router is SparseMixer, not a top-k over softmax scores",
}
"""Mixtures of experts that transformers ships and llmtrain cannot compute exactly, with what it lacks."""


def adapter_for_hf(values: dict[str, Any], path: Path) -> Adapter:
    """The adapter for a config.json, by its `architectures` (or `model_type`)."""
    architectures = values.get("architectures") or []
    for adapter in ADAPTERS.values():
        by_type = not architectures and values.get("model_type") == adapter.model_type
        if adapter.architecture in architectures or by_type:
            return adapter
    found = architectures or values.get("model_type")
    for architecture in architectures:
        if architecture in UNMATCHED_ARCHITECTURES:
            raise ValueError(f"{path}: {architecture} cannot be converted exactly: "
                             f"{UNMATCHED_ARCHITECTURES[architecture]}. llmtrain converts "
                             f"{', '.join(a.architecture for a in ADAPTERS.values())}")
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
    return dict(adapter.weights_from_hf(config, ((hf_name, tensor) for hf_name, tensor in hf_state_dict.items()
                                                 if not IGNORED_HF_TENSORS.search(hf_name))))
