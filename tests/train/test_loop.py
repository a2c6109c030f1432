"""fit(): loss normalisation over the whole optimizer step, stop conditions, metrics."""

import copy

import pytest
import torch

from llmtrain.args import EvalArgs, TrainArgs, batch_plan
from llmtrain.config import Config
from llmtrain.distributed.runtime import Runtime
from llmtrain.model import GPT
from llmtrain import callbacks
from llmtrain.train.horizon import plan_horizon
from llmtrain.train.loop import IGNORE_INDEX, Fit, fit
from llmtrain.train.metrics import interval_memory
from llmtrain.precision import Precision

from conftest import ListLoader

CONFIG = dict(name="loop-test", vocab_size=64, padding_multiple=64, block_size=16, n_layer=2, n_head=2,
              n_embd=32, n_query_groups=1, intermediate_size=64)


def padded_samples(seed=0, n=4, length=12):
    """Samples with very different numbers of target tokens: padding must not change the gradient."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(n):
        ids = torch.randint(0, 64, (length,), generator=generator)
        labels = torch.randint(0, 64, (length,), generator=generator)
        labels[2 + 3 * index:] = IGNORE_INDEX  # 2, 5, 8, 11 real targets
        samples.append((ids, labels))
    return samples


def run_one_step(model, samples, micro_batch_size, global_batch_size=4):
    train = TrainArgs(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, max_steps=1,
                      max_norm=None, lr_warmup_steps=0, save_interval=None)
    plan = batch_plan(train, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = ListLoader(samples, micro_batch_size)
    job = Fit(runtime=Runtime(), model=model, optimizer=optimizer, train_loader=loader, val_loader=None,
              train=train, eval=EvalArgs(initial_validation=False, final_validation=False), plan=plan,
              horizon=plan_horizon(train, 1, None), precision=Precision("32-true"),
              save_checkpoint=lambda state: None, save_final=lambda state: None)
    fit(job)
    return job


def reference_gradient(model, samples):
    """The gradient of the mean token loss over all targets of the step, computed in one go."""
    model = copy.deepcopy(model)
    ids = torch.stack([s[0] for s in samples])
    labels = torch.stack([s[1] for s in samples])
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_accumulation_4x1_equals_1x4_with_padding():
    torch.manual_seed(0)
    base = GPT(Config(**CONFIG))
    base.init_weights()
    samples = padded_samples()
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    expected = reference_gradient(base, samples)

    updated = {}
    for micro in (1, 4):
        model = copy.deepcopy(base)
        run_one_step(model, samples, micro_batch_size=micro)
        # SGD with lr 1: the update is minus the gradient.
        updated[micro] = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    for name in before:
        torch.testing.assert_close(updated[1][name], updated[4][name], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(updated[4][name], expected[name], atol=1e-6, rtol=1e-5)
    # Padding really varied: a per-micro-batch mean would weight the 2-token sample like the 11-token one.
    assert max(float((updated[1][n] - expected[n]).abs().max()) for n in before) < 1e-5


def test_per_micro_batch_mean_would_differ():
    """Guard for the test above: the naive normalisation gives a different gradient on this data."""
    torch.manual_seed(0)
    model = GPT(Config(**CONFIG))
    model.init_weights()
    samples = padded_samples()
    expected = reference_gradient(model, samples)
    naive = copy.deepcopy(model)
    for ids, labels in samples:
        loss = torch.nn.functional.cross_entropy(naive(ids[None]).flatten(0, 1), labels, ignore_index=IGNORE_INDEX)
        (loss / len(samples)).backward()
    diffs = [float((p.grad - expected[n]).abs().max()) for n, p in naive.named_parameters()]
    assert max(diffs) > 1e-4


def test_stops_at_max_tokens_and_counts_tokens():
    torch.manual_seed(0)
    model = GPT(Config(**CONFIG))
    model.init_weights()
    samples = padded_samples()
    train = TrainArgs(global_batch_size=2, micro_batch_size=1, max_tokens=2 * 12 * 3, lr_warmup_steps=0,
                      save_interval=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = batch_plan(train, 1)
    saved = []
    job = Fit(runtime=Runtime(), model=model, optimizer=optimizer, train_loader=ListLoader(samples, 1),
              val_loader=None, train=train, eval=EvalArgs(initial_validation=False), plan=plan,
              horizon=plan_horizon(train, 2 * 12, None), precision=Precision("32-true"),
              save_checkpoint=lambda s: saved.append(("step", s.step)), save_final=lambda s: saved.append(("final", s.step)))
    state = fit(job)
    assert state.step == 3 and state.tokens == 72
    assert "max_tokens" in state.stop_reason
    assert saved == [("step", 3), ("final", 3)]


class Recorder(callbacks.Callback):
    """Writes down the step hooks and the end of fit() under its name; raises in on_step_start(fail_at) if given."""

    def __init__(self, calls, name, fail_at=None):
        self.calls, self.name, self.fail_at = calls, name, fail_at

    def on_step_start(self, step):
        self.calls.append((self.name, "start", step))
        if step == self.fail_at:
            raise RuntimeError("a failing step")

    def on_step_end(self, step):
        self.calls.append((self.name, "end", step))

    def on_fit_end(self):
        self.calls.append((self.name, "fit_end"))


@pytest.mark.parametrize("fail_at", [None, 2])
def test_a_runs_own_callbacks_see_every_step_end_and_the_end_of_fit(fail_at):
    torch.manual_seed(0)
    model = GPT(Config(**CONFIG))
    train = TrainArgs(global_batch_size=1, micro_batch_size=1, max_steps=2, lr_warmup_steps=0, save_interval=None)
    calls = []
    installed = callbacks.register(Recorder(calls, "installed"))
    job = Fit(runtime=Runtime(), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
              train_loader=ListLoader(padded_samples(), 1), val_loader=None, train=train,
              eval=EvalArgs(initial_validation=False, final_validation=False), plan=batch_plan(train, 1),
              horizon=plan_horizon(train, 12, None), precision=Precision("32-true"),
              save_checkpoint=lambda s: None, save_final=lambda s: None,
              callbacks=[Recorder(calls, "own", fail_at)])
    try:
        if fail_at is None:
            fit(job)
        else:
            with pytest.raises(RuntimeError, match="a failing step"):
                fit(job)
    finally:
        callbacks.unregister(installed)
    own = [call[1:] for call in calls if call[0] == "own"]
    steps = [("start", 1), ("end", 1), ("start", 2)] + ([("end", 2)] if fail_at is None else [])
    assert own == [*steps, ("fit_end",)]  # on_fit_end also when fit() raises
    assert calls[0] == ("own", "start", 1) and calls[-1] == ("installed", "fit_end")  # the run's own come first


class TwoRanks(Runtime):
    """Rank 0 of two, without processes: an all-reduce adds the other rank's numbers (its step counts are this
    rank's, with the stop and time votes of ``other_votes[step]``); every all-reduce is written down."""

    def __init__(self, other_votes):
        super().__init__(world_size=2, data_parallel_size=2)
        self.other_votes, self.reduced = other_votes, []

    def all_reduce(self, tensor, op="sum"):
        self.reduced.append((tensor.device, tensor.dtype, tensor.tolist()))
        other = tensor.clone()
        if tensor.numel() == 4:  # a step's counts: target tokens, input tokens, stop vote, time vote
            other[2:] = torch.tensor(self.other_votes.get(len(self.reduced), (0.0, 0.0)))
        return tensor.add_(other)


def fit_two_ranks(other_votes, callbacks_=(), max_time=None):
    from llmtrain.train.loop import TrainState

    torch.manual_seed(0)
    model = GPT(Config(**CONFIG))
    model.init_weights()
    train = TrainArgs(global_batch_size=2, micro_batch_size=1, max_steps=6, max_time=max_time, lr_warmup_steps=0,
                      save_interval=None, log_interval=100)
    runtime, state, saved = TwoRanks(other_votes), TrainState(), []
    job = Fit(runtime=runtime, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
              train_loader=ListLoader(padded_samples(n=16), 1), val_loader=None, train=train,
              eval=EvalArgs(initial_validation=False, final_validation=False), plan=batch_plan(train, 1),
              horizon=plan_horizon(train, 2 * 12, None), precision=Precision("32-true"), state=state,
              save_checkpoint=lambda s: saved.append(s.step), save_final=lambda s: saved.append("final"),
              callbacks=list(callbacks_))
    return job, runtime, saved


@pytest.fixture
def no_new_groups(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("fit() created a process group")

    monkeypatch.setattr(torch.distributed, "new_group", refused)


def test_another_ranks_stop_vote_rides_in_the_steps_one_all_reduce(no_new_groups):
    """Each step makes one all-reduce, on the run's device, of its target tokens and the host's numbers (input
    tokens, stop vote, time vote); a stop vote from the other rank at step 2 stops both after step 2."""
    from llmtrain.signals import Preempted

    job, runtime, saved = fit_two_ranks({2: (1.0, 0.0)})
    with pytest.raises(Preempted):
        fit(job)
    assert job.state.step == 2 and job.state.stop_reason == "another rank got a stop signal"
    assert [(device, dtype) for device, dtype, _ in runtime.reduced] == [(job.runtime.device, torch.float64)] * 2
    assert [numbers[1:] for _, _, numbers in runtime.reduced] == [[24.0, 0.0, 0.0]] * 2  # 2 micro-batches of 12
    assert job.state.tokens == 2 * 2 * 24  # summed over both ranks
    assert saved == [2]  # the checkpoint of a stop signal, no final model


def test_this_ranks_signal_counts_in_the_step_that_starts_after_it(no_new_groups):
    import os
    import signal

    from llmtrain.signals import Preempted

    class SignalAt(callbacks.Callback):
        def on_step_start(self, step):
            if step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)

    job, runtime, _ = fit_two_ranks({}, [SignalAt()])
    with pytest.raises(Preempted):
        fit(job)
    assert job.state.step == 3 and job.state.stop_reason == "got SIGUSR1"
    assert [numbers[2] for _, _, numbers in runtime.reduced] == [0.0, 0.0, 1.0]


def test_a_max_time_vote_of_another_rank_stops_every_rank_after_that_step(no_new_groups):
    job, runtime, saved = fit_two_ranks({3: (0.0, 1.0)}, max_time=1e6)
    state = fit(job)
    assert state.step == 3 and state.stop_reason == "reached --train.max_time 1000000.0s"
    assert saved == [3, "final"]


def test_the_time_vote_stops_the_run_after_the_step_in_which_max_time_runs_out(monkeypatch):
    """Votes are cast as a step starts, so the time vote looks one step (as long as the last) ahead."""
    from types import SimpleNamespace

    from llmtrain.train import horizon, loop, stop
    from llmtrain.signals import StopRequest

    clock = [0.0]
    monkeypatch.setattr(stop, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    job = SimpleNamespace(horizon=horizon.Horizon(total_steps=100, warmup_steps=0, max_time=10.0),
                          state=loop.TrainState())
    stops = stop.StopPolicy(job, StopRequest())
    time_votes = []
    for step in range(1, 6):  # steps of 3 s: the time runs out during step 4 (9 s to 12 s)
        time_votes.append(stops.votes()[1])
        clock[0] += 3.0
        stops.after_step([0.0, 0.0, time_votes[-1]])
        if stops.reason():
            break
    assert time_votes == [0.0, 0.0, 0.0, 1.0] and job.state.elapsed_s == 12.0
    assert stops.reason() == "reached --train.max_time 10.0s"


# ------------------------------------------------------------------------------------ metrics
class MetricsRecorder:
    def __init__(self):
        self.rows = []

    def log(self, metrics):
        self.rows.append(metrics)

    def close(self):
        pass


class PaddedLoader(ListLoader):
    """ListLoader whose batches say how many of their input tokens are real: the first `real` of each row."""

    def __init__(self, samples, micro_batch_size, real):
        super().__init__(samples, micro_batch_size)
        self.real = real

    def __next__(self):
        batch = super().__next__()
        return {**batch, "real_tokens": torch.tensor(self.real * batch["input_ids"].size(0))}


def logged_fit(max_steps, train_loader, val_loader=None, eval=None, **job_fields) -> MetricsRecorder:
    """fit() of the tiny model, SGD, micro batch 1 of 2, a log line every step; returns what it logged."""
    torch.manual_seed(0)
    model = GPT(Config(**CONFIG))
    model.init_weights()
    train = TrainArgs(global_batch_size=2, micro_batch_size=1, max_steps=max_steps, log_interval=1,
                      lr_warmup_steps=0, save_interval=None)
    recorder = MetricsRecorder()
    fit(Fit(runtime=Runtime(), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            train_loader=train_loader, val_loader=val_loader, train=train,
            eval=eval or EvalArgs(initial_validation=False, final_validation=False), plan=batch_plan(train, 1),
            horizon=plan_horizon(train, 2 * 12, None), precision=Precision("32-true"),
            save_checkpoint=lambda s: None, save_final=lambda s: None, loggers=[recorder], **job_fields))
    return recorder


def test_mfu_counts_the_real_tokens_and_not_the_padding():
    recorder = logged_fit(2, PaddedLoader(padded_samples(), 1, real=3), flops_per_token=1e6,
                          peak_flops_per_device=1e9)
    rows = [row for row in recorder.rows if "loss" in row]
    assert len(rows) == 2
    for row in rows:  # 3 real tokens in each sample of 12: a quarter of the work counts
        padded_mfu = row["tokens_per_sec_per_device"] * 1e6 / 1e9
        assert row["mfu"] == pytest.approx(padded_mfu * 3 / 12, rel=1e-3)


def test_validation_time_is_no_part_of_the_logged_throughput(monkeypatch):
    """A clock that validation moves 1,000 s: the tokens/s of every log line still count the steps' time alone."""
    from types import SimpleNamespace

    from llmtrain.train import loop, metrics, stop

    clock = [0.0]

    def perf_counter():
        clock[0] += 0.001  # every reading of the clock is a millisecond later
        return clock[0]

    def slow_validation(job):
        clock[0] += 1000.0
        return 1.0

    for module in (metrics, stop):  # the interval's clock and the run's
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(loop, "_validation_loss", slow_validation)
    recorder = logged_fit(3, ListLoader(padded_samples(), 1), ListLoader(padded_samples(seed=1), 1),
                          EvalArgs(interval=1, max_iters=1, initial_validation=True, final_validation=False))
    rows = [row for row in recorder.rows if "loss" in row]
    assert len(rows) == 3 and sum("val_loss" in row for row in recorder.rows) == 4
    for row in rows:  # 24 tokens a step in a few milliseconds of this clock; with a validation, under 0.03 tokens/s
        assert row["tokens_per_sec"] > 24, row


class FakeCUDAAllocator:
    """The numbers torch.cuda.memory_stats reports, for a process that allocates and frees by hand."""

    def __init__(self):
        self.allocated = self.allocated_peak = self.reserved = self.reserved_peak = self.retries = 0

    def allocate(self, gib, retried=False):
        self.allocated += gib * 2**30
        self.reserved = max(self.reserved, self.allocated)
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        self.retries += retried

    def free(self, gib):
        self.allocated -= gib * 2**30

    def memory_stats(self, device=None):
        return {"allocated_bytes.all.peak": self.allocated_peak, "reserved_bytes.all.peak": self.reserved_peak,
                "num_alloc_retries": self.retries}

    def reset_peak_memory_stats(self, device=None):
        self.allocated_peak, self.reserved_peak = self.allocated, self.reserved


def test_cuda_memory_is_reported_per_log_interval(monkeypatch):
    allocator = FakeCUDAAllocator()
    monkeypatch.setattr(torch.cuda, "memory_stats", allocator.memory_stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", allocator.reset_peak_memory_stats)
    cuda = torch.device("cuda", 0)
    allocator.allocate(3)  # the first interval: a 3 GiB peak, then back down to 1
    allocator.free(2)
    assert interval_memory(cuda) == {"peak_memory_gb": 3.0, "reserved_memory_gb": 3.0, "alloc_retries": 0}
    allocator.allocate(0.5, retried=True)  # the second interval: 1.5 GiB at most, though 3 stay reserved
    assert interval_memory(cuda) == {"peak_memory_gb": 1.5, "reserved_memory_gb": 3.0, "alloc_retries": 1}
    assert interval_memory(cuda)["peak_memory_gb"] == 1.5  # nothing allocated since: the level it stays at
    assert set(interval_memory(torch.device("cpu"))) == {"peak_memory_gb"}
