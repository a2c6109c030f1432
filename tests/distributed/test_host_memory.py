"""Training on the CPU keeps freed host blocks for reuse (llmtrain.distributed.host_memory).

glibc serves a large request with its own mmap, unmapped again on free, unless its mmap threshold is above it;
``mallinfo2().hblkhd`` counts the bytes held in such mappings. Each case runs in a fresh interpreter:
the settings are the process's for good.
"""

import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator settings")

PROBE = textwrap.dedent("""
    import ctypes, os, sys
    import torch
    from llmtrain.distributed.runtime import Runtime, configure_process
    from llmtrain.precision import Precision

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    configure_process(Runtime(device=torch.device(sys.argv[1])), Precision("32-true"))
    mapped = libc.mallinfo2().hblkhd
    tensor = torch.empty(64 * 2**20, dtype=torch.uint8)  # 64 MiB: above glibc's default threshold (32 MiB at most)
    tensor.fill_(1)
    print((libc.mallinfo2().hblkhd - mapped) // 2**20)
""")


def mapped_mib(device: str, env: dict) -> int:
    import os

    done = subprocess.run([sys.executable, "-c", PROBE, device], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_cpu_training_takes_large_tensors_from_the_heap():
    assert mapped_mib("cpu", {}) == 0


def test_glibc_defaults_map_large_tensors_on_their_own():
    # The control: the same tensor under glibc's defaults is a mapping of its own, so the test above can fail.
    assert mapped_mib("cpu", {"LLMTRAIN_HOST_MALLOC": "default"}) >= 64
    assert mapped_mib("meta", {}) >= 64  # a run whose tensors are not on the CPU keeps glibc's settings


def test_bad_setting_names_the_variable():
    from llmtrain.distributed import host_memory

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMTRAIN_HOST_MALLOC", "jemalloc")
        patch.setattr(host_memory, "_applied", False)
        with pytest.raises(ValueError, match="LLMTRAIN_HOST_MALLOC='jemalloc': use 'keep'"):
            host_memory.keep_freed_host_memory()
