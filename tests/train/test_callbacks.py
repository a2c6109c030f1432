"""Callbacks: installed in-process or named in LLMTRAIN_CALLBACKS, called in order, errors that say what to fix."""

import pytest
import torch

import faults
from llmtrain import callbacks


class Doubles(callbacks.Callback):
    def on_loss(self, step, loss):
        return loss * 2


class AddOne(callbacks.Callback):
    def on_loss(self, step, loss):
        return loss + 1


ADD_ONE = AddOne()  # an instance is installed as it is; a class is called


def test_hooks_run_in_order_and_on_loss_chains():
    hooks = callbacks.Callbacks([Doubles(), ADD_ONE])
    assert hooks.on_loss(1, torch.tensor(3.0)).item() == 7.0
    assert callbacks.Callbacks([]).on_loss(1, loss := torch.tensor(3.0)) is loss  # nothing installed: the same tensor


def test_registered_then_environment_callbacks_are_active(monkeypatch):
    monkeypatch.setenv(callbacks.CALLBACKS_ENV, f"{__name__}:Doubles, {__name__}:ADD_ONE")
    first = callbacks.register(Doubles())
    try:
        active = callbacks.active().callbacks
        assert active[0] is first and isinstance(active[1], Doubles) and active[2] is ADD_ONE
    finally:
        callbacks.unregister(first)
    assert len(callbacks.active().callbacks) == 2


def test_the_fault_environment_builds_the_faults(monkeypatch):
    for name, value in faults.environment(nan_steps=[3, 4], crash_before_step=7).items():
        monkeypatch.setenv(name, value)
    (installed,) = callbacks.active().callbacks
    kinds = {type(fault): fault for fault in installed.callbacks}
    assert kinds[faults.NanLoss].steps == {3, 4} and kinds[faults.CrashBeforeStep].step == 7


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "'no_colon' is not module:attribute"),
    ("no_such_module_here:X", "cannot load 'no_such_module_here:X'"),
    (f"{__name__}:missing", f"cannot load '{__name__}:missing'"),
])
def test_a_bad_entry_names_itself(monkeypatch, spec, message):
    monkeypatch.setenv(callbacks.CALLBACKS_ENV, spec)
    with pytest.raises(ValueError, match=message):
        callbacks.active()


def test_what_is_not_a_callback_is_refused(monkeypatch):
    monkeypatch.setenv(callbacks.CALLBACKS_ENV, "collections:OrderedDict")
    with pytest.raises(TypeError, match="not a llmtrain.callbacks.Callback"):
        callbacks.active()
    with pytest.raises(TypeError, match="subclass it"):
        callbacks.register(object())
