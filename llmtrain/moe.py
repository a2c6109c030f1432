"""The mixture-of-experts MLP: a router, routed experts stored as 3-D weights, optional shared experts.

Dropless top-k routing: every token reaches its k experts, with no capacity factor. The forward pass is three
pieces, so that expert parallelism replaces only the middle one:

1. :func:`route`: scores, the top-k experts and their weights, and the tokens sorted by expert
   (:class:`Dispatch`: ``tokens_per_expert`` and the permutation);
2. ``MoE.experts(sorted_tokens, tokens_per_expert)``: each expert's gated MLP on its rows, one after another
   (:func:`expert_products`); expert parallelism swaps this call for an all-to-all, the local experts and the
   all-to-all back (``distributed/expert_parallel.py``);
3. :func:`combine`: each token's k outputs weighted and summed, in the token's own order.

Load balancing: the Switch/Mixtral auxiliary loss and the router z-loss enter the gradient through
:class:`_AddAuxLoss` (the block's output is returned unchanged and the losses' gradients are added in backward),
so they need no path to the loss function and work the same under pipeline parallelism and activation
checkpointing. DeepSeek's auxiliary-loss-free balancing keeps a selection bias per expert
(:func:`update_expert_bias`, after each optimizer step). The module counts the tokens each expert received
(``MoE.load``) and sums its balancing losses for the logs (:func:`moe_stats`).

Like the dense MLPs, the block knows nothing about parallelism.
"""

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrain.config import Config
from llmtrain.fused import gating_activation


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The weights of :class:`GroupedExperts`, each (n_expert, out_features, in_features)."""


@dataclass
class Dispatch:
    """Where each token goes: ``order`` sorts the N*k (token, slot) pairs by expert (stable), ``token`` is the
    token of each sorted row, ``tokens_per_expert`` (E,) how many rows each expert gets."""

    order: torch.Tensor
    token: torch.Tensor
    tokens_per_expert: torch.Tensor


def route(logits: torch.Tensor, k: int, score: str, norm_topk_prob: bool,
          expert_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights (N, k) float32, chosen experts (N, k), scores (N, E) float32) from the router's logits (N, E).

    Scores are a softmax over the experts or a sigmoid per expert; the top k are chosen by score plus
    ``expert_bias`` (auxiliary-loss-free balancing: the bias steers the choice only, the weights are the scores).
    With ``norm_topk_prob`` the k weights are renormalised to sum to 1.
    """
    logits = logits.float()
    scores = logits.softmax(dim=-1) if score == "softmax" else logits.sigmoid()
    if expert_bias is None:
        weights, chosen = scores.topk(k, dim=-1)
    else:
        chosen = (scores + expert_bias.float()).topk(k, dim=-1).indices
        weights = scores.gather(-1, chosen)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen, scores


def dispatch(chosen: torch.Tensor, n_expert: int) -> Dispatch:
    """The permutation that groups the (token, slot) pairs of ``chosen`` (N, k) by expert, keeping token order
    within an expert."""
    flat = chosen.flatten()
    order = flat.argsort(stable=True)
    return Dispatch(order=order, token=order // chosen.size(1),
                    tokens_per_expert=torch.bincount(flat, minlength=n_expert))


def combine(expert_out: torch.Tensor, weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Each token's weighted sum of its k expert outputs: ``expert_out`` (N*k, D) in expert order, weights (N, k).

    NOTE: a gather into token order and a batched product, rather than an index_add over the sorted rows: the sum
    is over each token's k slots in slot order, the same on every run and device (no atomic adds)."""
    n, k = weights.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_slot = expert_out[inverse].view(n, k, -1)  # (N, k, D) in token order
    return torch.bmm(weights.to(per_slot.dtype).unsqueeze(1), per_slot).squeeze(1)  # (N, D)


def expert_products(x: torch.Tensor, tokens_per_expert: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    down: torch.Tensor, approximate: Optional[str] = None,
                    grouped: Optional[bool] = None) -> torch.Tensor:
    """down_e(act(gate_e x) * up_e x) for each row of ``x`` (M, D) sorted by expert, ``tokens_per_expert`` rows
    each. ``gate``, ``up``: (E, I, D); ``down``: (E, D, I), each expert's weights as nn.Linear keeps them.

    ``grouped`` None picks torch's grouped GEMM where it is fast (bfloat16 on a CUDA device of compute capability 9
    or more, widths that keep 16-byte strides) and one product per expert otherwise; True or False forces one.
    """
    if use_grouped_mm(x, gate, grouped):
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        hidden = gating_activation(torch._grouped_mm(x, gate.transpose(-2, -1), offs=offsets), approximate)
        hidden = hidden * torch._grouped_mm(x, up.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(hidden, down.transpose(-2, -1), offs=offsets)
    return _products_per_expert(x, tokens_per_expert, gate, up, down, approximate)


def _one_product_per_expert(x: torch.Tensor, tokens_per_expert: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                            down: torch.Tensor, approximate: Optional[str]) -> torch.Tensor:
    """The experts one after another, eagerly under ``--compile``: the rows per expert are data (``.tolist()``), and a
    traced loop would recompile for every new count of 0 or 1 rows until torch gives up on the frame."""
    outputs = []
    for rows, g, u, d in zip(x.split(tokens_per_expert.tolist()), gate, up, down):
        outputs.append(F.linear(gating_activation(F.linear(rows, g), approximate) * F.linear(rows, u), d))
    return torch.cat(outputs) if outputs else x.new_zeros(0, down.size(1))


_products_per_expert = _one_product_per_expert


def keep_expert_products_eager() -> None:
    """Have torch.compile run the experts' products one after another eagerly (a graph break around the loop), as
    :func:`_one_product_per_expert` needs. Called where blocks are compiled
    (:func:`llmtrain.distributed.parallelize.apply_compile`), not at import: ``torch.compiler.disable`` imports
    torch._dynamo, 3 to 6 s of start-up on a 2-core CPU for every process that never compiles."""
    global _products_per_expert
    if _products_per_expert is _one_product_per_expert:
        _products_per_expert = torch.compiler.disable(_one_product_per_expert)


def expert_loop(x: torch.Tensor, tokens_per_expert: torch.Tensor,
                project: Callable[[str, int, torch.Tensor], torch.Tensor],
                approximate: Optional[str] = None) -> torch.Tensor:
    """:func:`expert_products` one expert at a time, each projection computed by ``project(name, expert, rows)``
    (``name`` one of ``EXPERT_PROJECTIONS``): for experts whose weights are not plain 3-D tensors (quantized, or with
    LoRA adapters beside them)."""
    outputs = []
    for expert, rows in enumerate(x.split(tokens_per_expert.tolist())):
        hidden = gating_activation(project("gate_proj", expert, rows), approximate) * project("up_proj", expert, rows)
        outputs.append(project("down_proj", expert, hidden))
    return torch.cat(outputs)


def use_grouped_mm(x: torch.Tensor, weight: torch.Tensor, grouped: Optional[bool] = None) -> bool:
    """Whether :func:`expert_products` takes torch's grouped GEMM for rows ``x`` and a 3-D ``weight``: ``grouped``
    when it is set, else where that pays (bfloat16 on a CUDA device of compute capability 9 or more, aligned
    widths)."""
    return _grouped_mm_pays(x, weight) if grouped is None else grouped


def _grouped_mm_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.device.type != "cuda" or x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    aligned = x.size(-1) % 8 == 0 and weight.size(1) % 8 == 0
    return aligned and torch.cuda.get_device_capability(x.device) >= (9, 0)


class GroupedExperts(nn.Module):
    """``n_expert`` gated MLPs as three 3-D weights, experts first, so that expert parallelism and FSDP shard
    dim 0: ``gate_proj`` and ``up_proj`` (E, I, D), ``down_proj`` (E, D, I)."""

    grouped: Optional[bool] = None  # see expert_products; tests force both paths

    def __init__(self, n_expert: int, dim: int, hidden: int, approximate: Optional[str] = None) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_expert, hidden, dim))
        self.up_proj = nn.Parameter(torch.empty(n_expert, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_expert, dim, hidden))
        self.approximate = approximate

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return expert_products(x, tokens_per_expert, self.gate_proj, self.up_proj, self.down_proj,
                               self.approximate, self.grouped)

    def project(self, name: str, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """One projection (``gate_proj``, ``up_proj`` or ``down_proj``) of one expert on its rows (for
        :func:`expert_loop`)."""
        return F.linear(rows, getattr(self, name)[expert])

    @torch.no_grad()
    def init_weights(self, std: float, residual_std: float) -> None:
        """Normal(0, std) for the input projections and (0, residual_std) for ``down_proj``, which writes into the
        residual stream (as the dense MLP's projections)."""
        nn.init.normal_(self.gate_proj, std=std)
        nn.init.normal_(self.up_proj, std=std)
        nn.init.normal_(self.down_proj, std=residual_std)


class SharedExperts(nn.Module):
    """The experts every token passes through, as one gated MLP of ``n_shared_expert`` experts' width."""

    def __init__(self, dim: int, hidden: int, approximate: Optional[str] = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gating_activation(self.gate_proj(x), self.approximate) * self.up_proj(x))


class MoE(nn.Module):
    """The mixture-of-experts MLP of one block: ``router`` (a bias-free linear to the expert logits), ``experts``
    (:class:`GroupedExperts`), ``shared_experts`` (:class:`SharedExperts` or None) and the buffer ``expert_bias``
    (auxiliary-loss-free balancing; zeros unless ``router_bias_update_rate`` moves it).

    After each forward pass in training, ``load`` holds the rows each expert received since :func:`reset_moe_stats`
    (float32, detached), and ``balance`` the sums [auxiliary loss, z-loss, passes, rows expected] (rows expected:
    tokens × k, what dropless routing must deliver). Under activation checkpointing a recomputed forward counts
    again; every number read from them is a ratio (max over mean, mean losses per pass, the dropped share) and the
    bias update takes the sign of mean minus load, none of which change when every count doubles.
    """

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.n_expert = config.n_expert
        self.k = config.n_expert_per_token
        self.score = config.router_score
        self.norm_topk_prob = config.norm_topk_prob
        self.aux_loss_coef = config.router_aux_loss_coef
        self.z_loss_coef = config.router_z_loss_coef
        self.use_bias = config.router_bias_update_rate > 0
        approximate = config.gelu_approximate if config.mlp_class_name == "GemmaMLP" else None
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.experts = GroupedExperts(config.n_expert, config.n_embd, config.moe_intermediate_size, approximate)
        self.shared_experts = (SharedExperts(config.n_embd, config.moe_intermediate_size * config.n_shared_expert,
                                             approximate) if config.n_shared_expert else None)
        self.register_buffer("expert_bias", torch.zeros(config.n_expert, dtype=torch.float32))
        self.load: Optional[torch.Tensor] = None
        self.balance: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))  # (N, D)
        logits = self.router(flat)  # (N, E)
        weights, chosen, scores = route(logits, self.k, self.score, self.norm_topk_prob,
                                        self.expert_bias if self.use_bias else None)
        plan = dispatch(chosen, self.n_expert)
        expert_out = self.experts(flat[plan.token], plan.tokens_per_expert)  # (N*k, D), expert order
        y = combine(expert_out, weights, plan.order)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        if self.training:
            y = self._balance(y, logits, scores, plan.tokens_per_expert)
        return y.view_as(x)

    def _balance(self, y: torch.Tensor, logits: torch.Tensor, scores: torch.Tensor,
                 tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Count the load, and add the balancing losses' gradients to backward when their coefficients are set."""
        aux = load_balancing_loss(scores, tokens_per_expert, self.k, self.score)
        z = router_z_loss(logits)
        with torch.no_grad():
            counts = tokens_per_expert.float()
            self.load = counts if self.load is None else self.load + counts
            expected = torch.full_like(z, logits.size(0) * self.k)  # N tokens × k rows each
            values = torch.stack([aux.detach(), z.detach(), torch.ones_like(z), expected])
            self.balance = values if self.balance is None else self.balance + values
        penalty = None
        if self.aux_loss_coef:
            penalty = self.aux_loss_coef * aux
        if self.z_loss_coef:
            penalty = self.z_loss_coef * z if penalty is None else penalty + self.z_loss_coef * z
        return y if penalty is None else _AddAuxLoss.apply(y, penalty)


def load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, k: int, score: str) -> torch.Tensor:
    """Switch Transformer's (and Mixtral's) auxiliary loss for one layer: E * sum_e f_e * P_e, where f_e is the share
    of the N*k routed rows that expert e received and P_e the mean router probability of e (sigmoid scores are
    normalised per token first). 1.0 when both are uniform, up to E when one expert takes everything.

    NOTE: transformers sums f_e over the k slots without dividing by k, so its value is k times this one for the
    same routing; the gradient direction is the same."""
    probs = scores if score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    share = tokens_per_expert.to(probs.dtype) / (probs.size(0) * k)
    return probs.size(-1) * torch.dot(share, probs.mean(dim=0))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2, which keeps the logits small."""
    return logits.float().logsumexp(dim=-1).square().mean()


class _AddAuxLoss(torch.autograd.Function):
    """Returns ``y`` unchanged; in backward, ``penalty`` (a scalar loss) receives the gradient ``aux_scale`` as if it
    had been added to the loss. ``aux_scale`` is what the training step scales each micro-batch's loss by relative to
    a plain mean (:func:`set_aux_loss_scale`), so the balancing losses weigh the same at any accumulation."""

    aux_scale: float = 1.0

    @staticmethod
    def forward(ctx, y: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
        ctx.penalty_shape = penalty.shape
        ctx.penalty_dtype = penalty.dtype
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scale = _AddAuxLoss.aux_scale
        if isinstance(scale, torch.Tensor):  # on the device: no read
            scale = scale.to(grad.device, ctx.penalty_dtype).expand(ctx.penalty_shape)
        else:
            scale = torch.full(ctx.penalty_shape, scale, dtype=ctx.penalty_dtype, device=grad.device)
        return grad, scale


def set_aux_loss_scale(scale: Union[float, torch.Tensor]) -> None:
    """The gradient the balancing losses of each micro-batch enter backward with: 1 / (micro-batches per optimizer
    step) for a step that averages its micro-batches' losses (times an fp16 loss scale, which may be a device
    tensor: it is not read)."""
    _AddAuxLoss.aux_scale = scale.detach() if isinstance(scale, torch.Tensor) else float(scale)


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(name, module) of each MoE in ``model`` (a GPT, a pipeline stage, a wrapped model), in order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]


def reset_moe_stats(model: nn.Module) -> None:
    for _, layer in moe_layers(model):
        layer.load = layer.balance = None


@dataclass
class MoEStats:
    """What the MoE layers of a model saw since the last reset: per layer, the rows each expert received (``load``)
    and the sums of ``balance`` (L, 4): auxiliary loss, z-loss, passes, rows expected. The properties read them
    (each a device read); ``load`` and ``balance`` stay on the device."""

    names: list[str]
    load: list[torch.Tensor]
    balance: torch.Tensor

    @property
    def aux_loss(self) -> list[float]:
        """Per layer, the mean auxiliary loss of its forward passes (1.0 when balanced)."""
        return (self.balance[:, 0] / self.balance[:, 2].clamp_min(1)).tolist()

    @property
    def z_loss(self) -> list[float]:
        """Per layer, the mean router z-loss of its forward passes."""
        return (self.balance[:, 1] / self.balance[:, 2].clamp_min(1)).tolist()

    def max_over_mean(self) -> list[float]:
        """Per layer, the busiest expert's rows over the mean: 1.0 is perfect balance, E all rows on one expert."""
        return [float(load.max() / load.mean().clamp_min(1e-12)) for load in self.load]

    def dropped_share(self) -> list[float]:
        """Per layer, the share of the rows expected (tokens × k) that reached no expert: 0 for dropless routing."""
        routed = torch.stack([load.sum() for load in self.load])
        return (1 - routed / self.balance[:, 3].clamp_min(1)).tolist()


def moe_stats(model: nn.Module, reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Optional[MoEStats]:
    """The stats of the MoE layers that ran a training forward since the last reset, or None when there are none.
    ``reduce`` sums a tensor over the ranks that saw other tokens (the data-parallel ranks), in place."""
    layers = [(name, layer) for name, layer in moe_layers(model) if layer.load is not None]
    if not layers:
        return None
    both = torch.cat([torch.stack([layer.load for _, layer in layers]),
                      torch.stack([layer.balance for _, layer in layers])], dim=1)  # one reduce for both
    if reduce is not None:
        both = reduce(both)
    n_expert = layers[0][1].n_expert
    return MoEStats(names=[name for name, _ in layers], load=list(both[:, :n_expert]), balance=both[:, n_expert:])


@torch.no_grad()
def update_expert_bias(model: nn.Module, rate: float, stats: MoEStats) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: each layer's ``expert_bias`` moves by ``rate`` towards the mean
    load, down for an expert above it and up for one below, from the loads of ``stats`` (summed over every rank
    that routed tokens, so that all ranks move their biases alike). A frozen router's bias stays too (LoRA): its
    adapters' checkpoints hold no bias, and merging them must give the routing they trained with."""
    layers = dict(moe_layers(model))
    for name, load in zip(stats.names, stats.load):
        if not layers[name].router.weight.requires_grad:
            continue
        bias = layers[name].expert_bias
        bias.add_(torch.sign(load.mean() - load).to(bias.device, bias.dtype), alpha=rate)
