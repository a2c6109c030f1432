"""Whether a model fits the memory it will live in, checked from its config before anything is allocated.

A model_config.yaml with ``n_layer: 1000000000`` would otherwise be built (even on the meta device, a Python
object per layer) until the kernel kills the process, and ``block_size: 1e12`` would end in an allocator
traceback from the RoPE tables. The counts are analytic (llmtrain.flops), so the check costs nothing; it refuses
only what cannot fit at all, not what would merely be tight: activations and the allocator's slack are left out.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

from llmtrain.config import Config
from llmtrain.flops import num_parameters

GiB = 2**30
ROPE_TABLES = 3
"""float32 (block_size, rope_n_elem) tables alive at once while the RoPE cache is built: cos, sin and their angles."""
CGROUP_MEMORY = Path("/sys/fs/cgroup")
"""Where a container's memory limit (cgroup v2: memory.max, memory.current) is, which /proc/meminfo does not show."""


class ModelTooLargeError(ValueError):
    """A model's config asks for more memory than the device it would be built on has."""


def rope_cache_bytes(config: Config) -> int:
    """Bytes of the RoPE tables at their peak while built: they have block_size rows, whatever the sequence length."""
    return ROPE_TABLES * config.block_size * config.rope_n_elem * 4


def host_available_bytes() -> int:
    """Memory this process can still take: MemAvailable, or less under a container's (cgroup v2) limit."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:  # not Linux: free pages
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = (CGROUP_MEMORY / "memory.max").read_text().strip()
        used = int((CGROUP_MEMORY / "memory.current").read_text())
    except (OSError, ValueError):
        return available
    return available if limit == "max" else min(available, int(limit) - used)


def device_available_bytes(device: Any) -> tuple[int, str]:
    """Free memory of ``device`` and what to call it: a GPU's (torch.cuda.mem_get_info), else the host's."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"GPU {device}"
    return host_available_bytes(), "this machine's memory"


CONFIG_FIX = ("check n_layer, n_embd, intermediate_size, vocab_size and block_size in it, or run on a device with more "
              "memory")


def check_fits(config: Config, *, needed: int, available: int, where: str, source: Union[str, Path],
               fix: str = CONFIG_FIX) -> None:
    """Refuse, in one line naming ``source`` (the config's file or flag), the sizes and ``fix``, when ``needed``
    bytes exceed ``available`` on ``where`` (e.g. "this machine's memory", "GPU cuda:0")."""
    if needed <= available:
        return
    rope = rope_cache_bytes(config)
    because = (f"block_size {config.block_size} alone needs {rope / GiB:,.1f} GiB of RoPE tables"
               if rope > available else f"{num_parameters(config):,} parameters")
    raise ModelTooLargeError(
        f"{source}: the model is too large for {where}: it needs at least {needed / GiB:,.1f} GiB ({because}), and "
        f"{available / GiB:,.1f} GiB are available; {fix}")


def check_model_fits(config: Config, *, weight_bytes: float, device: Any, source: Union[str, Path]) -> None:
    """The whole model, ``weight_bytes`` of weights and its RoPE tables, against ``device``'s free memory: what
    generate, chat, merge_lora and a QLoRA base build before they load weights."""
    available, where = device_available_bytes(device)
    check_fits(config, needed=int(weight_bytes) + rope_cache_bytes(config), available=available, where=where,
               source=source)
