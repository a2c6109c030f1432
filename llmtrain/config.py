"""The model architecture (`Config`) and the model zoo of named architectures.

Pure data: importing this module must not import torch, so that the CLI can
parse and validate arguments before anything heavy is loaded.
"""

import difflib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

NormClassName = Literal["LayerNorm", "RMSNorm"]
MLPClassName = Literal["GptNeoxMLP", "LLaMAMLP", "GemmaMLP"]
GeluApproximate = Literal["none", "tanh"]
RouterScore = Literal["softmax", "sigmoid"]
QKNorm = Literal["none", "head", "full"]

_CHOICES = {
    "norm_class_name": ("LayerNorm", "RMSNorm"),
    "mlp_class_name": ("GptNeoxMLP", "LLaMAMLP", "GemmaMLP"),
    "gelu_approximate": ("none", "tanh"),
    "router_score": ("softmax", "sigmoid"),
    "qk_norm": ("none", "head", "full"),
}
_ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len")


@dataclass
class Config:
    """Architecture of a GPT-style decoder. The defaults describe a small Llama-style model."""

    name: str = ""
    """Name of the architecture in the model zoo, e.g. `Llama-3.2-1B`."""
    hf_config: dict = field(default_factory=dict)
    """Hugging Face repository this architecture comes from: {"org": ..., "name": ...}."""
    block_size: int = 4096
    """Longest sequence the model supports (length of the RoPE cache)."""
    vocab_size: int = 32000
    """Size of the tokenizer's vocabulary."""
    padding_multiple: int = 512
    """Round the embedding table up to a multiple of this, for fast matmuls."""
    padded_vocab_size: Optional[int] = None
    """Rows of the embedding and output layers. None: vocab_size rounded up to padding_multiple."""
    n_layer: int = 16
    """Number of transformer blocks."""
    n_head: int = 32
    """Number of attention (query) heads."""
    n_embd: int = 2048
    """Width of the residual stream."""
    n_query_groups: Optional[int] = None
    """Number of key/value heads: n_head is multi-head, 1 is multi-query, else grouped-query. None: n_head."""
    head_size: Optional[int] = None
    """Width of one attention head. None: n_embd // n_head."""
    rotary_percentage: float = 1.0
    """Fraction of each head's dims that RoPE rotates (the first ones); Pythia 0.25, Phi-2 0.4."""
    rope_base: float = 10000.0
    """RoPE base (theta)."""
    rope_scaling: Optional[dict] = None
    """Llama 3.1-style RoPE scaling: {factor, low_freq_factor, high_freq_factor, original_max_seq_len}."""
    parallel_residual: bool = False
    """Add attention and MLP outputs to the same residual (GPT-NeoX, Phi) instead of one after the other."""
    shared_attention_norm: bool = False
    """With parallel_residual: one norm feeds both attention and MLP (Phi-2)."""
    bias: bool = False
    """Bias on every linear layer (GPT-NeoX, Phi)."""
    attn_bias: bool = False
    """Bias on the query, key and value projections only (Qwen2)."""
    lm_head_bias: bool = False
    """Bias on the output layer (Phi-2)."""
    norm_class_name: NormClassName = "RMSNorm"
    """Normalization layer."""
    norm_eps: float = 1e-5
    """Epsilon of the normalization layers."""
    norm_unit_offset: bool = False
    """RMSNorm multiplies by (1 + weight) instead of weight (Gemma)."""
    mlp_class_name: MLPClassName = "LLaMAMLP"
    """MLP: GptNeoxMLP (GELU), LLaMAMLP (SwiGLU) or GemmaMLP (GeGLU)."""
    intermediate_size: Optional[int] = None
    """Hidden width of the MLP. None: 4 * n_embd."""
    gelu_approximate: GeluApproximate = "none"
    """GELU flavour of GptNeoxMLP and GemmaMLP: exact ('none') or the tanh approximation."""
    tie_embeddings: bool = False
    """The output layer reuses the token embedding matrix."""
    scale_embeddings: bool = False
    """Multiply token embeddings by sqrt(n_embd) (Gemma)."""
    sliding_window: Optional[int] = None
    """Each token attends to at most this many tokens, itself included (Mistral v0.1). None: no limit."""
    qk_norm: QKNorm = "none"
    """An RMSNorm on the queries and keys before RoPE: "head" normalises each head (a weight of head_size, shared
    by the heads; Qwen3), "full" the whole query and the whole key projection (weights of n_head * head_size and
    n_query_groups * head_size; OLMoE). "none": no such norm."""
    n_expert: int = 0
    """Routed experts of each block's mixture-of-experts MLP (Mixtral 8, Qwen3-30B-A3B 128). 0: a dense MLP."""
    n_expert_per_token: int = 0
    """Experts each token is routed to (top-k): Mixtral 2, Qwen3-MoE and OLMoE 8."""
    moe_intermediate_size: Optional[int] = None
    """Hidden width of one expert (and of one shared expert). None: intermediate_size."""
    n_shared_expert: int = 0
    """Experts every token passes through besides its routed ones (DeepSeek); their outputs are added unweighted."""
    router_score: RouterScore = "softmax"
    """How the router turns its logits into scores: softmax over the experts (Mixtral, Qwen3-MoE, OLMoE) or a
    sigmoid per expert (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Renormalise the k chosen scores to sum to 1 (Mixtral, Qwen3-MoE); False keeps them as scored (OLMoE)."""
    router_aux_loss_coef: float = 0.0
    """Training only: weight of the Switch/Mixtral load-balancing loss added to the loss (Mixtral 0.02). 0: off."""
    router_z_loss_coef: float = 0.0
    """Training only: weight of the router z-loss, the mean squared log-sum-exp of the router's logits. 0: off."""
    router_bias_update_rate: float = 0.0
    """Training only: DeepSeek's auxiliary-loss-free balancing. After each optimizer step each expert's selection
    bias moves by this rate towards the mean load (down when overloaded, up when underloaded). 0: off."""

    def __post_init__(self) -> None:
        self._fill_derived_sizes()
        self._validate()

    def _fill_derived_sizes(self) -> None:
        if self.padded_vocab_size is None:
            self.padded_vocab_size = _round_up(self.vocab_size, self.padding_multiple)
        if self.n_query_groups is None:
            self.n_query_groups = self.n_head
        if self.head_size is None:
            if self.n_embd % self.n_head != 0:
                raise ValueError(
                    f"Config {self.name!r}: n_embd {self.n_embd} is not divisible by n_head {self.n_head}; "
                    "change one of them or set head_size explicitly"
                )
            self.head_size = self.n_embd // self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.n_embd
        if self.moe_intermediate_size is None and self.n_expert > 0:
            self.moe_intermediate_size = self.intermediate_size

    def _validate(self) -> None:
        where = f"Config {self.name!r}"
        for name in ("block_size", "vocab_size", "padding_multiple", "n_layer", "n_head", "n_embd",
                     "n_query_groups", "head_size", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{where}: {name} must be positive, got {getattr(self, name)}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{where}: {name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(
                f"{where}: padded_vocab_size {self.padded_vocab_size} is smaller than vocab_size "
                f"{self.vocab_size}; raise it or leave it unset"
            )
        if self.n_head % self.n_query_groups != 0:
            raise ValueError(
                f"{where}: n_head {self.n_head} is not divisible by n_query_groups {self.n_query_groups}; "
                f"use a divisor of {self.n_head}"
            )
        if not 0.0 < self.rotary_percentage <= 1.0:
            raise ValueError(f"{where}: rotary_percentage must be in (0, 1], got {self.rotary_percentage}")
        if self.rope_n_elem % 2 != 0:
            raise ValueError(
                f"{where}: rotary_percentage {self.rotary_percentage} x head_size {self.head_size} gives "
                f"{self.rope_n_elem} rotary dims, which must be even; adjust rotary_percentage"
            )
        if self.rope_scaling is not None:
            missing = [key for key in _ROPE_SCALING_KEYS if key not in self.rope_scaling]
            if missing:
                raise ValueError(f"{where}: rope_scaling is missing {missing}; it needs {list(_ROPE_SCALING_KEYS)}")
            unknown = sorted(set(self.rope_scaling) - set(_ROPE_SCALING_KEYS))
            if unknown:
                raise ValueError(f"{where}: rope_scaling has unknown keys {unknown}; llmtrain implements Llama 3.1's "
                                 f"RoPE scaling only, which takes exactly {list(_ROPE_SCALING_KEYS)}")
        if self.shared_attention_norm and not self.parallel_residual:
            raise ValueError(f"{where}: shared_attention_norm needs parallel_residual=True")
        if self.norm_unit_offset and self.norm_class_name != "RMSNorm":
            raise ValueError(f"{where}: norm_unit_offset only applies to norm_class_name='RMSNorm'")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"{where}: sliding_window must be positive or None, got {self.sliding_window}")
        self._validate_moe(where)

    def _validate_moe(self, where: str) -> None:
        for name in ("n_expert", "n_expert_per_token", "n_shared_expert", "router_aux_loss_coef",
                     "router_z_loss_coef", "router_bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{where}: {name} must be 0 or more, got {getattr(self, name)}")
        if self.n_expert == 0:
            moe_only = [name for name in ("n_expert_per_token", "n_shared_expert", "moe_intermediate_size",
                                          "router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate")
                        if getattr(self, name)]
            if moe_only:
                raise ValueError(f"{where}: {', '.join(moe_only)} only apply to a mixture of experts; "
                                 "set n_expert above 0 or leave them unset")
            return
        if not 1 <= self.n_expert_per_token <= self.n_expert:
            raise ValueError(f"{where}: n_expert_per_token must be between 1 and n_expert ({self.n_expert}), "
                             f"got {self.n_expert_per_token}")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"{where}: moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if self.mlp_class_name == "GptNeoxMLP":
            raise ValueError(f"{where}: the experts of a mixture of experts are gated MLPs; set mlp_class_name to "
                             "LLaMAMLP (SwiGLU) or GemmaMLP (GeGLU)")
        if self.bias:
            raise ValueError(f"{where}: experts without biases only; a mixture of experts needs bias=False")

    @property
    def is_moe(self) -> bool:
        """Each block's MLP is a mixture of experts."""
        return self.n_expert > 0

    @property
    def rope_n_elem(self) -> int:
        """Number of dims of each head that RoPE rotates."""
        return int(self.rotary_percentage * self.head_size)

    # ---- the zoo -------------------------------------------------------------------------------

    @classmethod
    def names(cls) -> list[str]:
        """Names of all architectures in the model zoo."""
        return [entry["name"] for entry in MODEL_ZOO]

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "Config":
        """The zoo architecture called `name`, or one of its aliases (:func:`resolve_name`): case-insensitive,
        LitGPT's names, short names (`tiny-llama`), Hugging Face repository ids (`TinyLlama/TinyLlama-1.1B-Chat-v1.0`).

        Keyword arguments override fields, e.g. `Config.from_name("llama-debug", n_layer=2)`.
        """
        canonical = resolve_name(name)
        return cls(**{**next(e for e in MODEL_ZOO if e["name"] == canonical), **overrides})

    # ---- (de)serialisation ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """All fields as plain Python values (derived sizes filled in)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Config":
        """Build from a dict, rejecting keys that are not fields (e.g. a typo)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown Config fields {unknown}; known fields are {sorted(known)}")
        return cls(**values)

    def save(self, path: str | Path) -> None:
        """Write the config as YAML (`model_config.yaml` in checkpoints)."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_file(cls, path: str | Path) -> "Config":
        """Read a config written by `save`."""
        from llmtrain.yaml_file import read_yaml

        return cls.from_dict(read_yaml(path))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _hf(org: str, name: str) -> dict:
    return {"org": org, "name": name}


# ------------------------------------------------------------------------------------------------
# The model zoo: real published architectures, named after their Hugging Face repositories.
# Each entry is a dict of Config fields; sizes that follow from others (head_size, padded vocab)
# are left to __post_init__ unless the published model differs from the rule.
# ------------------------------------------------------------------------------------------------

def _llama(name: str, org: str, hf_name: Optional[str] = None, **fields: Any) -> dict:
    """A Llama-style model: RMSNorm, SwiGLU, full RoPE, no biases."""
    return dict(name=name, hf_config=_hf(org, hf_name or name), norm_class_name="RMSNorm",
                mlp_class_name="LLaMAMLP", **fields)


def _with_variants(base: dict, *suffixes: str, suffix_before: str = "", **variant_fields: Any) -> list[dict]:
    """The base model plus fine-tuned variants with the same architecture (e.g. `-Instruct`);
    `variant_fields` are those whose published values differ in the variants' config.json. `suffix_before`: the
    suffix goes before this ending of the base name (Mixtral-8x7B-v0.1 -> Mixtral-8x7B-Instruct-v0.1)."""
    variants = [base]
    stem = base["name"].removesuffix(suffix_before) if suffix_before else base["name"]
    for suffix in suffixes:
        name = stem + suffix + suffix_before
        variants.append({**base, **variant_fields, "name": name, "hf_config": _hf(base["hf_config"]["org"], name)})
    return variants


_LLAMA_31_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
_LLAMA_32_SCALING = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)

_TINY_LLAMA_SHAPE = dict(block_size=2048, vocab_size=32000, padding_multiple=64, n_layer=22, n_head=32,
                         n_embd=2048, n_query_groups=4, intermediate_size=5632)
_TINY_LLAMA = [
    _llama("tiny-llama-1.1b", "TinyLlama", "TinyLlama-1.1B-intermediate-step-1431k-3T", **_TINY_LLAMA_SHAPE),
    _llama("tiny-llama-1.1b-chat", "TinyLlama", "TinyLlama-1.1B-Chat-v1.0", **_TINY_LLAMA_SHAPE),
]

_LLAMA_2_SHAPES = {
    "7b": dict(n_layer=32, n_embd=4096, n_head=32, n_query_groups=32, intermediate_size=11008),
    "13b": dict(n_layer=40, n_embd=5120, n_head=40, n_query_groups=40, intermediate_size=13824),
    "70b": dict(n_layer=80, n_embd=8192, n_head=64, n_query_groups=8, intermediate_size=28672),
}
_LLAMA_2 = [
    _llama(f"Llama-2-{size}{variant}-hf", "meta-llama", block_size=4096, vocab_size=32000, padding_multiple=64,
           **shape)
    for size, shape in _LLAMA_2_SHAPES.items()
    for variant in ("", "-chat")
]

# Llama 3 / 3.1 share shapes: 128256-token vocab, GQA with 8 KV heads, rope base 500000.
_LLAMA_3_SHAPES = {
    "8B": dict(n_layer=32, n_embd=4096, n_head=32, intermediate_size=14336),
    "70B": dict(n_layer=80, n_embd=8192, n_head=64, intermediate_size=28672),
    "405B": dict(n_layer=126, n_embd=16384, n_head=128, intermediate_size=53248),
}
_LLAMA_3_COMMON = dict(vocab_size=128256, padding_multiple=64, n_query_groups=8, rope_base=500000.0)

_LLAMA_3 = [
    entry
    for size in ("8B", "70B")
    for entry in _with_variants(
        _llama(f"Meta-Llama-3-{size}", "meta-llama", block_size=8192, **_LLAMA_3_COMMON, **_LLAMA_3_SHAPES[size]),
        "-Instruct",
    )
]

_LLAMA_31 = [
    entry
    for size in ("8B", "70B", "405B")
    for entry in _with_variants(
        _llama(f"Llama-3.1-{size}", "meta-llama", block_size=131072, rope_scaling=_LLAMA_31_SCALING,
               **_LLAMA_3_COMMON, **_LLAMA_3_SHAPES[size]),
        "-Instruct",
    )
]

_LLAMA_32 = [
    entry
    for size, shape in {
        "1B": dict(n_layer=16, n_embd=2048, n_head=32, head_size=64),
        "3B": dict(n_layer=28, n_embd=3072, n_head=24, head_size=128),
    }.items()
    for entry in _with_variants(
        _llama(f"Llama-3.2-{size}", "meta-llama", block_size=131072, rope_scaling=_LLAMA_32_SCALING,
               tie_embeddings=True, intermediate_size=8192, **_LLAMA_3_COMMON, **shape),
        "-Instruct",
    )
]

_MISTRAL_7B = dict(n_layer=32, n_embd=4096, n_head=32, n_query_groups=8, intermediate_size=14336,
                   padding_multiple=64, block_size=32768)
_MISTRAL = [
    _llama("Mistral-7B-v0.1", "mistralai", vocab_size=32000, sliding_window=4096, **_MISTRAL_7B),
    _llama("Mistral-7B-Instruct-v0.1", "mistralai", vocab_size=32000, sliding_window=4096, **_MISTRAL_7B),
    # v0.2 dropped the sliding window and raised the rope base.
    _llama("Mistral-7B-Instruct-v0.2", "mistralai", vocab_size=32000, rope_base=1000000.0, **_MISTRAL_7B),
    # v0.3 extends the vocabulary to 32768 tokens.
    _llama("Mistral-7B-v0.3", "mistralai", vocab_size=32768, rope_base=1000000.0, **_MISTRAL_7B),
    _llama("Mistral-7B-Instruct-v0.3", "mistralai", vocab_size=32768, rope_base=1000000.0, **_MISTRAL_7B),
]

# Qwen2.5: Llama layout plus a bias on q/k/v; the three small models tie embeddings.
# NOTE: block_size is the native 32K context; the 7B+ models reach 128K only with YaRN, not implemented.
# norm_eps is the base model's: every -Instruct model's config.json says rms_norm_eps 1e-6, where the
# 14B, 32B and 72B base models say 1e-5.
_QWEN_25_SHAPES = {
    #        n_layer n_embd n_head groups interm. vocab   tied   norm_eps
    "0.5B": (24, 896, 14, 2, 4864, 151936, True, 1e-6),
    "1.5B": (28, 1536, 12, 2, 8960, 151936, True, 1e-6),
    "3B": (36, 2048, 16, 2, 11008, 151936, True, 1e-6),
    "7B": (28, 3584, 28, 4, 18944, 152064, False, 1e-6),
    "14B": (48, 5120, 40, 8, 13824, 152064, False, 1e-5),
    "32B": (64, 5120, 40, 8, 27648, 152064, False, 1e-5),
    "72B": (80, 8192, 64, 8, 29568, 152064, False, 1e-5),
}
_QWEN_25 = [
    entry
    for size, (n_layer, n_embd, n_head, groups, intermediate, vocab, tied, eps) in _QWEN_25_SHAPES.items()
    for entry in _with_variants(
        _llama(f"Qwen2.5-{size}", "Qwen", block_size=32768, vocab_size=vocab, padding_multiple=64,
               n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_query_groups=groups,
               intermediate_size=intermediate, tie_embeddings=tied, norm_eps=eps,
               attn_bias=True, rope_base=1000000.0),
        "-Instruct", norm_eps=1e-6,
    )
]

# Gemma 1: GeGLU, head_size 256, (1 + weight) RMSNorm, embeddings scaled by sqrt(n_embd) and tied.
_GEMMA_COMMON = dict(block_size=8192, vocab_size=256000, padding_multiple=64, head_size=256,
                     mlp_class_name="GemmaMLP", gelu_approximate="tanh", norm_eps=1e-6,
                     norm_unit_offset=True, scale_embeddings=True, tie_embeddings=True)
_GEMMA = [
    *_with_variants(
        dict(name="gemma-2b", hf_config=_hf("google", "gemma-2b"), n_layer=18, n_embd=2048, n_head=8,
             n_query_groups=1, intermediate_size=16384, **_GEMMA_COMMON),
        "-it",
    ),
    *_with_variants(
        dict(name="gemma-7b", hf_config=_hf("google", "gemma-7b"), n_layer=28, n_embd=3072, n_head=16,
             n_query_groups=16, intermediate_size=24576, **_GEMMA_COMMON),
        "-it",
    ),
]

_PHI = [
    dict(name="phi-2", hf_config=_hf("microsoft", "phi-2"), block_size=2048, vocab_size=50257,
         padded_vocab_size=51200, n_layer=32, n_head=32, n_embd=2560, rotary_percentage=0.4,
         parallel_residual=True, shared_attention_norm=True, bias=True, lm_head_bias=True,
         norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", intermediate_size=10240,
         gelu_approximate="tanh"),
]

# Pythia (GPT-NeoX): LayerNorm, exact GELU, biases everywhere, RoPE on a quarter of each head,
# parallel residual with two norms. Tables are padded to a multiple of 128, and further for 6.9b and 12b.
_PYTHIA_SHAPES = {
    "14m": (6, 128, 4, None),
    "31m": (6, 256, 8, None),
    "70m": (6, 512, 8, None),
    "160m": (12, 768, 12, None),
    "410m": (24, 1024, 16, None),
    "1b": (16, 2048, 8, None),
    "1.4b": (24, 2048, 16, None),
    "2.8b": (32, 2560, 32, None),
    "6.9b": (32, 4096, 32, 50432),
    "12b": (36, 5120, 40, 50688),
}
_PYTHIA = [
    dict(name=f"pythia-{size}", hf_config=_hf("EleutherAI", f"pythia-{size}"), block_size=2048,
         vocab_size=50254, padding_multiple=128, padded_vocab_size=padded, n_layer=n_layer, n_embd=n_embd,
         n_head=n_head, rotary_percentage=0.25, parallel_residual=True, bias=True,
         norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP")
    for size, (n_layer, n_embd, n_head, padded) in _PYTHIA_SHAPES.items()
]

_SMOLLM2 = [
    entry
    for size, shape in {
        "135M": dict(n_layer=30, n_embd=576, n_head=9, n_query_groups=3, intermediate_size=1536,
                     rope_base=100000.0),
        "360M": dict(n_layer=32, n_embd=960, n_head=15, n_query_groups=5, intermediate_size=2560,
                     rope_base=100000.0),
        "1.7B": dict(n_layer=24, n_embd=2048, n_head=32, n_query_groups=32, intermediate_size=8192,
                     rope_base=130000.0),
    }.items()
    for entry in _with_variants(
        _llama(f"SmolLM2-{size}", "HuggingFaceTB", block_size=8192, vocab_size=49152, padding_multiple=64,
               tie_embeddings=True, **shape),
        "-Instruct",
    )
]

# ---- mixtures of experts -----------------------------------------------------------------------------
# Each family's router as its config.json and transformers' model say: softmax scores, the top k renormalised
# (Mixtral always, Qwen3-MoE by norm_topk_prob: true) or not (OLMoE), and its router_aux_loss_coef.

# Mixtral: Mistral's attention (no sliding window) and 8 SwiGLU experts of intermediate_size, 2 per token.
# https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json (and -Instruct-v0.1: the same)
# https://huggingface.co/mistralai/Mixtral-8x22B-v0.1/blob/main/config.json (and -Instruct-v0.1: the same;
# both have the 32768-token vocabulary of Mistral's v3 tokenizer)
_MIXTRAL_COMMON = dict(padding_multiple=64, n_query_groups=8, rope_base=1000000.0, norm_eps=1e-5, n_expert=8,
                       n_expert_per_token=2, norm_topk_prob=True)
_MIXTRAL = [
    *_with_variants(
        _llama("Mixtral-8x7B-v0.1", "mistralai", block_size=32768, vocab_size=32000, n_layer=32, n_embd=4096,
               n_head=32, intermediate_size=14336, router_aux_loss_coef=0.02, **_MIXTRAL_COMMON),
        "-Instruct", suffix_before="-v0.1",
    ),
    *_with_variants(
        _llama("Mixtral-8x22B-v0.1", "mistralai", block_size=65536, vocab_size=32768, n_layer=56, n_embd=6144,
               n_head=48, intermediate_size=16384, router_aux_loss_coef=0.001, **_MIXTRAL_COMMON),
        "-Instruct", suffix_before="-v0.1",
    ),
]

# Qwen3-MoE: Qwen3's attention (RMSNorm per head on q and k, head_size 128, no biases) and 128 SwiGLU experts of
# moe_intermediate_size, 8 per token, renormalised (norm_topk_prob: true). intermediate_size is config.json's
# (the width of a dense layer, which these models have none of). The 2507 releases raise the RoPE base and context.
# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (and -Base: the same)
# https://huggingface.co/Qwen/Qwen3-30B-A3B-Instruct-2507/blob/main/config.json
# https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json
# https://huggingface.co/Qwen/Qwen3-235B-A22B-Instruct-2507/blob/main/config.json
_QWEN3_MOE_COMMON = dict(vocab_size=151936, padding_multiple=64, n_query_groups=4, head_size=128, norm_eps=1e-6,
                         qk_norm="head", n_expert=128, n_expert_per_token=8, norm_topk_prob=True,
                         router_aux_loss_coef=0.001)
_QWEN3_MOE_SHAPES = {
    "30B-A3B": dict(n_layer=48, n_embd=2048, n_head=32, intermediate_size=6144, moe_intermediate_size=768),
    "235B-A22B": dict(n_layer=94, n_embd=4096, n_head=64, intermediate_size=12288, moe_intermediate_size=1536),
}
_QWEN3_MOE_2507_ROPE = {"30B-A3B": 10000000.0, "235B-A22B": 5000000.0}
_QWEN3_MOE = [
    entry
    for size, shape in _QWEN3_MOE_SHAPES.items()
    for entry in (
        *_with_variants(_llama(f"Qwen3-{size}", "Qwen", block_size=40960, rope_base=1000000.0,
                               **_QWEN3_MOE_COMMON, **shape),
                        *(("-Base",) if size == "30B-A3B" else ())),
        _llama(f"Qwen3-{size}-Instruct-2507", "Qwen", block_size=262144, rope_base=_QWEN3_MOE_2507_ROPE[size],
               **_QWEN3_MOE_COMMON, **shape),
    )
]

# OLMoE: RMSNorm over the whole q and k projections (not per head), 64 SwiGLU experts of intermediate_size, 8 per
# token, not renormalised (norm_topk_prob: false).
# https://huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json (and -Instruct: the same)
_OLMOE = _with_variants(
    _llama("OLMoE-1B-7B-0924", "allenai", block_size=4096, vocab_size=50304, padding_multiple=64, n_layer=16,
           n_embd=2048, n_head=16, intermediate_size=1024, norm_eps=1e-5, qk_norm="full", n_expert=64,
           n_expert_per_token=8, norm_topk_prob=False, router_aux_loss_coef=0.01),
    "-Instruct",
)

# Tiny debug sizes, one per family, for tests and CPU smoke runs.
_DEBUG_COMMON = dict(block_size=512, vocab_size=4096, padding_multiple=64)
_DEBUG = [
    # ~4.8M parameters; the debug pretraining recipe uses it.
    dict(name="llama-debug", n_layer=4, n_embd=256, n_head=4, n_query_groups=2, intermediate_size=640,
         **_DEBUG_COMMON),
    dict(name="gpt-neox-debug", n_layer=2, n_embd=128, n_head=4, rotary_percentage=0.25, parallel_residual=True,
         bias=True, norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", **_DEBUG_COMMON),
    dict(name="phi-debug", n_layer=2, n_embd=128, n_head=4, rotary_percentage=0.4, parallel_residual=True,
         shared_attention_norm=True, bias=True, lm_head_bias=True, norm_class_name="LayerNorm",
         mlp_class_name="GptNeoxMLP", gelu_approximate="tanh", **_DEBUG_COMMON),
    dict(name="gemma-debug", n_layer=2, n_embd=128, n_head=4, n_query_groups=1, head_size=64,
         intermediate_size=512, mlp_class_name="GemmaMLP", gelu_approximate="tanh", norm_eps=1e-6,
         norm_unit_offset=True, scale_embeddings=True, tie_embeddings=True, **_DEBUG_COMMON),
    dict(name="qwen2-debug", n_layer=2, n_embd=128, n_head=4, n_query_groups=2, intermediate_size=384,
         attn_bias=True, tie_embeddings=True, norm_eps=1e-6, rope_base=1000000.0, **_DEBUG_COMMON),
    dict(name="mistral-debug", n_layer=2, n_embd=128, n_head=4, n_query_groups=2, intermediate_size=384,
         sliding_window=128, **_DEBUG_COMMON),
    # llama-debug's attention with 8 experts of width 320, 2 per token: the same active parameters (2 x 320 = 640,
    # llama-debug's MLP width, plus the router), 4.4x the MLP weights. The MoE recipe and tests use it.
    dict(name="moe-debug", n_layer=4, n_embd=256, n_head=4, n_query_groups=2, intermediate_size=640, n_expert=8,
         n_expert_per_token=2, moe_intermediate_size=320, router_aux_loss_coef=0.01, **_DEBUG_COMMON),
]

# Small models of our own (no hub checkpoint) for benchmarks and CPU experiments.
_LOCAL = [
    # 18.9M parameters (12.6M in the blocks), an 8k vocabulary: the performance issue's "small Llama".
    dict(name="llama-20m", block_size=2048, vocab_size=8192, padding_multiple=64, n_layer=8, n_embd=384, n_head=6,
         n_query_groups=2, intermediate_size=1024),
]
LOCAL_MODELS = tuple(entry["name"] for entry in _LOCAL)

MODEL_ZOO: list[dict[str, Any]] = [
    *_TINY_LLAMA, *_LLAMA_2, *_LLAMA_3, *_LLAMA_31, *_LLAMA_32, *_MISTRAL, *_QWEN_25, *_GEMMA, *_PHI,
    *_PYTHIA, *_SMOLLM2, *_MIXTRAL, *_QWEN3_MOE, *_OLMOE, *_DEBUG, *_LOCAL,
]
"""Every named architecture, as keyword arguments of `Config`. Add new models here."""

# ------------------------------------------------------------------------------------------------
# Aliases: the names people type. Every key is lower case and maps to the zoo names it may mean.
# An exact zoo name wins over a short name, and a short name over a derived one (the Hugging Face
# repository name, with or without its org, and LitGPT's spellings); two candidates of the same rank
# make the alias ambiguous, and the error lists them.
# ------------------------------------------------------------------------------------------------

_VARIANT_MARKERS = ("-chat", "-instruct", "-it")

_SHORT_NAMES: dict[str, tuple[str, ...]] = {
    "tiny-llama": ("tiny-llama-1.1b",),
    "tinyllama": ("tiny-llama-1.1b",),
    "tinyllama-1.1b": ("tiny-llama-1.1b",),
    "tiny-llama-chat": ("tiny-llama-1.1b-chat",),
    # Without a version, Mistral 7B is the newest one.
    "mistral-7b": ("Mistral-7B-v0.3",),
    "mistral-7b-instruct": ("Mistral-7B-Instruct-v0.3",),
    "phi": ("phi-2",),
    "mixtral-8x7b": ("Mixtral-8x7B-v0.1",),
    "mixtral-8x7b-instruct": ("Mixtral-8x7B-Instruct-v0.1",),
    "mixtral-8x22b": ("Mixtral-8x22B-v0.1",),
    "mixtral-8x22b-instruct": ("Mixtral-8x22B-Instruct-v0.1",),
    "olmoe-1b-7b": ("OLMoE-1B-7B-0924",),
    "olmoe-1b-7b-instruct": ("OLMoE-1B-7B-0924-Instruct",),
}


def _families() -> dict[str, tuple[str, ...]]:
    """A family name alone (`pythia`, `llama-3.2`) means its base models: one resolves, several are ambiguous."""
    groups = {"llama-2": _LLAMA_2, "llama-3": _LLAMA_3, "llama-3.1": _LLAMA_31, "llama-3.2": _LLAMA_32,
              "mistral": _MISTRAL, "qwen2.5": _QWEN_25, "gemma": _GEMMA, "pythia": _PYTHIA, "smollm2": _SMOLLM2,
              "mixtral": _MIXTRAL, "qwen3-moe": _QWEN3_MOE, "olmoe": _OLMOE}
    return {family: tuple(e["name"] for e in entries if not any(m in e["name"].lower() for m in _VARIANT_MARKERS))
            for family, entries in groups.items()}


def _derived_names(entry: dict[str, Any]) -> set[str]:
    """The Hugging Face repository name with and without its org, and LitGPT's spellings of the name."""
    names = set()
    hf = entry.get("hf_config") or {}
    if hf:
        names |= {hf["name"], f"{hf['org']}/{hf['name']}"}
    for name in {entry["name"], *names}:
        if name.lower().endswith("-hf"):  # Llama-2-7b-hf is LitGPT's and Meta's; llama-2-7b is what people type
            names.add(name[: -len("-hf")])
        if name.lower().startswith("meta-llama-3"):  # LitGPT calls Meta-Llama-3-8B Llama-3-8B
            names.add(name[len("meta-"):])
    return {name.lower() for name in names} - {entry["name"].lower()}


def _alias_table() -> dict[str, tuple[str, ...]]:
    """Every accepted key (lower case) → the zoo names it may mean, best-ranked candidates only."""
    ranked: dict[str, dict[int, list[str]]] = {}

    def add(key: str, rank: int, names: tuple[str, ...]) -> None:
        slot = ranked.setdefault(key.lower(), {}).setdefault(rank, [])
        slot.extend(name for name in names if name not in slot)

    for entry in MODEL_ZOO:
        add(entry["name"], 0, (entry["name"],))
        for derived in _derived_names(entry):
            add(derived, 2, (entry["name"],))
    for key, names in {**_families(), **_SHORT_NAMES}.items():
        add(key, 1, names)
    return {key: tuple(ranks[min(ranks)]) for key, ranks in ranked.items()}


ALIASES = _alias_table()
"""Every name `Config.from_name` accepts (lower case), with the zoo names it may mean."""


def resolve_name(name: str) -> str:
    """The canonical zoo name for `name`; an unknown or ambiguous name raises ValueError naming the candidates."""
    key = name.strip().lower()
    if key not in ALIASES and "/" in key:  # an org we do not know, or a local path's last part
        key = key.rsplit("/", 1)[-1]
    candidates = ALIASES.get(key)
    if candidates is None:
        close = difflib.get_close_matches(key, ALIASES, n=5, cutoff=0.5)
        hint = ", ".join(dict.fromkeys(ALIASES[c][0] if len(ALIASES[c]) == 1 else c for c in close)) or "none"
        raise ValueError(f"Unknown model name {name!r}. Closest matches: {hint}. "
                         "`llmtrain pretrain list` prints every name in the zoo and its aliases.")
    if len(candidates) > 1:
        raise ValueError(f"The model name {name!r} is ambiguous: it may mean {', '.join(candidates)}; "
                         "pass one of them")
    return candidates[0]


def aliases_of(name: str) -> list[str]:
    """The other names that resolve to zoo entry `name` alone (for `llmtrain pretrain list`)."""
    return sorted(key for key, names in ALIASES.items() if names == (name,) and key != name.lower())


TRAINING_FIELDS = ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate")
"""Config fields that change only how a model trains (the router's balancing), not its weights or outputs."""

ARCHITECTURE_FIELDS = tuple(f.name for f in fields(Config)
                            if f.name not in ("name", "hf_config", "vocab_size", "padding_multiple", "block_size",
                                              *TRAINING_FIELDS))
"""Config fields that decide the weights and the computation; two configs that agree on them are one model."""


def architecture_differences(ours: Config, theirs: Config) -> list[str]:
    """What tells the models of two configs apart ("n_embd 64 vs 128", ...); empty for one model.

    NOTE: two mixtures of experts may differ in intermediate_size: with every MLP a mixture, it sizes no weight
    (Mixtral's and OLMoE's config.json give the experts' width there, Qwen3-MoE's that of dense layers it has none of).
    """
    unused = ("intermediate_size",) if ours.is_moe and theirs.is_moe else ()
    return [f"{key} {getattr(ours, key)!r} vs {getattr(theirs, key)!r}" for key in ARCHITECTURE_FIELDS
            if key not in unused and getattr(ours, key) != getattr(theirs, key)]
