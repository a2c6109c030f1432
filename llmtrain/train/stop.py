"""When a run stops and when it saves (:class:`StopPolicy`): the horizon's limits, stop votes, checkpoints."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from llmtrain.checkpoint.checkpointer import NonFiniteWeightsError
from llmtrain.train.nonfinite import NonFiniteError, resume_advice

if TYPE_CHECKING:
    from llmtrain.train.loop import Fit
    from llmtrain.train.nonfinite import NonFiniteSteps
    from llmtrain.signals import StopRequest


class StopPolicy:
    """When the run stops and when it saves: the horizon's limits, --train.max_time, stop signals, the save interval.

    As each step starts, every rank votes (:meth:`votes`: a stop signal received, see
    :mod:`llmtrain.signals`, and whether --train.max_time runs out during the step); the votes ride
    in the step's opening all-reduce with the input tokens, so after the step every rank knows the same
    sums (:meth:`after_step`) and every rank stops after the same step.
    """

    def __init__(self, job: Fit, request: StopRequest) -> None:
        self.job, self.request = job, request
        self.signal = ""
        """Why some rank asked to stop, once the ranks have agreed on it."""
        self.last_saved_step = job.state.step or None
        self.started, self.elapsed_at_start = time.perf_counter(), job.state.elapsed_s
        self.last_step_s = 0.0
        max_time = job.horizon.max_time
        # A resumed run can be out of time before its first step; every rank read the same elapsed time.
        self.time_over = max_time is not None and job.state.elapsed_s >= max_time

    def votes(self) -> list[float]:
        """This rank's votes as a step starts: a stop signal received; --train.max_time passed by the step's end
        (were it as long as the last step), so that the run stops after the step in which the time runs out."""
        max_time = self.job.horizon.max_time
        runs_out = max_time is not None and self._elapsed() + self.last_step_s >= max_time
        return [float(self.request.requested), float(runs_out)]

    def after_step(self, sums: list[float]) -> int:
        """Advance the clock and take the ranks' summed numbers (input tokens, then the votes); returns the
        step's input tokens over all ranks."""
        state = self.job.state
        elapsed = self._elapsed()
        self.last_step_s, state.elapsed_s = elapsed - state.elapsed_s, elapsed
        tokens, stop_votes, time_votes = sums
        self.time_over = time_votes > 0
        if stop_votes > 0:
            self.signal = f"got {self.request.name}" if self.request.requested else "another rank got a stop signal"
        return int(tokens)

    def _elapsed(self) -> float:
        return self.elapsed_at_start + time.perf_counter() - self.started

    def reason(self) -> str:
        """The first stop condition that holds, in words; empty while training should go on."""
        horizon, state = self.job.horizon, self.job.state
        if horizon.max_steps is not None and state.step >= horizon.max_steps:
            return f"reached --train.max_steps {horizon.max_steps}"
        if horizon.max_tokens is not None and state.tokens >= horizon.max_tokens:
            return f"reached --train.max_tokens {horizon.max_tokens}"
        if horizon.epochs is not None and self.job.train_loader.epoch >= horizon.epochs:
            return f"reached --train.epochs {horizon.epochs}"
        if self.time_over:
            return f"reached --train.max_time {horizon.max_time}s"
        return self.signal

    def save_due(self) -> bool:
        interval = self.job.train.save_interval
        return bool(interval and self.job.state.step % interval == 0)

    def save(self, skips: "NonFiniteSteps") -> bool:
        """Write a training checkpoint of this step (all ranks call it), unless one is written already; returns
        whether this step has one. None is written while a non-finite streak is open (the model may be diverging,
        and a good checkpoint must not be pruned for it): every rank knows the streak alike, from all-reduced norms.
        """
        job, state = self.job, self.job.state
        if skips.streak_open:
            job.console.print(f"step {state.step} | no checkpoint: the last {skips.in_a_row} steps' gradient "
                              f"norm was NaN or inf (the last good checkpoint: {job.rewind.checkpoint or 'none'})")
            return False
        if self.last_saved_step != state.step:
            try:
                job.rewind.saved(state.step, job.save_checkpoint(state))
            except NonFiniteWeightsError as error:  # every rank raises it: its check all-reduces
                raise NonFiniteError(f"{error}. {resume_advice(job)}") from None
            self.last_saved_step = state.step
        return True
