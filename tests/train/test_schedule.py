import math

import pytest
import torch

from llmtrain.args import TrainArgs
from llmtrain.train.horizon import plan_horizon, step_limits
from llmtrain.train.schedule import WarmupDecaySchedule, lr_at


def test_warmup_is_linear_and_reaches_base_lr():
    rates = [lr_at(s, base_lr=1.0, warmup_steps=4, total_steps=20, min_lr=0.1) for s in range(4)]
    assert rates == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_cosine_decays_to_min_lr_at_the_end_and_stays():
    kwargs = dict(base_lr=1.0, warmup_steps=10, total_steps=110, min_lr=0.1)
    assert lr_at(10, **kwargs) == pytest.approx(1.0)
    assert lr_at(60, **kwargs) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cosine midpoint
    assert lr_at(110, **kwargs) == pytest.approx(0.1)
    assert lr_at(500, **kwargs) == pytest.approx(0.1)
    rates = [lr_at(s, **kwargs) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_linear_and_constant_decay():
    assert lr_at(55, base_lr=1.0, warmup_steps=0, total_steps=110, min_lr=0.0, decay="linear") == pytest.approx(0.5)
    assert lr_at(99, base_lr=1.0, warmup_steps=0, total_steps=110, min_lr=0.0, decay="constant") == 1.0


def test_schedule_sets_every_group_in_proportion():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.5}])
    schedule = WarmupDecaySchedule(optimizer, warmup_steps=0, total_steps=10, min_lr=0.1)
    schedule.set_step(10)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    assert optimizer.param_groups[1]["lr"] == pytest.approx(0.05)


def test_a_min_lr_that_would_raise_the_rate_is_refused():
    """A decay never climbs: min_lr above the optimizer's rate, or below zero, is a flag error before any step."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-5)
    with pytest.raises(ValueError, match=r"--train.min_lr 6e-05 is above the learning rate 2e-05 \(--optimizer.lr\)"):
        WarmupDecaySchedule(optimizer, warmup_steps=0, total_steps=10, min_lr=6e-5)
    WarmupDecaySchedule(optimizer, warmup_steps=0, total_steps=10, min_lr=6e-5, decay="constant")  # never decays
    schedule = WarmupDecaySchedule(optimizer, warmup_steps=0, total_steps=10, min_lr=2e-5)  # equal: constant
    assert all(schedule.set_step(step) == pytest.approx(2e-5) for step in range(12))
    with pytest.raises(ValueError, match="--train.min_lr must be >= 0"):
        TrainArgs(min_lr=-0.01)


def test_horizon_takes_the_earliest_limit():
    train = TrainArgs(max_steps=100, max_tokens=10 * 64 * 128, global_batch_size=64, micro_batch_size=4,
                      lr_warmup_steps=5)
    horizon = plan_horizon(train, tokens_per_step=64 * 128, samples_per_epoch=10_000)
    assert horizon.total_steps == 10
    epochs = TrainArgs(epochs=2.0, global_batch_size=64, micro_batch_size=4, lr_warmup_steps=0)
    assert plan_horizon(epochs, 64 * 128, samples_per_epoch=640).total_steps == 20
    fraction = TrainArgs(max_steps=200, lr_warmup_fraction=0.1)
    assert plan_horizon(fraction, 1, None).warmup_steps == 20


def test_each_limit_is_named_by_its_flag():
    train = TrainArgs(max_steps=300, max_tokens=100 * 128, epochs=1.0, global_batch_size=64, micro_batch_size=4,
                      lr_warmup_steps=0)
    # the data's size is not known before the data is set up: --train.epochs does not count yet
    assert step_limits(train, 128, None) == {"--train.max_steps 300": 300, "--train.max_tokens 12800": 100}
    assert plan_horizon(train, 128, samples_per_epoch=64 * 10).set_by == "--train.epochs 1"
    assert plan_horizon(train, 128, samples_per_epoch=64 * 1000).set_by == "--train.max_tokens 12800"


def test_the_run_says_its_length_and_the_limits_it_will_not_reach():
    both = TrainArgs(max_steps=5, epochs=1.0, global_batch_size=4, micro_batch_size=2, lr_warmup_steps=0)
    assert plan_horizon(both, 4 * 128, samples_per_epoch=12).describe() == (
        "training 3 steps = 1 epoch of 12 samples (--train.epochs 1, which ends it before --train.max_steps 5 (step 5))")
    streamed = TrainArgs(max_steps=400, max_time=60.0, global_batch_size=16, micro_batch_size=8, lr_warmup_steps=0)
    assert plan_horizon(streamed, 16 * 256, samples_per_epoch=None).describe() == (
        "training 400 steps = 1,638,400 tokens (--train.max_steps 400; --train.max_time 60s may stop it sooner)")


def test_horizon_needs_a_sizeable_limit():
    with pytest.raises(ValueError, match="--train.max_time alone"):
        plan_horizon(TrainArgs(max_time=60.0), 1024, 100)
    with pytest.raises(ValueError, match="--train.max_steps, --train.max_tokens or --train.epochs"):
        plan_horizon(TrainArgs(), 1024, 100)
    with pytest.warns(UserWarning, match="--train.lr_warmup_steps 100 is longer"):
        plan_horizon(TrainArgs(max_steps=10, lr_warmup_steps=100), 1024, 100)
