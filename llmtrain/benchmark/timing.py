"""Step-time statistics of a benchmark run, from its metrics.csv and the wait for each batch."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional


def _step_timing(rows: list[dict], waits: list[float], warmup: int, save_interval: Optional[int] = None,
                 micro_batches_per_step: int = 1) -> dict:
    """Step-time statistics of the steps after ``warmup``, and the share of their time spent waiting for data.

    Step k's time is the loop's elapsed time at its log row minus that at the row before (a step whose
    update was skipped logs no row: the gap is shared out); each step fetches ``micro_batches_per_step``
    batches (the accumulation steps, also the micro-batches of a pipeline), so step k's are the ``next()``
    calls after the first (k - 1) × that many. With ``save_interval``, a checkpoint is
    written after every step k that it divides, so step k + 1's time holds the save's stall: those steps
    are left out of the statistics, and ``checkpoint_stall_s`` is their median time minus the others'.
    """
    timed, times, previous = [], {}, {"step": 0, "elapsed_s": 0.0}
    for row in sorted(rows, key=lambda row: row["step"]):
        if row["step"] > warmup:
            timed.append(row)
            gap = row["step"] - previous["step"]
            for step in range(previous["step"] + 1, row["step"] + 1):
                times[step] = (row["elapsed_s"] - previous["elapsed_s"]) / gap
        previous = row
    if not times or len(waits) < timed[-1]["step"] * micro_batches_per_step:
        raise RuntimeError(f"the benchmark run logged {len(times)} timed steps and {len(waits)} batch "
                           f"fetches; expected one row and {micro_batches_per_step} fetch(es) per step")
    after_save = {step for step in times if save_interval and (step - 1) % save_interval == 0 and step > 1}
    step_times = [time for step, time in times.items() if step not in after_save] or list(times.values())
    stalls = [times[step] for step in sorted(after_save)]
    quartiles = statistics.quantiles(step_times, n=4, method="inclusive") if len(step_times) > 1 else step_times * 3
    logged = [row["data_wait_fraction"] for row in timed if row["data_wait_fraction"] is not None]
    median = statistics.median(step_times)
    return {
        "step_time_median_s": median, "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times), "step_time_p25_s": quartiles[0], "step_time_p75_s": quartiles[2],
        "data_wait_fraction": sum(waits[warmup * micro_batches_per_step:timed[-1]["step"] * micro_batches_per_step])
                              / sum(times.values()),
        # The loop's own measure of the same wait, when its metrics have the column; a cross-check.
        "data_wait_fraction_logged": statistics.mean(logged) if logged else None,
        "peak_memory_gb": max(row["peak_memory_gb"] for row in timed),
        "checkpoint_saves": len(stalls),
        "checkpoint_stall_s": statistics.median(stalls) - median if stalls else None,
        "checkpoint_stall_max_s": max(stalls) - median if stalls else None,
    }


def _train_rows(path: Path) -> list[dict]:
    """The training rows of metrics.csv (validation rows have no loss)."""
    import csv

    with open(path) as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("loss")]

    def number(row: dict, key: str) -> Optional[float]:
        return float(row[key]) if row.get(key) not in (None, "") else None

    return [{"step": int(row["step"]), "elapsed_s": number(row, "elapsed_s"),
             "peak_memory_gb": number(row, "peak_memory_gb") or 0.0,
             "data_wait_fraction": number(row, "data_wait_fraction")} for row in rows]
