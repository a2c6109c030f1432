"""A smoke test of launching: every rank meets the others, all-reduces its rank and reports.

    python -m llmtrain.distributed._selftest --devices 2 --out /tmp/selftest
    torchrun --nproc_per_node 2 -m llmtrain.distributed._selftest --devices 2 --out /tmp/selftest
    srun --nodes 2 --ntasks-per-node 1 python -m llmtrain.distributed._selftest --devices 4 --num_nodes 2 --out DIR

Each rank writes ``rank-<r>.json`` to ``--out`` (on several nodes, a folder they all see); rank 0
prints one line. ``--behaviour raise`` makes the last rank fail (``refuse``: with an input error, told in one
line by llmtrain.errors) and ``sleep`` keeps every rank
waiting until it gets USR1, to check failure reports, interruption and signal forwarding.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Literal, Optional, Sequence

Behaviour = Literal["ok", "raise", "refuse", "sleep"]


def check_rank(out_dir: str, behaviour: Behaviour = "ok", accelerator: str = "auto") -> None:
    """One rank's work: meet, all-reduce the ranks, write a record, then misbehave if asked to."""
    import torch

    from llmtrain.distributed.runtime import Runtime

    usr1: list[int] = []
    if behaviour == "sleep":  # listen before the record below tells anyone that this rank is up
        signal.signal(signal.SIGUSR1, lambda signum, frame: usr1.append(signum))
    runtime = Runtime.from_env(accelerator)
    rank_sum = runtime.all_reduce(torch.tensor([float(runtime.rank)], device=runtime.device)).item()
    record = {"rank": runtime.rank, "world_size": runtime.world_size, "local_rank": runtime.local_rank,
              "local_world_size": runtime.local_world_size, "rank_sum": rank_sum, "pid": os.getpid(),
              "ppid": os.getppid(), "host": socket.gethostname(), "device": str(runtime.device)}
    path = Path(out_dir) / f"rank-{runtime.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(record))
    path.with_suffix(".tmp").rename(path)
    print(f"selftest: rank {runtime.rank} of {runtime.world_size} ok, sum of ranks {rank_sum:g}", flush=True)
    if behaviour == "raise" and runtime.rank == runtime.world_size - 1:
        raise RuntimeError(f"selftest failure raised on purpose by rank {runtime.rank}")
    if behaviour == "refuse" and runtime.rank == runtime.world_size - 1:
        raise ValueError(f"--behaviour refuse: rank {runtime.rank} refuses its input on purpose")
    if behaviour == "sleep":  # as a long run would; on USR1 leave a marker and return, as fit() stops on it
        deadline = time.monotonic() + 300
        while not usr1 and time.monotonic() < deadline:
            time.sleep(0.05)
        if usr1:
            path.with_name(f"usr1-{runtime.rank}").touch()


def main(argv: Optional[Sequence[str]] = None) -> None:
    from llmtrain.distributed.launch import launch
    from llmtrain.distributed.supervise import WorkerFailedError

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1, help="processes per node")
    parser.add_argument("--num_nodes", type=int, default=1, help="nodes")
    parser.add_argument("--out", required=True, help="folder for the per-rank records")
    parser.add_argument("--behaviour", choices=["ok", "raise", "refuse", "sleep"], default="ok")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--rdzv_timeout", type=float, default=None,
                        help="seconds the processes wait to meet (default: launch's, $LLMTRAIN_RDZV_TIMEOUT or 900)")
    args = parser.parse_args(argv)
    try:
        launch(check_rank, (args.out, args.behaviour, args.accelerator), devices=args.devices,
               num_nodes=args.num_nodes, rdzv_timeout_s=args.rdzv_timeout)
    except WorkerFailedError as error:  # as llmtrain's command line ends: an unexpected error's traceback is out
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_status)


if __name__ == "__main__":
    # Run through the imported module so that check_rank pickles as llmtrain.distributed._selftest.check_rank.
    from llmtrain.distributed import _selftest

    _selftest.main()
