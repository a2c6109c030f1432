"""Preemption: SIGTERM and SIGUSR1 ask a run to checkpoint and stop; it then exits with code 75.

Schedulers warn before they take the machines away: SLURM sends SIGTERM on preemption and, with
``--signal``, SIGUSR1 before the time limit; torchrun and Kubernetes pass SIGTERM on. A handler here
only records the signal. ``fit()`` adds the record to the all-reduce of token counts that it makes at
the start of every optimizer step anyway (one more number, no extra collective), so all ranks learn in
the same step that some rank was signalled, whichever got the signal first. They finish that step,
write a checkpoint together and raise :class:`Preempted`, which ends the process with
``PREEMPTED_EXIT_CODE``: the run is incomplete but intact, and ``--resume auto`` continues it exactly.

Exit codes of ``llmtrain pretrain`` / ``finetune_*``: 0 finished, 75 stopped by a signal with a
checkpoint written (resume it), 130 interrupted with Ctrl-C, 1 failed, 2 bad input. A launcher that
spawned the workers ends with 75 when they all did.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator, Optional

PREEMPTED_EXIT_CODE = 75
"""EX_TEMPFAIL from sysexits.h: "temporary failure, try again later"; a checkpoint was written."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """``fit()`` stopped on a signal after writing a checkpoint; the process exits with PREEMPTED_EXIT_CODE."""

    def __init__(self, step: int, signal_name: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.signal_name = signal_name


class StopRequest:
    """What the handlers record: the first stop signal this process received, if any."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def handle(self, signum: int, frame: Any) -> None:
        # NOTE: a second signal changes nothing. SLURM signals every process of a job step and the
        # launcher forwards its own signal too, so a worker often receives the same request twice.
        if self.signum is None:
            self.signum = signum


_request = StopRequest()
_depth = 0


def stop_request() -> StopRequest:
    """This process's stop request (shared by every ``catch_stop_signals`` block)."""
    return _request


@contextlib.contextmanager
def catch_stop_signals() -> Iterator[StopRequest]:
    """Record STOP_SIGNALS instead of dying of them, for the duration of the block.

    The outermost block (``run()``, which starts before the model is built, so an early signal is
    not lost) clears the request and installs the handlers; inner blocks (``fit()``) share them.
    Outside the main thread Python cannot install handlers, and signals keep their default action.
    """
    global _depth
    if _depth > 0:
        _depth += 1
        try:
            yield _request
        finally:
            _depth -= 1
        return
    _request.signum = None
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, _request.handle) for signum in STOP_SIGNALS}
    _depth = 1
    try:
        yield _request
    finally:
        _depth = 0
        for signum, handler in previous.items():
            signal.signal(signum, handler)
