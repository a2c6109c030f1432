"""What SLURM's variables say about a job step: its tasks per node, its node list, where its tasks meet.

Pure reading, no side effects: :func:`llmtrain.distributed.launch.plan_launch` decides the launch path from it.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import zlib
from typing import Mapping, Optional


def first_int(env: Mapping[str, str], *names: str) -> Optional[int]:
    """The first of ``names`` that ``env`` sets, as a number; None when it sets none."""
    for name in names:
        if env.get(name):
            return int(env[name])
    return None


def tasks_per_node(env: Mapping[str, str], num_tasks: int, num_nodes: int) -> list[int]:
    """The tasks of the step on each node, as SLURM gives them, else spread over the nodes."""
    compact = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if compact:
        return parse_tasks_per_node(compact)
    if num_tasks % num_nodes:
        return [num_tasks // num_nodes + 1, num_tasks // num_nodes]  # uneven, reported as such
    return [num_tasks // num_nodes] * num_nodes


def parse_tasks_per_node(compact: str) -> list[int]:
    """SLURM's ``2(x3),1`` → [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in compact.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ValueError(f"cannot read SLURM's tasks per node {compact!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand SLURM's compact host list the way ``scontrol show hostnames`` does.

    ``node[1-3,5]`` → node1 node2 node3 node5; ``gpu-[01-02]`` → gpu-01 gpu-02 (zero padding kept);
    ``a1,b2`` → a1 b2; several bracket groups in one name multiply out.
    """
    hosts: list[str] = []
    for item in _split_outside_brackets(nodelist):
        hosts += _expand_host(item, nodelist)
    if not hosts:
        raise ValueError(f"the SLURM node list {nodelist!r} names no host")
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_host(pattern: str, nodelist: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern:
            raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    hosts = []
    for part in match.group(1).split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"cannot read the range [{match.group(1)}] in the SLURM node list {nodelist!r}")
        numbers = range(int(low), int(high) + 1) if dash else [int(low)]
        for number in numbers:
            hosts += [head + str(number).zfill(len(low)) + rest for rest in _expand_host(tail, nodelist)]
    return hosts


def slurm_first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``scontrol show hostnames`` where it exists, else our parser."""
    if not nodelist:
        raise ValueError("inside srun, but SLURM_JOB_NODELIST is not set; export MASTER_ADDR=<host of the first node>")
    scontrol = shutil.which("scontrol")
    if scontrol:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            hosts = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                   timeout=10, check=True).stdout.split()
            if hosts:
                return hosts[0]
    return expand_hostlist(nodelist)[0]


def slurm_master_port(job_id: str, step_id: str) -> int:
    """A port every task of one job step derives alike, in 10000-29999 (below Linux's ephemeral ports)."""
    return 10000 + zlib.crc32(f"{job_id}.{step_id}".encode()) % 20000
