"""The hyperparameters a run records (``hyperparameters.yaml``) launch the same run again through ``--config``."""

from __future__ import annotations

import torch
import yaml

from llmtrain.cli import run_cli
from llmtrain.optim import build_optimizer
from llmtrain.recipes import prepare as prepare_module


class ThresholdSGD(torch.optim.SGD):
    """SGD with an argument it keeps outside ``defaults``, as bitsandbytes' 8-bit optimizers keep min_8bit_size."""

    def __init__(self, params, lr: float = 0.01, min_size: int = 4096) -> None:
        super().__init__(params, lr=lr)
        self.min_size = min_size


def launched_spec(argv: list[str], monkeypatch):
    launched = []
    monkeypatch.setattr(prepare_module, "launch", lambda fn, args, **kw: launched.append(args[0]))
    run_cli(argv)
    return launched[0]


def test_an_optimizer_argument_outside_its_defaults_is_recorded_and_launches_again(tmp_path, monkeypatch):
    spec = launched_spec(["pretrain", "llama-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                          "--optimizer", f"{__name__}.ThresholdSGD", "--optimizer.lr", "0.1",
                          "--optimizer.min_size", "16"], monkeypatch)
    recorded = spec.hyperparameters["optimizer"]
    assert recorded["init_args"] == {"lr": 0.1, "min_size": 16}

    saved = tmp_path / "hyperparameters.yaml"
    saved.write_text(yaml.safe_dump(spec.hyperparameters, sort_keys=False))
    again = launched_spec(["pretrain", "--config", str(saved)], monkeypatch)
    optimizer = build_optimizer(again.optimizer, [torch.nn.Parameter(torch.zeros(1))])
    assert (type(optimizer), optimizer.defaults["lr"], optimizer.min_size) == (ThresholdSGD, 0.1, 16)


def test_the_kernel_choice_is_recorded_as_given_not_as_this_device_made_it(tmp_path, monkeypatch):
    """AdamW runs fused where it can (build_optimizer's choice): the record leaves that choice to the device
    it is launched on again, and keeps what the command line said."""
    flags = ["pretrain", "llama-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1"]
    chosen = launched_spec(flags, monkeypatch).hyperparameters["optimizer"]["init_args"]
    assert (chosen["fused"], chosen["foreach"]) == (None, None)
    assert build_optimizer(launched_spec(flags, monkeypatch).optimizer,
                           [torch.nn.Parameter(torch.zeros(1))]).defaults["fused"] is True  # it did run fused
    given = launched_spec([*flags, "--optimizer.foreach", "true"], monkeypatch).hyperparameters["optimizer"]
    assert (given["init_args"]["fused"], given["init_args"]["foreach"]) == (None, True)
