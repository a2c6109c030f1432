"""Every metrics sink carries the CSV's names and values; the console is a bar on a terminal and plain
lines in batch logs."""

import contextlib
import csv
import fcntl
import os
import pty
import signal
import struct
import sys
import termios
import threading
from pathlib import Path

import pytest

from llmtrain.cli import main

from conftest import write_tiny_model


@pytest.fixture(autouse=True)
def shared_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "shared-cache"))


def tiny_run(tmp_path: Path, out_dir: Path, *extra: str) -> list[str]:
    model_file = write_tiny_model(tmp_path / "tiny.yaml")
    return ["pretrain", "--model_config", str(model_file), "--out_dir", str(out_dir), "--data", "BuiltinStories",
            "--data.num_documents", "300", "--data.num_val_documents", "20", "--train.global_batch_size", "4",
            "--train.micro_batch_size", "2", "--train.max_seq_length", "32", "--eval.interval", "3",
            "--eval.max_iters", "1", *extra]


def csv_rows(out_dir: Path) -> list[dict]:
    with open(out_dir / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def csv_series(out_dir: Path) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    for row in csv_rows(out_dir):
        for key, value in row.items():
            if key != "step" and value != "":
                series.setdefault(key, {})[int(row["step"])] = float(value)
    return series


def wandb_history(run_file: Path) -> dict[str, dict[int, float]]:
    """The history records of an offline .wandb file: a 7-byte W&B header, then LevelDB-log records
    (32 KiB blocks; 7-byte record headers: crc, length, type) holding protobuf Records."""
    import json

    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    position, pending, payloads = 7, b"", []
    while position + 7 <= len(data):
        room = 32768 - position % 32768
        if room < 7:  # a block's tail too short for a header is padding
            position += room
            continue
        length, kind = struct.unpack("<HB", data[position + 4:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            payloads.append(pending)
            pending = b""
    series: dict[str, dict[int, float]] = {}
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = int(items.get("_step", record.history.step.num))
        for key, value in items.items():
            if not key.startswith("_"):
                series.setdefault(key, {})[step] = float(value)
    return series


def test_wandb_offline_logs_the_csv_metrics_under_the_same_names(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is llmtrain's default
    out_dir = tmp_path / "run"
    main(tiny_run(tmp_path, out_dir, "--train.max_steps", "4", "--train.log_interval", "1", "--logger_name", "wandb"))
    run_files = list((out_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    logged = wandb_history(run_files[0])
    expected = csv_series(out_dir)
    assert set(logged) == set(expected)
    assert {"loss", "lr", "val_loss", "tokens_per_sec"} <= set(logged)
    for key, values in expected.items():
        assert logged[key] == pytest.approx(values, rel=1e-5), key


def wandb_service_pids() -> list[int]:
    """This process's wandb-core children (the service that writes the .wandb file)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            name, rest = stat.read_text().rsplit(")", 1)
            if name.endswith("(wandb-core") and int(rest.split()[1]) == os.getpid():
                pids.append(int(stat.parent.name))
    return pids


def test_wandb_run_file_is_complete_when_the_logger_closes(tmp_path, monkeypatch):
    """The service gets no CPU for a second once the run is finished, as on a loaded machine: the run file
    must not wait for it to catch up after close()."""
    from wandb.sdk.lib.service.service_connection import ServiceConnection

    from llmtrain.train.loggers import WandbLogger

    inform_finish = ServiceConnection.inform_finish

    def starved(self, run_id):  # the last message of run.finish(); the service writes the file when it handles it
        pids = wandb_service_pids()
        assert pids, "no wandb-core child to starve"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        threading.Timer(1.0, lambda: [os.kill(pid, signal.SIGCONT) for pid in pids]).start()
        inform_finish(self, run_id)

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(ServiceConnection, "inform_finish", starved)
    logger = WandbLogger(tmp_path / "run")
    for step in (1, 2, 3):
        logger.log({"step": step, "loss": 1.0 / step, "lr": 0.1 * step})
    logger.close()
    run_files = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    assert wandb_history(run_files[0]) == {"loss": {1: 1.0, 2: 0.5, 3: pytest.approx(1 / 3)},
                                           "lr": {1: 0.1, 2: 0.2, 3: pytest.approx(0.3)}}


def test_tensorboard_scalars_have_the_csv_names_and_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out_dir = tmp_path / "run"
    main(tiny_run(tmp_path, out_dir, "--train.max_steps", "4", "--train.log_interval", "2",
                  "--logger_name", "tensorboard"))
    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()
    logged = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    expected = csv_series(out_dir)
    assert set(logged) == set(expected)
    for key, values in expected.items():
        assert logged[key] == pytest.approx(values, rel=1e-5), key


def test_batch_logs_get_one_line_per_log_interval(tmp_path, capfd):
    """In this process: its stdout and stderr are pytest's capture, files as in a batch job's log."""
    out_dir = tmp_path / "run"
    main(tiny_run(tmp_path, out_dir, "--train.max_steps", "6", "--train.log_interval", "2", "--eval.interval", "100"))
    out, err = capfd.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("step ") and "| loss " in line]
    assert [line.split()[1] for line in lines] == ["2", "4", "6"]
    assert all("tokens/s" in line and "eta" in line for line in lines)
    assert "\r" not in out + err  # no bar redraws in a log file


def test_a_terminal_gets_a_progress_bar_with_loss_speed_and_eta(tmp_path):
    """In this process, its stdout and stderr a pseudo-terminal's (what llmtrain asks of a terminal: isatty, and
    its size for the bar), read as it comes."""
    out_dir = tmp_path / "run"
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 40 rows, 160 columns
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # the terminal closed
                break
            if not chunk:
                break
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with open(terminal, "w", buffering=1, closefd=False) as screen, pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stdout", screen)
        patch.setattr(sys, "stderr", screen)
        main(tiny_run(tmp_path, out_dir, "--train.max_steps", "6", "--train.log_interval", "2",
                      "--eval.interval", "100"))
        screen.flush()
    os.close(terminal)
    reader.join(timeout=60)
    os.close(controller)
    text = b"".join(chunks).decode(errors="replace")
    assert "\r" in text  # the bar redraws in place
    final = text.split("\r")[-1] if "6/6" not in text else text[text.rindex("6/6"):]
    assert "6/6" in text and "loss=" in final and "tok/s=" in final
    assert "<" in final  # tqdm's elapsed<remaining: the ETA
    assert not [line for line in text.splitlines() if line.startswith("step 2 | loss")]  # no plain lines
