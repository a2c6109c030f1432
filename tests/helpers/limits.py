"""A hard time limit for tests that wait on other processes."""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator


@contextlib.contextmanager
def hard_limit(seconds: int, what: str) -> Iterator[None]:
    """Raise TimeoutError in this (main) thread when ``seconds`` have passed, whatever the code waits on."""
    def expire(signum, frame):
        raise TimeoutError(f"{what} exceeded its hard limit of {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
