"""Between log steps a training step reads nothing from the device: no tensor becomes a Python number."""

import math

import torch

import faults

from tiny_fit import train_tiny


def test_fused_adamw_steps_read_nothing_from_the_device_between_log_steps(monkeypatch):
    """Every conversion of a tensor to Python is counted by the step it falls in; only log steps may have any.

    A NaN at step 2 is skipped on the device and reported at step 4 (the next log step) with its number,
    and the weights end where the host-decided skip of a foreach AdamW puts them.
    """
    from llmtrain.train import loop, nonfinite
    from llmtrain.train.schedule import WarmupDecaySchedule

    nan_at_step_2 = faults.NanLoss([2])
    reference, _ = train_tiny({"foreach": True})
    with faults.installed(nan_at_step_2):
        loop.fit(reference)
    job, rows = train_tiny({"fused": True})
    assert nonfinite._skips_on_device(job.optimizer, None) and not nonfinite._skips_on_device(reference.optimizer, None)

    reads = {}  # step being trained -> conversions counted
    current = [0]
    real_set_step = WarmupDecaySchedule.set_step

    def set_step(self, step):
        current[0] = step + 1
        return real_set_step(self, step)

    monkeypatch.setattr(WarmupDecaySchedule, "set_step", set_step)
    for name in ("item", "cpu", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, **kwargs):
            reads[current[0]] = reads.get(current[0], 0) + 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    with faults.installed(nan_at_step_2):
        loop.fit(job)
    monkeypatch.undo()

    assert [step for step in range(1, 9) if reads.get(step)] == [4, 8], reads
    assert [(row["step"], math.isnan(row["grad_norm"])) for row in rows.rows if row.get("skipped")] == [(2, True)]
    assert [row["step"] for row in rows.rows if "loss" in row] == [4, 8]
    assert all(0 <= row["data_wait_fraction"] < 1 for row in rows.rows if "loss" in row)
    assert job.optimizer.state[next(iter(job.model.parameters()))]["step"] == 7  # the skipped step is not counted
    for fused, foreach in zip(job.model.parameters(), reference.model.parameters()):
        assert torch.allclose(fused, foreach, rtol=1e-4, atol=1e-5)
