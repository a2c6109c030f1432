"""One writer per out_dir: a run, a resume or ``prepare_data`` holds an exclusive lock on its folder for its whole life.

The lock is a POSIX record lock (``fcntl.lockf``) on ``out_dir/.llmtrain.lock`` (:data:`layout.LOCK_FILE`), which holds
the holder's host, pid and start time for the message a second process prints. What it relies on:

- the kernel (one machine) or the filesystem's lock manager (NFS: the NLM protocol or NFSv4's own locks; GPFS; Lustre
  mounted with ``flock`` or ``localflock``) drops the lock when its process dies, SIGKILL included, so a lock left by a
  dead run never blocks a resume. NFSv4 drops the locks of a node that died as its lease expires (90 s by default).
- a filesystem that takes no locks at all (Lustre mounted without ``flock``, some FUSE mounts) refuses ``lockf``: the run
  then says so once and goes on unlocked, as every run did before.

Under ``--devices N`` the launching process holds it while its workers run; under torchrun or srun, rank 0 (the first
process, :func:`llmtrain.distributed.launch.is_first_process`) holds it for the job. NOTE: a POSIX lock belongs to the
process and is dropped when any of its descriptors of the file is closed, so only :func:`hold` opens it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import socket
import warnings
from pathlib import Path
from typing import Iterator

from llmtrain.checkpoint import layout


class OutDirInUse(ValueError):
    """Another live process holds the out_dir's lock (a ValueError: the CLI prints it in one line and exits 2)."""


@contextlib.contextmanager
def hold(out_dir: Path, flag: str = "--out_dir") -> Iterator[None]:
    """Hold ``out_dir``'s lock for the body; raise :class:`OutDirInUse` at once if another process holds it."""
    import fcntl

    out_dir = Path(out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / layout.LOCK_FILE
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EAGAIN):
                holder = os.pread(descriptor, 512, 0).decode(errors="replace").strip() or "an unknown process"
                raise OutDirInUse(f"{flag} {out_dir} is in use by another llmtrain run ({holder}): wait for it to end "
                                  f"or stop it, or pass another {flag}") from None
            warnings.warn(f"{flag} {out_dir}: this filesystem takes no locks ({os.strerror(error.errno)}), so nothing "
                          "stops a second run from writing into it at the same time; mount it with locking (Lustre: "
                          "-o flock) to have that checked")
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)
        yield
    finally:
        os.close(descriptor)  # drops the lock
        if created:  # a run refused before it wrote anything leaves no folder behind (it found none)
            with contextlib.suppress(OSError):
                if os.listdir(out_dir) == [layout.LOCK_FILE]:
                    path.unlink()
                    out_dir.rmdir()
