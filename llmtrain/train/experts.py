"""The training loop's side of mixtures of experts: the balancing losses' weight in a step, DeepSeek's
auxiliary-loss-free bias update after each optimizer step, and the numbers a log line shows.

The MoE layers (:mod:`llmtrain.moe`) count, in every training forward, the rows each expert received and the sums
of their balancing losses. :class:`ExpertBalance` reads those counts as one tensor per model, indexed by the layer's
place in the whole model (``blocks.<i>``), and sums it over all ranks in one all-reduce:

- the data-parallel ranks (expert parallelism's included) saw other tokens, so their loads add up;
- the pipeline ranks hold other layers, whose rows the sum fills in, so that rank 0 logs every layer;
- the tensor-parallel ranks of one shard route the same tokens, so each count is multiplied alike (or, under
  sequence parallelism, each routes its part of them, and the parts add up).

Every number read from the sum is a ratio (a layer's busiest expert over the mean, the mean losses per forward,
the share of rows dropped) or a sign (the bias update), which a common factor leaves unchanged. So every rank
that holds a layer moves its ``expert_bias`` by the same amount, and one collective serves the bias update and
the log, whatever the layout.

The metrics (under ``moe/``, after METRICS in metrics.csv): ``moe/aux_loss`` (the mean over layers of each layer's
mean auxiliary loss, 1.0 when balanced), ``moe/z_loss`` (when the z-loss is on), ``moe/load_max_over_mean`` (the
worst layer's busiest expert over its mean load, 1.0 when balanced), ``moe/load_worst_layer``, ``moe/dropped_share``
(the share of the rows routing owed, tokens × k, that reached no expert: 0, routing is dropless) and per layer
``moe/load_max_over_mean/<layer>``. The console line shows the first four and the dropped share.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional

import torch

from llmtrain.moe import MoEStats, moe_layers, moe_stats, reset_moe_stats, set_aux_loss_scale, update_expert_bias
from llmtrain.train.loggers import MOE_PREFIX as PREFIX

if TYPE_CHECKING:
    from llmtrain.config import Config
    from llmtrain.train.loop import Fit
    from llmtrain.train.strategy import Strategy

_LAYER = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def moe_columns(config: "Config") -> list[str]:
    """The metric columns of a run of ``config``: none for a dense model."""
    if not config.is_moe:
        return []
    columns = [f"{PREFIX}aux_loss"] + ([f"{PREFIX}z_loss"] if config.router_z_loss_coef else [])
    columns += [f"{PREFIX}load_max_over_mean", f"{PREFIX}load_worst_layer", f"{PREFIX}dropped_share"]
    return columns + [f"{PREFIX}load_max_over_mean/{layer}" for layer in range(config.n_layer)]


def describe(config: "Config") -> Optional[str]:
    """The start-up line of an MoE run; None for a dense model."""
    if not config.is_moe:
        return None
    shared = f" + {config.n_shared_expert} shared" if config.n_shared_expert else ""
    balancing = [f"aux loss coef {config.router_aux_loss_coef:g}"]
    if config.router_z_loss_coef:
        balancing.append(f"z-loss coef {config.router_z_loss_coef:g}")
    if config.router_bias_update_rate:
        balancing.append(f"aux-loss-free bias rate {config.router_bias_update_rate:g}")
    return (f"mixture of experts: {config.n_expert} experts{shared} of width {config.moe_intermediate_size}, top-"
            f"{config.n_expert_per_token} ({config.router_score} scores), dropless; {', '.join(balancing)}")


def set_step_aux_scale(strategy: "Strategy", n_micro_batches: int, device: torch.device) -> None:
    """Before a step's passes: each micro-batch's balancing losses enter backward with weight 1 / (micro-batches
    of the step), times the strategy's fp16 loss scale (not read), so that they weigh like a plain mean over the
    step's micro-batches on each rank. The data-parallel wrappers average gradients over the ranks (as the token
    loss's scale assumes), so a step weighs them like a mean over every micro-batch of every rank: one process
    accumulating N micro-batches gets the gradient of N ranks with one each."""
    set_aux_loss_scale(strategy.scale_loss(torch.ones((), device=device)) / n_micro_batches)


class ExpertBalance:
    """The MoE numbers of a run: the bias update after each step and the log interval's sums (all ranks call both;
    each is one all-reduce when it has work, nothing for a dense model)."""

    def __init__(self, job: "Fit") -> None:
        self.job = job
        config = job.config
        local = moe_layers(job.model)
        # Every rank must agree on whether to meet in the all-reduce: the config says, else the model (one process).
        self.enabled = config.is_moe if config is not None else bool(local)
        self.rate = config.router_bias_update_rate if config is not None else 0.0
        self.z_loss = bool(config.router_z_loss_coef) if config is not None else False
        if config is not None:
            self.n_layer, self.n_expert = config.n_layer, config.n_expert
        elif local:
            self.n_layer = 1 + max(_layer_index(name) for name, _ in local)
            self.n_expert = local[0][1].n_expert
        self.interval: Optional[torch.Tensor] = None  # the rows summed since the last log (bias updates read them)

    def after_step(self) -> None:
        """After each optimizer step, with ``router_bias_update_rate``: every rank moves its layers' biases towards
        the load summed over every rank, and the counts start again."""
        if not self.enabled or not self.rate:
            return
        rows = self._summed()
        stats = self._own_layers(rows)
        if stats is not None:
            update_expert_bias(self.job.model, self.rate, stats)
        self.interval = rows if self.interval is None else self.interval + rows

    def interval_metrics(self) -> dict:
        """The interval's MoE metrics (the module's metrics), and starts the next interval; all ranks call it."""
        if not self.enabled:
            return {}
        if not self.rate:
            rows = self._summed()
        else:
            rows, self.interval = self.interval, None
        if rows is None:
            return {}
        return metrics_of(rows, self.n_expert, self.z_loss)

    def _summed(self) -> torch.Tensor:
        """(n_layer, E + 4) per layer of the whole model: the rows each expert received, then the sums [aux loss,
        z-loss, forwards, rows owed], summed over all ranks; the counts of this rank's layers start again."""
        model = self.job.model
        rows = torch.zeros(self.n_layer, self.n_expert + 4, device=self.job.runtime.device)
        stats = moe_stats(model)
        if stats is not None:
            for name, load, balance in zip(stats.names, stats.load, stats.balance):
                rows[_layer_index(name)] = torch.cat([load, balance]).to(rows.device)
        reset_moe_stats(model)
        return self.job.runtime.all_reduce(rows)

    def _own_layers(self, rows: torch.Tensor) -> Optional[MoEStats]:
        """The summed rows of this rank's MoE layers as :func:`update_expert_bias` takes them."""
        names = [name for name, _ in moe_layers(self.job.model)]
        if not names:
            return None
        own = rows[[_layer_index(name) for name in names]]
        return MoEStats(names=names, load=list(own[:, :self.n_expert]), balance=own[:, self.n_expert:])


def metrics_of(rows: torch.Tensor, n_expert: int, z_loss: bool) -> dict:
    """The log's numbers from ``rows`` (:meth:`ExpertBalance._summed`); layers without an MoE forward are left out."""
    rows = rows.double().cpu()  # the one read of the interval
    load, aux, z, forwards, owed = (rows[:, :n_expert], rows[:, n_expert], rows[:, n_expert + 1],
                                    rows[:, n_expert + 2], rows[:, n_expert + 3])
    layers = [index for index in range(rows.size(0)) if forwards[index] > 0]
    if not layers:
        return {}
    ratio = {index: float(load[index].max() / load[index].mean().clamp_min(1e-12)) for index in layers}
    worst = max(layers, key=ratio.__getitem__)
    routed, owed_sum = float(load[layers].sum()), float(owed[layers].sum())
    metrics = {f"{PREFIX}aux_loss": sum(float(aux[i] / forwards[i]) for i in layers) / len(layers)}
    if z_loss:
        metrics[f"{PREFIX}z_loss"] = sum(float(z[i] / forwards[i]) for i in layers) / len(layers)
    metrics.update({f"{PREFIX}load_max_over_mean": ratio[worst], f"{PREFIX}load_worst_layer": worst,
                    f"{PREFIX}dropped_share": 1.0 - routed / max(owed_sum, 1.0)})
    metrics.update({f"{PREFIX}load_max_over_mean/{index}": ratio[index] for index in layers})
    return metrics


def _layer_index(name: str) -> int:
    """The place in the whole model of the block that holds the MoE ``name`` (``blocks.<i>`` under any wrapper)."""
    match = _LAYER.search(name)
    if match is None:
        raise ValueError(f"MoE layer {name!r} is in no block: its layer number is unknown")
    return int(match.group(1))
