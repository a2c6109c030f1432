"""Shared fixtures: free ports and a clean environment for multi-process tests."""

from __future__ import annotations

import os
import socket
from typing import Callable

import pytest

# Variables by which a launcher tells a process who it is; a test that starts processes must not
# pass on those of the shell it runs in (torchrun, srun), or the children would believe them.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "LLMTRAIN_")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Call it for a port that is free on 127.0.0.1 right now (a new one each call)."""
    return _free_port


@pytest.fixture
def dist_env() -> dict[str, str]:
    """An environment for child processes: no launcher variables, gloo on loopback, one thread each."""
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCHER_VARS and not name.startswith(LAUNCHER_PREFIXES)}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


@pytest.fixture
def clean_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's own environment without launcher variables, for in-process launch tests."""
    for name in list(os.environ):
        if name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
