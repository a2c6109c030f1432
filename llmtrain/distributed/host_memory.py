"""Host memory for training on the CPU: keep freed blocks for reuse instead of handing them back to the kernel.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves a request of 32 MiB or more (less,
after its dynamic threshold moves) with a fresh ``mmap`` and unmaps it again on ``free``: the next tensor of that
size starts on untouched pages, and the kernel faults in and zeroes every 4 KiB page on first write. A training
step allocates and frees the same large tensors every step (activations, the loss chunk's logits, gradients),
so it pays that again and again: copying a 32 MiB tensor took 11 ms with glibc's defaults and 2 ms with blocks
reused, on the 2-core box of BENCHMARKS.md ("Host memory: the lever that paid").

:func:`keep_freed_host_memory` raises glibc's mmap threshold and trim threshold to their limit (2 GiB - 1), so
that such blocks come from the heap and go back to it, the way a GPU's caching allocator keeps its blocks. The
resident set then stays near its peak for the rest of the run, which is what a training run reaches every step
anyway. Other C libraries (musl, macOS) are left alone. ``LLMTRAIN_HOST_MALLOC=default`` keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

HOST_MALLOC_ENV = "LLMTRAIN_HOST_MALLOC"
"""``default`` keeps glibc's allocator settings; unset (or ``keep``), training on the CPU keeps freed blocks."""

# glibc's mallopt parameters (malloc.h) and the largest value its int argument takes.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD = 2**31 - 1

_applied = False


def keep_freed_host_memory() -> bool:
    """Make glibc keep freed blocks of any size below 2 GiB in its heap for reuse; True if it now does.

    Idempotent, and a no-op (False) off glibc or with ``LLMTRAIN_HOST_MALLOC=default``.
    """
    global _applied
    if _applied:
        return True
    choice = os.environ.get(HOST_MALLOC_ENV, "keep")
    if choice not in ("keep", "default"):
        raise ValueError(f"{HOST_MALLOC_ENV}={choice!r}: use 'keep' (the default: reuse freed host memory) or "
                         "'default' (glibc's own settings)")
    if choice == "default" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # NOTE: trim first: setting either threshold turns off glibc's dynamic adjustment of both.
    _applied = bool(libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD)) and bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD))
    return _applied
