import pytest

from llmtrain.args import EvalArgs, TrainArgs, batch_plan


@pytest.mark.parametrize(
    "global_batch, micro_batch, dp, accum",
    [(64, 4, 1, 16), (64, 4, 2, 8), (64, 4, 16, 1), (512, 4, 32, 4), (6, 2, 3, 1)],
)
def test_accumulation_is_global_over_data_parallel_times_micro(global_batch, micro_batch, dp, accum):
    plan = batch_plan(TrainArgs(global_batch_size=global_batch, micro_batch_size=micro_batch), dp)
    assert plan.grad_accum_steps == accum
    assert plan.grad_accum_steps * plan.samples_per_micro_step == global_batch


def test_indivisible_batch_names_flags_and_valid_values():
    with pytest.raises(ValueError) as error:
        batch_plan(TrainArgs(global_batch_size=64, micro_batch_size=4), 3)
    message = str(error.value)
    assert "--train.global_batch_size 64" in message and "--train.micro_batch_size 4" in message
    assert "data-parallel size 3" in message
    # Suggested values must themselves be valid.
    assert "60" in message and "72" in message
    for suggestion in (60, 72):
        assert batch_plan(TrainArgs(global_batch_size=suggestion, micro_batch_size=4), 3).grad_accum_steps


def test_indivisible_suggests_micro_batch_when_one_fits():
    with pytest.raises(ValueError, match="--train.micro_batch_size 3"):
        batch_plan(TrainArgs(global_batch_size=12, micro_batch_size=4), 2)


@pytest.mark.parametrize("kwargs, flag", [
    ({"global_batch_size": 0}, "--train.global_batch_size"),
    ({"micro_batch_size": 0}, "--train.micro_batch_size"),
    ({"global_batch_size": 2, "micro_batch_size": 4}, "smaller than --train.micro_batch_size"),
    ({"max_steps": 0}, "--train.max_steps"),
    ({"lr_warmup_fraction": 1.5}, "--train.lr_warmup_fraction"),
    ({"lr_decay": "step"}, "--train.lr_decay"),
    ({"max_time": -1.0}, "--train.max_time"),
])
def test_bad_train_args_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        TrainArgs(**kwargs)


def test_bad_eval_args_name_the_flag():
    with pytest.raises(ValueError, match="--eval.interval"):
        EvalArgs(interval=0)
