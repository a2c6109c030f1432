"""What the checkpoint marker's checksums cost: a TinyLlama-1.1B-shaped step checkpoint saved with and without them,
and the time resume takes to check them.

    .venv/bin/python bench/ab/checksum_cost.py [--model tiny-llama-1.1b] [--rounds 3] [--dir /tmp]

The checkpoint is the full format's step checkpoint of a ``--precision bf16-true`` run (as the checkpointer writes
it): ``model.safetensors`` (the weights, bf16; hashed as it is written, ``files.save_weights_checksummed``) and
``training_state.pt`` (AdamW's two moments per weight, bf16, and the counters; hashed as it is written,
``files.save_checksummed``), then the marker (:func:`llmtrain.checkpoint.files.write_marker`: fsync, sizes, the small
files' checksums) and the rename. The weights and the optimizer state are held whole, as rank 0 holds them.
"without" is the save before checksums: safetensors' own writer, ``torch.save``, and the marker's checksum replaced by
an empty string, so the difference is the hashing alone. Rounds interleave the two; the medians are reported.

Resume's check (:func:`llmtrain.checkpoint.resume.verify_checksums`, one process hashing every file) is timed with
the files in the page cache (right after a save) and out of it (evicted with posix_fadvise DONTNEED, which drops
only these files' pages). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from llmtrain.checkpoint import files, layout
from llmtrain.checkpoint.resume import verify_checksums
from llmtrain.config import Config

DTYPE = torch.bfloat16


def optimizer_state(shapes: dict[str, tuple[int, ...]]) -> dict:
    """AdamW's state for weights of ``shapes``, as ``torch.optim.AdamW.state_dict()`` holds it."""
    state = {index: {"step": torch.tensor(1000.0), "exp_avg": torch.empty(shape, dtype=DTYPE).uniform_(),
                     "exp_avg_sq": torch.empty(shape, dtype=DTYPE).uniform_()}
             for index, shape in enumerate(shapes.values())}
    return {"state": state, "param_groups": [{"lr": 3e-4, "params": list(range(len(shapes)))}]}


def weights(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A random weight of each shape (what the bytes say does not change the cost)."""
    return {name: torch.empty(shape, dtype=DTYPE).uniform_() for name, shape in shapes.items()}


def save(directory: Path, model: dict, optimizer: dict, checksums: bool) -> dict[str, float]:
    """One step checkpoint into ``directory`` (a step-* name), timed in its parts, as Checkpointer.save writes it:
    both files hashed as they are written."""
    tmp = layout.temporary_dir(directory)
    tmp.mkdir(parents=True)
    state = {"step": 1000, "optimizer": optimizer}
    started = time.perf_counter()
    if checksums:
        known = {layout.MODEL_FILE: files.save_weights_checksummed(model, tmp / layout.MODEL_FILE),
                 layout.STATE_FILE: files.save_checksummed(state, tmp / layout.STATE_FILE)}
    else:
        files.save_weights(model, tmp / layout.MODEL_FILE)
        torch.save(state, tmp / layout.STATE_FILE)
        known = {layout.MODEL_FILE: "", layout.STATE_FILE: ""}
    written = time.perf_counter()
    files.write_marker(tmp, {"kind": "training", "format": "full", "step": 1000}, known)
    files.install_dir(tmp, directory)
    done = time.perf_counter()
    return {"save_s": done - started, "tensors_s": written - started, "marker_s": done - written}


def evict(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(function, *args) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama-1.1b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()

    config = Config.from_name(args.model)
    shapes = files.stored_shapes(config)
    numel = sum(torch.Size(shape).numel() for shape in shapes.values())
    model = weights(shapes)
    optimizer = optimizer_state(shapes)
    real_checksum = files.checksum
    results: dict[str, list[dict]] = {"with": [], "without": []}
    verify: dict[str, list[float]] = {"cached": [], "disk": []}
    root = Path(tempfile.mkdtemp(prefix="checksum_cost-", dir=args.dir))
    try:
        for _ in range(args.rounds):
            for variant in ("with", "without"):
                files.checksum = real_checksum if variant == "with" else (lambda path: "")
                directory = root / layout.step_dir_name(1000)
                results[variant].append(save(directory, model, optimizer, variant == "with"))
                if variant == "with":
                    verify["cached"].append(timed(verify_checksums, directory))
                    evict(directory)
                    verify["disk"].append(timed(verify_checksums, directory))
                bytes_written = sum(files.file_sizes(directory).values())
                shutil.rmtree(directory)
    finally:
        files.checksum = real_checksum
        shutil.rmtree(root, ignore_errors=True)

    median = {variant: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
              for variant, rounds in results.items()}
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if line.startswith("Model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    print(f"{args.model}: {numel / 1e9:.2f}B weights, checkpoint {bytes_written / 1e9:.2f} GB, {cpu}, "
          f"{os.cpu_count()} cores, commit {commit}, medians of {args.rounds} interleaved rounds")
    print(f"{'':<22}{'save':>9}{'tensors':>9}{'marker':>9}")
    for variant, row in median.items():
        print(f"{variant + ' checksums':<22}{row['save_s']:>8.1f}s{row['tensors_s']:>8.1f}s{row['marker_s']:>8.1f}s")
    cost = median["with"]["save_s"] - median["without"]["save_s"]
    print(f"checksum cost: {cost:+.1f}s ({cost / median['without']['save_s']:+.1%} of a save)")
    print(f"resume's check: {statistics.median(verify['cached']):.1f}s from the page cache, "
          f"{statistics.median(verify['disk']):.1f}s from disk")
    print(json.dumps({"script": "checksum_cost", "model": args.model, "bytes": bytes_written, "cpu": cpu,
                      "commit": commit, "rounds": results, "verify": verify}))


if __name__ == "__main__":
    main()
