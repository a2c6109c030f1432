"""Callbacks: code from outside llmtrain that watches or perturbs a run at fixed points.

A callback subclasses :class:`Callback` and overrides the hooks it needs; the others do nothing.
Install one for this process with :func:`register`, or for every process of a run (spawned workers,
torchrun, srun, a subprocess) by naming it in the environment::

    LLMTRAIN_CALLBACKS="mypackage.hooks:Timer,othermodule:make_watchdog"

Each entry is ``module:attribute``; the attribute is a callback, or a callable without arguments
(a class, a factory) that returns one. The module must be importable by the training processes
(installed, or on their PYTHONPATH). Entries are imported whenever :func:`active` is called, so a
factory may read its settings from the environment of that moment.

``fit()`` asks :func:`active` once, before its first step. With none installed, a hook is one Python
call that returns at once: nothing reaches the device, nothing is read back from it.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch

CALLBACKS_ENV = "LLMTRAIN_CALLBACKS"


class Callback:
    """The hooks, in the order a run meets them. Every rank calls them; ``job.runtime`` says which rank this is."""

    def on_fit_start(self, job: Any) -> None:
        """``fit()`` is about to train: ``job`` is its :class:`~llmtrain.train.loop.Fit` (runtime, arguments, state)."""

    def on_step_start(self, step: int) -> None:
        """Optimizer step ``step`` (counted from 1, across resumes) is about to fetch its micro-batches."""

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss of one micro-batch of step ``step``, scaled for the step, before its backward; returns the
        loss to differentiate instead."""
        return loss

    def on_step_end(self, step: int) -> None:
        """Optimizer step ``step`` is done, with the log line, validation and checkpoint that fall on it."""

    def on_checkpoint_written(self, directory: Path) -> None:
        """A checkpoint's files are in ``directory``, under its temporary name and without the marker that
        makes it count: a crash here must leave no checkpoint that resume would take."""

    def on_fit_end(self) -> None:
        """``fit()`` is over: it returned, or it is raising (a stop signal, a failure)."""


class Callbacks(Callback):
    """Several callbacks behind one: each hook calls theirs in order (for ``on_loss``, each on the last's result)."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = list(callbacks)

    def on_fit_start(self, job: Any) -> None:
        for callback in self.callbacks:
            callback.on_fit_start(job)

    def on_step_start(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_step_start(step)

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        for callback in self.callbacks:
            loss = callback.on_loss(step, loss)
        return loss

    def on_step_end(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_step_end(step)

    def on_checkpoint_written(self, directory: Path) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint_written(directory)

    def on_fit_end(self) -> None:
        for callback in self.callbacks:
            callback.on_fit_end()


_registered: list[Callback] = []


def register(callback: Callback) -> Callback:
    """Install ``callback`` in this process (until :func:`unregister`); returns it."""
    if not isinstance(callback, Callback):
        raise TypeError(f"{callback!r} is not a llmtrain.callbacks.Callback; subclass it")
    _registered.append(callback)
    return callback


def unregister(callback: Callback) -> None:
    """Remove a callback that :func:`register` installed."""
    _registered.remove(callback)


def active(*own: Callback) -> Callbacks:
    """A run's ``own`` callbacks (its profiler), then those installed now: registered in this process, then
    named in ``$LLMTRAIN_CALLBACKS``."""
    return Callbacks([*own, *_registered, *from_env(os.environ.get(CALLBACKS_ENV, ""))])


def from_env(spec: str) -> list[Callback]:
    """The callbacks named by ``spec``, a comma-separated list of ``module:attribute`` (see the module doc)."""
    found = []
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        module_name, _, attribute = entry.partition(":")
        if not module_name or not attribute:
            raise ValueError(f"{CALLBACKS_ENV}={spec!r}: {entry!r} is not module:attribute "
                             "(e.g. mypackage.hooks:Timer)")
        try:
            target = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"{CALLBACKS_ENV}={spec!r}: cannot load {entry!r} ({error}); is the module on "
                             "the PYTHONPATH of every training process?") from error
        callback = target if isinstance(target, Callback) else target()
        if not isinstance(callback, Callback):
            raise TypeError(f"{CALLBACKS_ENV}: {entry!r} gave {callback!r}, not a llmtrain.callbacks.Callback")
        found.append(callback)
    return found
