"""Which errors are told in one line and with what exit status: one rule for ``llmtrain.cli.main`` and for the
workers of a launched run (``llmtrain.distributed.supervise``), so that an input error found by a rank reads as it
would in a single process.

A told error's message says what is wrong and what to do; its traceback would only hide that. ``--debug``
(``DEBUG_ENV`` in the workers) shows the traceback anyway.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

USER_ERRORS = (ValueError, OSError)
"""Errors that mean "this input is wrong" (OSError covers missing files, permissions and disk space): exit 2."""

DEBUG_ENV = "LLMTRAIN_DEBUG"
"""Set to 1 by ``llmtrain --debug``; the workers it launches inherit it and print tracebacks."""


def told_status(error: BaseException) -> Optional[int]:
    """The exit status of an error told in one line (2 for an input error, or the ``exit_status`` its class
    declares, as a run that stopped itself with a reason does), or None for an error that deserves its traceback."""
    status = getattr(error, "exit_status", None)
    if isinstance(status, int):
        return status
    return 2 if isinstance(error, USER_ERRORS) else None


def debugging() -> bool:
    """Whether ``--debug`` asked for tracebacks."""
    return os.environ.get(DEBUG_ENV) == "1"


def close_matches(given: str, choices: Sequence[str], n: int = 3) -> list[str]:
    """The choices ``given`` most likely meant, for a "did you mean ...?": the same name in another case alone, else
    the choices it begins, then those difflib finds alike (case ignored)."""
    import difflib

    lowered = {choice.lower(): choice for choice in reversed(list(choices))}
    key = given.lower()
    if key in lowered:
        return [lowered[key]]
    found = [choice for choice in choices if len(key) >= 3 and choice.lower().startswith(key)]
    found += [lowered[close] for close in difflib.get_close_matches(key, list(lowered), n=n, cutoff=0.6)]
    return list(dict.fromkeys(found))[:n]
