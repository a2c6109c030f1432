"""Where metrics go: a CSV file always, TensorBoard or Weights & Biases on request, and the console.

One vocabulary for every sink (see METRICS). Only rank 0 builds loggers.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Literal, Optional, Sequence

LoggerName = Literal["csv", "tensorboard", "wandb"]

# The columns of metrics.csv, in order. TensorBoard and W&B use the same names, and only these.
METRICS = ("step", "tokens", "epoch", "loss", "lr", "grad_norm", "tokens_per_sec",
           "tokens_per_sec_per_device", "mfu", "peak_memory_gb", "val_loss", "val_ppl", "elapsed_s",
           "skipped", "data_wait_fraction", "reserved_memory_gb", "alloc_retries")
DATA_PREFIX = "data/"
"""Metrics the data module adds (a mixture's ``data/tokens/<source>``): columns after METRICS in a run that has them."""
MOE_PREFIX = "moe/"
"""A mixture of experts' balance (:mod:`llmtrain.train.experts`): columns after METRICS in an MoE run."""


class CSVLogger:
    """Appends rows to ``out_dir/metrics.csv``; on resume, rows after the resumed step are dropped."""

    def __init__(self, out_dir: Path, resume_step: Optional[int] = None, data_columns: Sequence[str] = ()) -> None:
        self.path = Path(out_dir) / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns = (*METRICS, *data_columns)
        rows = self._read_rows() if self.path.exists() else []
        if resume_step is not None:
            rows = [row for row in rows if int(float(row["step"])) <= resume_step]
        else:
            rows = []  # a fresh run starts a fresh file
        with open(self.path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(rows)

    def _read_rows(self) -> list[dict]:
        with open(self.path, newline="") as handle:
            reader = csv.DictReader(handle)
            if reader.fieldnames is None or "step" not in reader.fieldnames:
                return []
            return [{k: row.get(k, "") for k in self.columns} for row in reader]

    def log(self, metrics: dict) -> None:
        row = {key: _format(metrics.get(key)) for key in self.columns}
        with open(self.path, "a", newline="") as handle:
            csv.DictWriter(handle, fieldnames=self.columns).writerow(row)

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Scalars under the same names as the CSV columns, against the optimizer step."""

    def __init__(self, out_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"))

    def log(self, metrics: dict) -> None:
        step = int(metrics["step"])
        for key, value in _numbers(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run in ``out_dir/wandb``, the CSV's names against the optimizer step.

    Offline unless the environment says otherwise (WANDB_MODE=online), so nothing leaves the machine by
    default; `wandb sync out_dir/wandb/offline-run-*` uploads a run later.
    """

    def __init__(self, out_dir: Path, hyperparameters: Optional[dict] = None) -> None:
        import os

        import wandb

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "llmtrain"), name=out_dir.name, dir=str(out_dir),
                              config=hyperparameters or {}, mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, metrics: dict) -> None:
        self.run.log(_numbers(metrics), step=int(metrics["step"]))

    def close(self) -> None:
        import wandb

        self.run.finish()
        # NOTE: finish() returns before wandb's service has written the run's .wandb file: the service keeps
        # the records in memory until it closes the run, on its own time, and the one wait for it is wandb's
        # atexit hook (which a worker's os._exit skips). On a loaded machine a reader of out_dir right after
        # close() found the header and no records; teardown returns once the service has closed the run.
        wandb.teardown()


def _numbers(metrics: dict) -> dict:
    """The metrics with a numeric value, under their METRICS (or data module's) names (the step is the x axis)."""
    return {key: value for key, value in metrics.items()
            if (key in METRICS or key.startswith((DATA_PREFIX, MOE_PREFIX))) and key != "step"
            and isinstance(value, (int, float)) and not isinstance(value, bool)}


def _format(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


class Console:
    """A tqdm progress bar on a terminal; one plain line per log interval otherwise (batch logs)."""

    def __init__(self, total_steps: int, initial_step: int = 0, enabled: bool = True,
                 use_bar: Optional[bool] = None) -> None:
        self.enabled = enabled
        self.use_bar = enabled and (sys.stderr.isatty() if use_bar is None else use_bar)
        self.bar = None
        if self.use_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def advance(self, steps_done: int) -> None:
        """Move the bar every step (cheap: no metrics, no device sync)."""
        if self.bar is not None:
            self.bar.update(steps_done - self.bar.n)

    def update(self, metrics: dict, steps_done: int) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(steps_done - self.bar.n)
            post = {"loss": f"{metrics['loss']:.4f}", "tok/s": f"{metrics['tokens_per_sec']:.0f}"}
            if metrics.get("mfu") is not None:
                post["mfu"] = f"{100 * metrics['mfu']:.1f}%"
            self.bar.set_postfix(post, refresh=True)
        else:
            self.print(format_line(metrics))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_line(metrics: dict) -> str:
    parts = [f"step {metrics['step']}", f"loss {metrics['loss']:.4f}", f"lr {metrics['lr']:.3e}",
             f"grad_norm {metrics['grad_norm']:.3f}", f"tokens/s {metrics['tokens_per_sec']:.0f}"]
    if metrics.get("mfu") is not None:
        parts.append(f"mfu {100 * metrics['mfu']:.1f}%")
    if metrics.get(f"{MOE_PREFIX}aux_loss") is not None:  # a mixture of experts: its worst layer's balance
        parts.append(f"aux_loss {metrics[f'{MOE_PREFIX}aux_loss']:.4f}")
        if metrics.get(f"{MOE_PREFIX}z_loss") is not None:
            parts.append(f"z_loss {metrics[f'{MOE_PREFIX}z_loss']:.4f}")
        parts.append(f"load max/mean {metrics[f'{MOE_PREFIX}load_max_over_mean']:.3f} (layer "
                     f"{metrics[f'{MOE_PREFIX}load_worst_layer']}) | dropped {100 * metrics[f'{MOE_PREFIX}dropped_share']:.1f}%")
    parts.append(f"peak_mem {metrics['peak_memory_gb']:.2f}GB")
    if metrics.get("reserved_memory_gb") is not None:
        parts.append(f"reserved {metrics['reserved_memory_gb']:.2f}GB")
    if metrics.get("alloc_retries"):
        parts.append(f"alloc_retries {metrics['alloc_retries']}")
    if metrics.get("eta_s") is not None:
        parts.append(f"eta {format_seconds(metrics['eta_s'])}")
    return " | ".join(parts)


def format_seconds(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def build_loggers(name: str, out_dir: Path, resume_step: Optional[int], hyperparameters: Optional[dict] = None,
                  data_columns: Sequence[str] = ()) -> list:
    """The CSV logger, and the one ``name`` asks for; ``data_columns`` are the metrics besides METRICS: the data
    module's (DATA_PREFIX) and a mixture of experts' (MOE_PREFIX)."""
    loggers: list = [CSVLogger(out_dir, resume_step, data_columns)]
    if name == "tensorboard":
        loggers.append(TensorBoardLogger(out_dir))
    elif name == "wandb":
        loggers.append(WandbLogger(out_dir, hyperparameters))
    elif name != "csv":
        raise ValueError(f"--logger_name {name!r} must be csv, tensorboard or wandb")
    return loggers
