"""LoRA: train a low-rank update of chosen linear layers while the base model stays frozen.

A `LoRALinear` wraps a base linear layer (plain, or a bitsandbytes 4-bit/int8 one for QLoRA):

    y = base(x) + dropout(x) @ A^T @ B^T * (lora_alpha / lora_r)        A: (r, in), B: (out, r)

B starts at zero, so a fresh adapter leaves the model's output unchanged. The model code knows
nothing about this: `apply_lora` swaps modules in from outside. Each adapter stays a submodule of
its `Block`, so `fully_shard(block)` shards adapters and frozen weights alike. Parameter names:

    blocks.0.attn.q_proj.base.weight     the frozen base weight
    blocks.0.attn.q_proj.lora_A          (r, in_features), trainable
    blocks.0.attn.q_proj.lora_B          (out_features, r), trainable

A plain model's checkpoint (`q_proj.weight`) still loads into a model with adapters, with
`load_state_dict(..., strict=False)` reporting only the adapters as missing.

On a mixture of experts, `--lora_mlp` adapts each routed expert (`LoRAExperts`: one adapter per expert and
projection, 3-D like the experts' weights, added inside each expert's product) and the shared experts' linear
layers. The router stays frozen: LoRA changes what each expert computes, not which experts a token reaches, so the
pretrained load balance holds (PEFT's and LitGPT's Mixtral recipes leave the gate alone too). Parameter names:

    blocks.0.mlp.experts.base.gate_proj          (E, I, D), frozen
    blocks.0.mlp.experts.gate_proj.lora_A        (E, r, D), trainable
    blocks.0.mlp.experts.gate_proj.lora_B        (E, I, r), trainable

`merge_lora` folds the update into the base weight and gives back a plain model whose state-dict
keys are those of a plain `GPT`. Checkpoints merge through `llmtrain.checkpoint.lora.merged_state_dict`,
layer by layer onto the CPU; both compute the update with `fold_lora`.

Order for users: build model -> load weights -> [`quantize_model`] -> `apply_lora` -> `mark_only_lora_trainable`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrain.fused import gating_activation
from llmtrain.moe import EXPERT_PROJECTIONS, GroupedExperts, MoE, expert_loop, use_grouped_mm
from llmtrain.quantize import (QuantizedExperts, compute_dtype_of, dequantize_weight, dequantize_linear,
                               is_quantized_linear, plain_experts, plain_linear)

LORA_PARAMETER_NAMES = ("lora_A", "lora_B")
_ATTENTION_FLAGS = {"lora_query": "q_proj", "lora_key": "k_proj", "lora_value": "v_proj", "lora_projection": "o_proj"}


@dataclass
class LoRAArgs:
    """Which linear layers get LoRA adapters, and their shape."""

    lora_r: int = 8
    """Rank of the low-rank update (the inner dimension of B @ A)."""
    lora_alpha: int = 16
    """Scale of the update: it is multiplied by lora_alpha / lora_r."""
    lora_dropout: float = 0.05
    """Dropout probability on the adapter's input (the base path sees no dropout)."""
    lora_query: bool = True
    """Adapt the attention query projection (q_proj)."""
    lora_key: bool = False
    """Adapt the attention key projection (k_proj)."""
    lora_value: bool = True
    """Adapt the attention value projection (v_proj)."""
    lora_projection: bool = False
    """Adapt the attention output projection (o_proj)."""
    lora_mlp: bool = False
    """Adapt every linear layer of the MLP (fc/proj, or gate_proj/up_proj/down_proj); in a mixture of experts, every
    routed expert's and the shared experts' (not the router)."""
    lora_head: bool = False
    """Adapt the output head (lm_head); not allowed when it is tied to the embedding."""

    def __post_init__(self) -> None:
        if self.lora_r <= 0:
            raise ValueError(f"--lora_r must be a positive rank, got {self.lora_r}")
        if self.lora_alpha <= 0:
            raise ValueError(f"--lora_alpha must be positive, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.lora_r


class LoRALinear(nn.Module):
    """A frozen base linear layer plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.r = r
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # Adapters live where the base weight lives and train in the dtype the layer computes in
        # (the compute dtype for a quantized base).
        factory = dict(device=base.weight.device, dtype=compute_dtype_of(base))
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, r, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise the adapter only (A like an nn.Linear, B zero); the base weight is left alone."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    BASE_KEYS = ("weight", "bias")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _base_keys_from_plain(state_dict, prefix, self.BASE_KEYS)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # (..., out_features)
        hidden = F.linear(self.dropout(x.to(self.lora_A.dtype)), self.lora_A)  # (..., r)
        if hidden.dtype == out.dtype and out.dim() >= 2 and type(out) is torch.Tensor:
            # NOTE: out + scaling * hidden @ B^T as one GEMM that accumulates onto out (addmm's beta = 1), instead
            # of a matmul, a scaling pass and an add over the (..., out_features) output, and in backward no
            # scaling pass over the incoming gradient either (interleaved A/B in BENCHMARKS.md).
            update = torch.addmm(out.flatten(0, -2), hidden.flatten(0, -2), self.lora_B.t(), alpha=self.scaling)
            return update.view(out.shape)
        update = F.linear(hidden, self.lora_B) * self.scaling  # (..., out_features)
        return out + update.to(out.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + B @ A * scale (out, in), in the base weight's dtype, or the compute dtype when the base is quantized."""
        dtype = self.lora_A.dtype if is_quantized_linear(self.base) else self.base.weight.dtype
        return fold_lora(dequantize_weight(self.base), self.lora_A, self.lora_B, self.scaling).to(dtype)

    def merged(self) -> nn.Linear:
        """A plain nn.Linear computing base + update."""
        return plain_linear(self.merged_weight(), self.base.bias, requires_grad=self.base.weight.requires_grad)

    def extra_repr(self) -> str:
        return f"r={self.r}, scaling={self.scaling:g}"


class ExpertAdapter(nn.Module):
    """The low-rank updates of one projection of every expert: ``lora_A`` (E, r, in), ``lora_B`` (E, out, r)."""

    def __init__(self, n_expert: int, in_features: int, out_features: int, r: int, **factory) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(n_expert, r, in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(n_expert, out_features, r, **factory))

    def reset_parameters(self) -> None:
        # Each expert's A as a LoRALinear's (kaiming_uniform_ with a = sqrt(5) on (r, in): U(-1/sqrt(in), 1/sqrt(in))),
        # written out because kaiming_uniform_ would take the 3-D tensor's fan-in as r * in.
        bound = 1 / math.sqrt(self.lora_A.size(-1))
        nn.init.uniform_(self.lora_A, -bound, bound)
        nn.init.zeros_(self.lora_B)


class LoRAExperts(nn.Module):
    """Frozen routed experts (``base``: :class:`GroupedExperts`, or :class:`QuantizedExperts` for QLoRA) plus a
    trainable low-rank update of each expert's gate, up and down projections, applied inside each expert's product:

        gate_e(x) = W_gate_e x + B_gate_e A_gate_e dropout(x) * scale        (and so for up_e, down_e)

    Where the plain experts would take torch's grouped GEMM (a recent CUDA GPU in bfloat16, or ``base.grouped``
    forced), the adapters' two products per projection are grouped GEMMs too; otherwise one product per expert
    (:func:`~llmtrain.moe.expert_loop`), as quantized experts always are. B starts at zero, so fresh adapters leave
    every expert's output unchanged.
    """

    BASE_KEYS = EXPERT_PROJECTIONS

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        self.r = r
        self.scaling = alpha / r
        self.approximate = base.approximate
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        for name, (n_expert, out_features, in_features) in _expert_shapes(base).items():
            setattr(self, name, ExpertAdapter(n_expert, in_features, out_features, r, **_expert_factory(base)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name in EXPERT_PROJECTIONS:
            getattr(self, name).reset_parameters()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _base_keys_from_plain(state_dict, prefix, self.BASE_KEYS)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def project(self, name: str, expert: int, rows: torch.Tensor) -> torch.Tensor:
        adapter = getattr(self, name)
        out = self.base.project(name, expert, rows)
        hidden = F.linear(self.dropout(rows.to(adapter.lora_A.dtype)), adapter.lora_A[expert])  # (rows, r)
        return out + (F.linear(hidden, adapter.lora_B[expert]) * self.scaling).to(out.dtype)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if not self._grouped(x):
            return expert_loop(x, tokens_per_expert, self.project, self.approximate)
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        gate, up = (self._grouped_project(name, x, offsets) for name in ("gate_proj", "up_proj"))
        return self._grouped_project("down_proj", gating_activation(gate, self.approximate) * up, offsets)

    def _grouped(self, x: torch.Tensor) -> bool:
        if not isinstance(self.base, GroupedExperts):  # quantized experts: one expert at a time
            return False
        if self.base.grouped is not None:
            return self.base.grouped
        # NOTE: the adapters' (M, r) rows need 16-byte strides in bfloat16 too
        return use_grouped_mm(x, self.base.gate_proj) and self.r % 8 == 0

    def _grouped_project(self, name: str, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """:meth:`project` for every expert at once: the rows sorted by expert, ``offsets`` their cumulative counts."""
        adapter = getattr(self, name)
        out = torch._grouped_mm(rows, getattr(self.base, name).transpose(-2, -1), offs=offsets)
        hidden = torch._grouped_mm(self.dropout(rows.to(adapter.lora_A.dtype)), adapter.lora_A.transpose(-2, -1),
                                   offs=offsets)  # (M, r)
        update = torch._grouped_mm(hidden, adapter.lora_B.transpose(-2, -1), offs=offsets) * self.scaling
        return out + update.to(out.dtype)

    @torch.no_grad()
    def merged_weights(self) -> dict[str, torch.Tensor]:
        """Each projection's W + B @ A * scale (E, out, in), in the base's dtype (a quantized base's compute dtype)."""
        merged = {}
        for name in EXPERT_PROJECTIONS:
            adapter = getattr(self, name)
            if isinstance(self.base, QuantizedExperts):
                weight, dtype = self.base.dequantized_weight(name), adapter.lora_A.dtype
            else:
                weight = getattr(self.base, name)
                dtype = weight.dtype
            merged[name] = fold_lora(weight, adapter.lora_A, adapter.lora_B, self.scaling).to(dtype)
        return merged

    def merged(self) -> GroupedExperts:
        """Plain :class:`GroupedExperts` computing base + update."""
        return plain_experts(self.merged_weights(), self.approximate, requires_grad=False)

    def extra_repr(self) -> str:
        return f"r={self.r}, scaling={self.scaling:g}"


def _expert_shapes(base: nn.Module) -> dict[str, tuple[int, int, int]]:
    """(E, out, in) of each projection of plain or quantized experts."""
    if isinstance(base, QuantizedExperts):
        return {name: (len(layers), layers[0].out_features, layers[0].in_features)
                for name in EXPERT_PROJECTIONS for layers in [getattr(base, name)]}
    return {name: tuple(getattr(base, name).shape) for name in EXPERT_PROJECTIONS}


def _expert_factory(base: nn.Module) -> dict:
    """Adapters live where the experts live, in the dtype they compute in."""
    if isinstance(base, QuantizedExperts):
        return dict(device=base.gate_proj[0].weight.device, dtype=base.compute_dtype)
    return dict(device=base.gate_proj.device, dtype=base.gate_proj.dtype)


def _base_keys_from_plain(state_dict: dict, prefix: str, keys: tuple[str, ...]) -> None:
    """Rename a plain model's keys under ``prefix`` (``q_proj.weight``) to the base layer's (``q_proj.base.weight``),
    in place, so a plain model's checkpoint loads into a model that already has adapters (e.g. built on the meta
    device and sharded before its weights are loaded)."""
    for key in keys:
        if prefix + key in state_dict and prefix + "base." + key not in state_dict:
            state_dict[prefix + "base." + key] = state_dict.pop(prefix + key)


LORA_LAYERS = (LoRALinear, LoRAExperts)


@torch.no_grad()
def fold_lora(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The merged weight W + B @ A * scale, summed in float32 (the one place the merge is computed): (out, in), or
    (E, out, in) for experts, one product per expert."""
    return weight.float() + (lora_b.float() @ lora_a.float()) * scaling


# ---- applying adapters -------------------------------------------------------------------------


def lora_target_names(model: nn.Module, args: LoRAArgs) -> list[str]:
    """Dotted names of the linear layers that `args` selects in `model`."""
    names = []
    for index, block in enumerate(model.blocks):
        prefix = f"blocks.{index}"
        names += [f"{prefix}.attn.{child}" for flag, child in _ATTENTION_FLAGS.items() if getattr(args, flag)]
        if args.lora_mlp:
            names += [f"{prefix}.mlp.{name}" for name in _mlp_targets(block.mlp)]
    if args.lora_head:
        names.append("lm_head")
    return names


def _mlp_targets(mlp: nn.Module) -> list[str]:
    """What --lora_mlp adapts in one MLP: its linear layers; in a mixture of experts, the routed experts and the
    shared experts' linear layers (not the router)."""
    if not isinstance(mlp, MoE):
        return [name for name, module in mlp.named_children() if isinstance(module, nn.Linear)]
    shared = [] if mlp.shared_experts is None else [f"shared_experts.{name}" for name in _mlp_targets(mlp.shared_experts)]
    return ["experts", *shared]


def apply_lora(model: nn.Module, args: LoRAArgs) -> list[str]:
    """Wrap the linear layers chosen by `args` in `LoRALinear`, in place; return their names."""
    names = lora_target_names(model, args)
    if not names:
        raise ValueError(
            "LoRA selects no layers: enable at least one of --lora_query, --lora_key, --lora_value, "
            "--lora_projection, --lora_mlp, --lora_head"
        )
    if any(isinstance(module, LORA_LAYERS) for module in model.modules()):
        raise ValueError("The model already has LoRA adapters; apply_lora must be called once")
    if args.lora_head and getattr(model.config, "tie_embeddings", False):
        raise ValueError(
            f"--lora_head cannot adapt model {model.config.name!r}: its lm_head is tied to the embedding, "
            "so merging the update would change the embedding too. Drop --lora_head"
        )
    for name in names:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child_name)
        layer = LoRAExperts if isinstance(base, (GroupedExperts, QuantizedExperts)) else LoRALinear
        setattr(parent, child_name, layer(base, args.lora_r, args.lora_alpha, args.lora_dropout))
    return names


def is_lora_parameter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_PARAMETER_NAMES


def mark_only_lora_trainable(model: nn.Module) -> None:
    """Freeze every parameter except the adapters' lora_A and lora_B."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_lora_parameter(name))


# ---- adapter checkpoints -----------------------------------------------------------------------


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter weights, under their names in `model` (`blocks.0.attn.q_proj.lora_A`, ...)."""
    # NOTE: from named_parameters rather than state_dict(): the state_dict hooks of bitsandbytes
    # layers serialise their quantization state, which is expensive and not wanted here.
    return {name: param.detach() for name, param in model.named_parameters() if is_lora_parameter(name)}


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy adapter weights into `model`; every adapter of the model must be given, and nothing else."""
    params = {name: param for name, param in model.named_parameters() if is_lora_parameter(name)}
    missing = sorted(set(params) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(params))
    if missing or unexpected:
        raise KeyError(
            f"The adapter weights do not match the model's adapters: missing {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''} ({len(missing)}), unexpected {unexpected[:4]}"
            f"{' ...' if len(unexpected) > 4 else ''} ({len(unexpected)}). Apply LoRA with the same "
            "--lora_* flags that trained them"
        )
    for name, param in params.items():
        value = state_dict[name]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"Adapter {name} has shape {tuple(value.shape)} in the weights but {tuple(param.shape)} in the "
                "model; apply LoRA with the --lora_r that trained them"
            )
        param.copy_(_like_parameter(value, param))


def _like_parameter(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`value` on the parameter's device and dtype, sharded like it when the model is under FSDP."""
    value = value.to(device=param.device, dtype=param.dtype)
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(param, DTensor):
            value = distribute_tensor(value, param.device_mesh, param.placements)
    return value


# ---- merging -----------------------------------------------------------------------------------


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and dequantize any quantized layers, in place.

    Returns `model`, now a plain model whose state-dict keys equal a plain GPT's: every
    `LoRALinear` and bitsandbytes layer becomes an `nn.Linear`. Merging sums in float32; weights of
    quantized layers come out in their compute dtype. Save `lora_state_dict(model)` first if the
    adapters are still needed on their own.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, LORA_LAYERS):
            _replace(model, name, module.merged())
    for name, module in list(model.named_modules()):
        if is_quantized_linear(module):
            _replace(model, name, dequantize_linear(module))
        elif isinstance(module, QuantizedExperts):
            _replace(model, name, module.dequantized())
    return model


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child_name = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child_name, new)


# ---- finding adapters ----------------------------------------------------------------------------


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every adapted layer: a `LoRALinear` or `LoRAExperts`, by name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LORA_LAYERS)}


def reset_lora_parameters(model: nn.Module) -> None:
    """Initialise every adapter (after a meta-device model got its storage)."""
    for module in lora_modules(model).values():
        module.reset_parameters()


def plain_to_lora_keys(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Rename a plain model's keys (`q_proj.weight`, `experts.gate_proj`) to where the base weights sit in `model`
    (`q_proj.base.weight`, `experts.base.gate_proj`).

    Loading through torch.distributed's state-dict API checks keys before any module hook runs,
    so the renaming has to happen on the dict.
    """
    out = dict(state_dict)
    for name, module in lora_modules(model).items():
        _base_keys_from_plain(out, f"{name}.", module.BASE_KEYS)
    return out
