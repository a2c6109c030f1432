"""The training loop on a mixture of experts: the balancing losses' weight in a step, the log's balance numbers,
the bias update, activation checkpointing. The 2-rank runs (biases equal on every rank, a sharded checkpoint
resumed) share the launch of tests/distributed/test_parallelize.py."""

from __future__ import annotations

import pytest
import torch

import dist_worker as worker
from llmtrain import callbacks
from llmtrain.args import EvalArgs, FSDPArgs, TrainArgs, batch_plan
from llmtrain.config import Config
from llmtrain.distributed.runtime import Runtime
from llmtrain.model import GPT
from llmtrain.moe import MoE, load_balancing_loss, moe_layers, route, router_z_loss
from llmtrain.precision import Precision
from llmtrain.train.experts import metrics_of, moe_columns
from llmtrain.train.horizon import plan_horizon
from llmtrain.train.loggers import format_line
from llmtrain.train.loop import Fit
from llmtrain.train.step import TrainStep
from llmtrain.train.strategy import TorchStrategy


def tiny_moe(**overrides) -> Config:
    fields = dict(n_layer=2, n_embd=32, n_head=2, n_query_groups=1, n_expert=4, moe_intermediate_size=32,
                  vocab_size=64, block_size=16, router_aux_loss_coef=0.3, router_z_loss_coef=0.05)
    return Config.from_name("moe-debug", **{**fields, **overrides})


class Capture(TorchStrategy):
    """torch's strategy, keeping the step's gradients before the optimizer step."""

    def step(self):
        self.grads = {name: p.grad.clone() for name, p in self.job.model.named_parameters()}
        return super().step()


def micro_batches(count: int, config: Config) -> list[dict]:
    generator = torch.Generator().manual_seed(3)
    batches = []
    for index in range(count):
        rows = torch.randint(0, config.vocab_size, (2, 13), generator=generator)
        labels = rows[:, 1:].clone()
        labels[index, 5:] = -100  # the micro-batches count different targets
        batches.append({"input_ids": rows[:, :-1], "labels": labels})
    return batches


def explicit_gradients(model: GPT, config: Config, batches: list[dict]) -> dict:
    """The step's loss written out: each micro-batch's summed token losses over the step's targets, plus the
    coefficients times each layer's auxiliary and z losses, averaged over the micro-batches."""
    model.eval()  # no injected losses: they are added here by hand
    inputs = []
    hooks = [layer.register_forward_hook(lambda module, args, out: inputs.append((module, args[0])))
             for _, layer in moe_layers(model)]
    targets = sum(int((batch["labels"] != -100).sum()) for batch in batches)
    model.zero_grad()
    for batch in batches:
        inputs.clear()
        loss = model(batch["input_ids"], labels=batch["labels"]) / targets
        for module, x in inputs:
            logits = module.router(x.reshape(-1, config.n_embd))
            _, chosen, scores = route(logits, config.n_expert_per_token, config.router_score, config.norm_topk_prob)
            counts = torch.bincount(chosen.flatten(), minlength=config.n_expert)
            penalty = (config.router_aux_loss_coef * load_balancing_loss(scores, counts, config.n_expert_per_token,
                                                                        config.router_score)
                       + config.router_z_loss_coef * router_z_loss(logits))
            loss = loss + penalty / len(batches)
        loss.backward()
    for hook in hooks:
        hook.remove()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_balancing_losses_weigh_like_a_mean_over_the_steps_micro_batches(accumulation):
    config = tiny_moe()
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    batches = micro_batches(accumulation, config)
    train = TrainArgs(global_batch_size=2 * accumulation, micro_batch_size=2, max_steps=1, lr_warmup_steps=0)
    job = Fit(runtime=Runtime(), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), train_loader=None,
              val_loader=None, train=train, eval=EvalArgs(), plan=batch_plan(train, 1),
              horizon=plan_horizon(train, 1, None), precision=Precision("32-true"),
              save_checkpoint=lambda state: None, save_final=lambda state: None)
    strategy = Capture(job)
    model.train()
    TrainStep(job, strategy, callbacks.Callbacks([]))(1, batches, [0.0])
    expected = explicit_gradients(model, config, batches)
    router = "blocks.0.mlp.router.weight"
    assert strategy.grads[router].abs().sum() > 0
    for name, grad in expected.items():
        torch.testing.assert_close(strategy.grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The 2-rank scenario's model and batches in one process: 8 steps, the bias update on, no checkpointing."""
    return worker.one_process_moe()


def test_the_log_shows_each_layers_balance_and_nothing_dropped(one_process):
    config = worker.moe_config()
    steps = sorted(one_process["moe"])
    assert steps == list(range(1, worker.MAX_STEPS + 1))  # the tests' runs log every step
    for step in steps:
        metrics = one_process["moe"][step]
        layers = [metrics[f"moe/load_max_over_mean/{i}"] for i in range(config.n_layer)]
        assert 1.0 <= min(layers) and max(layers) <= config.n_expert
        assert metrics["moe/load_max_over_mean"] == max(layers)
        assert layers[metrics["moe/load_worst_layer"]] == max(layers)
        assert metrics["moe/dropped_share"] == 0.0
        assert 0 < metrics["moe/aux_loss"] <= config.n_expert  # 1.0 when balanced
        assert metrics["moe/z_loss"] > 0
    assert set(one_process["moe"][1]) == set(moe_columns(config))
    line = format_line({"step": 8, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 100.0,
                        "peak_memory_gb": 0.1, **one_process["moe"][8]})
    assert f"load max/mean {one_process['moe'][8]['moe/load_max_over_mean']:.3f} (layer " in line
    assert "dropped 0.0%" in line and "aux_loss " in line and "z_loss " in line


def test_the_bias_update_moves_every_layers_biases(one_process):
    (biases,) = one_process["expert_biases"]  # one rank
    for bias in biases:
        assert bias.abs().max() > 0 and bias.sum().abs() < bias.abs().sum()  # up for some experts, down for others


@pytest.mark.parametrize("mode", [True, "op"], ids=["full", "op"])
def test_activation_checkpointing_keeps_the_losses_and_the_biases(one_process, mode):
    """A recomputed forward counts its load again: every logged ratio and the bias update stay the same."""
    result = worker.train(Runtime(), config=worker.moe_config(), fsdp=FSDPArgs(activation_checkpointing=mode))
    assert result["losses"] == one_process["losses"]
    for got, expected in zip(result["expert_biases"][0], one_process["expert_biases"][0]):
        assert torch.equal(got, expected)
    for step, metrics in result["moe"].items():
        assert metrics == pytest.approx(one_process["moe"][step])


def test_dropped_share_counts_the_rows_owed():
    rows = torch.zeros(2, 4 + 4)
    rows[0, :4] = torch.tensor([3.0, 1.0, 2.0, 2.0])
    rows[0, 4:] = torch.tensor([2.2, 0.0, 2.0, 10.0])  # aux sum, z sum, forwards, rows owed (2 rows were not routed)
    metrics = metrics_of(rows, n_expert=4, z_loss=False)  # layer 1 ran no forward (a dense layer): left out
    assert metrics == {"moe/aux_loss": pytest.approx(1.1), "moe/load_max_over_mean": 1.5, "moe/load_worst_layer": 0,
                       "moe/dropped_share": pytest.approx(0.2), "moe/load_max_over_mean/0": 1.5}
    assert moe_columns(Config.from_name("llama-debug")) == []


def test_validation_counts_no_load():
    model = GPT(tiny_moe())
    model.init_weights()
    model.eval()
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 8)))
    assert all(layer.load is None for layer in model.modules() if isinstance(layer, MoE))
