"""`llmtrain.plot.plot` turns a run's metrics.csv into a readable PNG, and names the file when it cannot."""

import csv
import math
from pathlib import Path

import pytest

from llmtrain.plot import plot
from llmtrain.train.loggers import METRICS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_metrics(out_dir: Path, steps: int = 40, val_every: int = 10, tokens_per_step: int = 4096) -> Path:
    """A metrics.csv shaped like the training loop's: training rows, and validation rows of their own."""
    rows = [{"step": 0, "tokens": 0, "val_loss": 8.4, "val_ppl": math.exp(8.4)}]
    for step in range(1, steps + 1):
        loss = 8.0 * math.exp(-step / 15) + 0.5
        rows.append({"step": step, "tokens": step * tokens_per_step, "epoch": step / 100, "loss": loss,
                     "lr": 3e-3 * min(1.0, step / 5), "grad_norm": 1.0, "tokens_per_sec": 6800 + 10 * step,
                     "tokens_per_sec_per_device": 6800 + 10 * step, "mfu": "", "peak_memory_gb": 0.5,
                     "elapsed_s": step * 0.6})
        if step % val_every == 0:
            rows.append({"step": step, "tokens": step * tokens_per_step, "val_loss": loss + 0.1,
                         "val_ppl": math.exp(loss + 0.1)})
    path = out_dir / "metrics.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=METRICS)
        writer.writeheader()
        writer.writerows({key: row.get(key, "") for key in METRICS} for row in rows)
    return path


def test_plot_writes_a_png_next_to_the_metrics(tmp_path):
    write_metrics(tmp_path)
    output = plot(tmp_path)
    assert output == tmp_path / "metrics.png"
    data = output.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000

    from matplotlib.image import imread

    image = imread(output)
    height, width = image.shape[:2]
    assert width >= 600 and height >= 600
    assert image[..., :3].std() > 0.05  # lines and labels, not a blank canvas


def test_plot_to_a_chosen_file(tmp_path):
    write_metrics(tmp_path)
    target = tmp_path / "plots" / "run.png"
    assert plot(tmp_path, output=target) == target
    assert target.read_bytes().startswith(PNG_SIGNATURE)


def test_plot_a_run_without_validation(tmp_path):
    path = write_metrics(tmp_path, steps=5, val_every=10**6)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + lines[2:]) + "\n")  # drop the step-0 validation row too
    assert plot(tmp_path).read_bytes().startswith(PNG_SIGNATURE)


def test_missing_metrics_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "metrics.csv")):
        plot(tmp_path)


@pytest.mark.parametrize("content", ["", ",".join(METRICS) + "\n"], ids=["empty", "header-only"])
def test_empty_metrics_names_the_file(tmp_path, content):
    (tmp_path / "metrics.csv").write_text(content)
    with pytest.raises(ValueError, match="metrics.csv"):
        plot(tmp_path)
    assert not (tmp_path / "metrics.png").exists()


def test_plot_to_a_name_without_a_suffix_writes_that_file(tmp_path):
    write_metrics(tmp_path)
    target = tmp_path / "run"
    assert plot(tmp_path, output=target) == target
    assert target.read_bytes().startswith(PNG_SIGNATURE)
    assert not (tmp_path / "run.png").exists()


def test_plot_refuses_an_image_format_it_cannot_write_naming_the_flag(tmp_path):
    write_metrics(tmp_path)
    with pytest.raises(ValueError, match=r"--output .*run\.txt: cannot write a \.txt image"):
        plot(tmp_path, output=tmp_path / "run.txt")
    assert not (tmp_path / "run.txt").exists()


def test_an_interrupted_plot_leaves_the_previous_image_whole(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    write_metrics(tmp_path)
    previous = plot(tmp_path).read_bytes()

    def fails_halfway(self, target, **kwargs):
        target.write(PNG_SIGNATURE) if hasattr(target, "write") else Path(target).write_bytes(PNG_SIGNATURE)
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", fails_halfway)
    with pytest.raises(KeyboardInterrupt):
        plot(tmp_path)
    assert (tmp_path / "metrics.png").read_bytes() == previous
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.csv", "metrics.png"]
