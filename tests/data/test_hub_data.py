"""Data modules that read the Hugging Face Hub, when it cannot be reached: one line naming the flag and what to do
instead, at once (not after huggingface_hub's 25 s of retries). The offline cases (HF_HUB_OFFLINE=1) run as real
command lines in tests/recipes/test_bad_inputs.py."""

from __future__ import annotations

import time

import pytest

from llmtrain.cli import main
from llmtrain.data import Alpaca, HFDataset
from llmtrain.errors import told_status
from llmtrain.hub import HubError

from conftest import free_port_number, write_tiny_model

HANG_GUARD_S = 120


@pytest.fixture
def closed_hub(monkeypatch):
    """HF_ENDPOINT at a port of 127.0.0.1 where nothing listens, and no offline variable."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port_number()}")


@pytest.mark.parametrize("module, says", [
    (Alpaca(), ["--data Alpaca", "yahma/alpaca-cleaned", "--data.path"]),
    (HFDataset(path="no-org/no-dataset"), ["--data.path no-org/no-dataset", "--data.data_files"]),
], ids=["Alpaca", "HFDataset"])
def test_an_unreachable_hub_is_one_line_at_once(closed_hub, module, says):
    started = time.monotonic()
    with pytest.raises(HubError) as refused:
        module.validate()  # in the launching process, before any worker, model or tokenizer
    assert time.monotonic() - started < HANG_GUARD_S
    message = str(refused.value)
    assert "\n" not in message and told_status(refused.value) == 2
    for text in ["could not reach the Hugging Face Hub", "Connection refused", "HF_HUB_OFFLINE=1", *says]:
        assert text in message, message


def test_a_local_copy_never_asks_the_hub(closed_hub, tmp_path):
    copy = tmp_path / "alpaca.json"
    copy.write_text('[{"instruction": "a", "input": "", "output": "b"}]')
    Alpaca(path=str(copy)).validate()
    HFDataset(path="json", data_files=str(copy)).validate()


def test_pretraining_on_an_unreachable_hub_dataset_stops_before_the_run(closed_hub, tmp_path, tiny_tokenizer):
    tokenizer = tiny_tokenizer(["a b c d e f g"] * 20, vocab_size=300)
    with pytest.raises(HubError, match="--data.path no-org/no-dataset: could not reach"):
        main(["pretrain", "--model_config", str(write_tiny_model(tmp_path / "tiny.yaml")), "--tokenizer_dir",
              str(tokenizer.checkpoint_dir), "--data", "HFDataset", "--data.path", "no-org/no-dataset",
              "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1"])
    assert not (tmp_path / "out").exists()
