#!/usr/bin/env python
"""Where a training run makes the host wait for the GPU: each synchronizing CUDA call, by the Python line that made it.

    python bench/ab/cuda_syncs.py pretrain pythia-160m --accelerator cuda --train.max_steps 12 ...

runs the ``llmtrain`` command given, with torch's sync debug mode on, and prints each distinct Python call site
(the innermost llmtrain frames) that synchronized, with how often. A host that waits on the device each step
cannot queue the next kernels ahead, so a small model's step becomes the sum of its launches: this names the
waits to remove. Needs a CUDA device.
"""

from __future__ import annotations

import collections
import sys
import traceback
import warnings


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device is visible; torch's sync debug mode only watches CUDA calls", file=sys.stderr)
        return 2
    sites: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return original(message, category, filename, lineno, file, line)
        frames = [frame for frame in traceback.extract_stack()[:-1] if "llmtrain" in frame.filename
                  and "cuda_syncs" not in frame.filename]
        site = " <- ".join(f"{frame.filename.split('llmtrain/')[-1]}:{frame.lineno} {frame.name}"
                           for frame in reversed(frames[-3:]))
        sites[(str(message).split(".")[0], site or f"{filename}:{lineno}")] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    from llmtrain.__main__ import main as llmtrain_main

    sys.argv = ["llmtrain", *sys.argv[1:]]
    code = 0
    try:
        llmtrain_main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
        print("\n| synchronizing calls | what | call site (innermost first) |\n| --- | --- | --- |")
        for (what, site), count in sites.most_common():
            print(f"| {count} | {what} | `{site}` |")
    return code


if __name__ == "__main__":
    sys.exit(main())
