"""``llmtrain plot``: draw a run's metrics.csv (loss, learning rate, throughput) into one PNG.

Only matplotlib's Agg canvas is used, so plotting works on a machine without a display and never
changes the pyplot backend of the process that calls it.
"""

from __future__ import annotations

import csv
import io
import os
import math
from pathlib import Path
from typing import Optional

METRICS_FILE = "metrics.csv"
PLOT_FILE = "metrics.png"


def plot(out_dir: Path, output: Optional[Path] = None) -> Path:
    """Plot a run's training and validation loss, learning rate and throughput against the step.

    Reads `OUT_DIR/metrics.csv` (written by pretrain and the finetune recipes) and draws three rows that
    share the step axis; the top axis of the first row counts training tokens.

    Args:
        out_dir: The run's output directory, the one that holds metrics.csv.
        output: Where to write the PNG (a name ending in .svg or .pdf writes that format). Default:
            OUT_DIR/metrics.png.
    """
    out_dir = Path(out_dir)
    output = Path(output) if output is not None else out_dir / PLOT_FILE
    image_format = _image_format(output)
    columns = read_metrics(out_dir / METRICS_FILE)
    output.parent.mkdir(parents=True, exist_ok=True)

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(9, 10), layout="constrained")
    FigureCanvasAgg(figure)  # attaches itself to the figure: savefig renders with Agg
    loss_ax, lr_ax, speed_ax = figure.subplots(3, 1, sharex=True)
    figure.suptitle(f"{out_dir.resolve().name}: {METRICS_FILE}")

    train_steps, train_loss = _series(columns, "loss")
    val_steps, val_loss = _series(columns, "val_loss")
    if train_steps:
        loss_ax.plot(train_steps, train_loss, label="training loss", color="tab:blue", linewidth=1)
    if val_steps:
        loss_ax.plot(val_steps, val_loss, label="validation loss", color="tab:orange", marker="o", markersize=3)
    loss_ax.set_ylabel("loss")
    loss_ax.grid(alpha=0.3)
    if train_steps or val_steps:
        loss_ax.legend(loc="upper right")
    _add_token_axis(loss_ax, columns)

    lr_steps, lr = _series(columns, "lr")
    lr_ax.plot(lr_steps, lr, color="tab:green", linewidth=1)
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    lr_ax.grid(alpha=0.3)

    speed_steps, speed = _series(columns, "tokens_per_sec")
    speed_ax.plot(speed_steps, speed, color="tab:red", linewidth=1)
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_xlabel("optimizer step")
    speed_ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # shared by all three rows
    speed_ax.set_ylim(bottom=0)
    speed_ax.grid(alpha=0.3)

    image = io.BytesIO()
    figure.savefig(image, dpi=100, format=image_format)
    # An interrupted plot leaves the previous image, not half of one.
    temp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    temp.write_bytes(image.getvalue())
    os.replace(temp, output)
    print(f"plotted {out_dir / METRICS_FILE} into {output}")
    return output


def _image_format(output: Path) -> str:
    """The format ``output``'s suffix names; PNG for a name without one. NOTE: the format is passed to savefig
    explicitly, which otherwise writes a name without a suffix to NAME.png, not to the file it was given."""
    from matplotlib.backend_bases import FigureCanvasBase

    image_format = output.suffix.lstrip(".").lower() or "png"
    if image_format not in FigureCanvasBase.get_supported_filetypes():
        raise ValueError(f"--output {output}: cannot write a .{image_format} image; name a .png file "
                         "(or .svg, .pdf)")
    return image_format


def read_metrics(path: Path) -> dict[str, list[Optional[float]]]:
    """metrics.csv as columns of floats (None where a row left the cell empty). Raises naming the file
    when it is missing, empty or has no step column."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass the out_dir of a training run (it writes {METRICS_FILE})")
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
        names = reader.fieldnames or []
    if "step" not in names:
        raise ValueError(f"{path} is empty or has no 'step' column; it is not a llmtrain {METRICS_FILE}")
    if not rows:
        raise ValueError(f"{path} has a header but no rows yet: plot again once the run has logged a step")
    return {name: [_number(row.get(name)) for row in rows] for name in names}


def _number(cell: Optional[str]) -> Optional[float]:
    if cell is None or cell.strip() == "":
        return None
    try:
        value = float(cell)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _series(columns: dict[str, list[Optional[float]]], name: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows where both are present."""
    pairs = [(s, v) for s, v in zip(columns["step"], columns.get(name, [])) if s is not None and v is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _add_token_axis(ax, columns: dict[str, list[Optional[float]]]) -> None:
    """A top axis in training tokens, interpolated from the (step, tokens) pairs of the log."""
    steps, tokens = _series(columns, "tokens")
    pairs = sorted(dict(zip(steps, tokens)).items())
    if len(pairs) < 2 or pairs[-1][1] <= pairs[0][1]:
        return
    import numpy as np

    step_points = np.array([p[0] for p in pairs])
    token_points = np.array([p[1] for p in pairs])
    if np.any(np.diff(token_points) < 0):  # not monotone (a hand-edited file): no axis rather than a wrong one
        return
    top = ax.secondary_xaxis(
        "top",
        functions=(lambda s: _extrapolated(s, step_points, token_points),
                   lambda t: _extrapolated(t, token_points, step_points)),
    )
    top.set_xlabel("training tokens")
    top.xaxis.set_major_formatter(_token_formatter())


def _extrapolated(x, xp, fp):
    """np.interp inside the data, and linear beyond it (the axis margins), along the overall slope."""
    import numpy as np

    x = np.asarray(x, dtype=float)
    slope = (fp[-1] - fp[0]) / (xp[-1] - xp[0])
    inside = np.interp(x, xp, fp)
    return np.where(x < xp[0], fp[0] + (x - xp[0]) * slope,
                    np.where(x > xp[-1], fp[-1] + (x - xp[-1]) * slope, inside))


def _token_formatter():
    from matplotlib.ticker import FuncFormatter

    def short(value: float, _position: int) -> str:
        for limit, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
            if abs(value) >= limit:
                return f"{value / limit:g}{suffix}"
        return f"{value:g}"

    return FuncFormatter(short)
