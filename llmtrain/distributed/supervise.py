"""Spawn and supervise the workers of a run, and run one rank's share as a worker: how a launched process ends.

:func:`llmtrain.distributed.launch.launch` decides the path; this module carries it out. :func:`spawn_workers`
starts a node's workers with torch's elastic launcher, forwards the stop signals to them, and turns their
failures into one message and an exit status (2 for an input error a rank found, 75 when they stopped on a
signal after a checkpoint, 130 on Ctrl-C). :func:`run_as_worker` runs inside every rank: it records a failure
where the launcher reads it, tears the process group down and ends the process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn, Optional

from llmtrain.distributed.runtime import (RDZV_TIMEOUT_ENV, host_barrier, leave_in_order, ranks_that_never_arrived,
                                         report_failure)
from llmtrain.errors import debugging, told_status
from llmtrain.signals import PREEMPTED_EXIT_CODE

if TYPE_CHECKING:
    from llmtrain.distributed.launch import LaunchPlan

ALL_RANKS_PRINT_ENV = "LLMTRAIN_ALL_RANKS_PRINT"
"""Set to 1 to let every rank write to stdout; by default only rank 0 does (stderr stays open on all)."""


_SPAWNED_ENV = "LLMTRAIN_SPAWNED"  # marks workers started by this module: their launcher reports their errors


_TOLD_KEY = "llmtrain_told"  # in a worker's error file: the exit status of an error told in one line, or null


# The first lines a spawned worker runs: take the parent's import path, then load and run the call.
_WORKER_BOOT = ("import json, sys; sys.path[:0] = json.load(open(sys.argv[1])); "
                "from llmtrain.distributed.supervise import _worker_main; _worker_main(sys.argv[2])")


_in_worker = False  # True inside run_as_worker: a nested launch() just calls its entrypoint


# NOTE: elastic turns these signals into "stop the workers" (killing them after 30 s). SIGTERM is left
# out: _forward_signals_to_workers passes it on, so the workers can checkpoint and exit with 75.
_ELASTIC_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


class WorkerFailedError(RuntimeError):
    """A spawned worker failed; the message names the first rank that failed and its error."""

    def __init__(self, message: str, exit_status: int = 1) -> None:
        super().__init__(message)
        self.exit_status = exit_status
        """That rank's exit status: 2 for an input error it found (llmtrain.errors), else 1."""


# --------------------------------------------------------------------------------------------------
# Spawning workers with torch's elastic launcher


def spawn_workers(plan: "LaunchPlan", entrypoint: Callable[..., None], args: tuple, kwargs: dict,
                  rdzv_timeout_s: float) -> None:
    """Start ``plan.devices`` workers on this node and wait for them; the nodes meet at ``plan.master_addr``.

    NOTE: the workers are ``python -c`` subprocesses rather than elastic's function mode, because a
    worker must be free to end with ``os._exit`` (see :func:`run_as_worker`), and a function-mode
    worker that does so never hands its result back to the launcher.
    """
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    call = _pickle_call(entrypoint, args, kwargs, plan.devices)
    port = plan.master_port or free_port(plan.master_addr)
    where = f"{plan.master_addr}:{port}"
    with tempfile.TemporaryDirectory(prefix="llmtrain-launch-") as tmp:
        path_file, call_file = os.path.join(tmp, "sys_path.json"), os.path.join(tmp, "call.pkl")
        with open(path_file, "w") as f:
            json.dump([entry for entry in sys.path if entry], f)
        with open(call_file, "wb") as f:
            f.write(call)
        config = _launch_config(plan, where, rdzv_timeout_s, log_dir=os.path.join(tmp, "logs"))
        try:
            with _patched_environ(_worker_env(plan, rdzv_timeout_s)), _quiet_elastic_logs(), \
                    _forward_signals_to_workers():
                elastic_launch(config, sys.executable)("-u", "-c", _WORKER_BOOT, path_file, call_file)
        except ChildFailedError as err:
            raise _workers_failed(err, plan.world_size) from None
        except SignalException as err:
            print(f"llmtrain: got {err.sigval.name}; stopped the workers", file=sys.stderr, flush=True)
            raise SystemExit(128 + int(err.sigval)) from None
        except DistError as err:
            raise _no_meeting(err, plan, where, rdzv_timeout_s) from None


def _launch_config(plan: "LaunchPlan", where: str, rdzv_timeout_s: float, log_dir: str) -> Any:
    """The elastic launcher's settings: this node's workers, the nodes' static meeting at ``where``, no restarts."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    config = LaunchConfig(
        min_nodes=plan.num_nodes, max_nodes=plan.num_nodes, nproc_per_node=plan.devices,
        run_id=plan.run_id or f"llmtrain-{uuid.uuid4().hex[:12]}", rdzv_backend="static",
        rdzv_endpoint=where, rdzv_configs={"rank": plan.node_rank, "timeout": max(1, math.ceil(rdzv_timeout_s))},
        max_restarts=0, logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        local_addr=plan.master_addr if plan.num_nodes == 1 else None)
    if hasattr(config, "signals_to_handle"):  # torch >= 2.7 sets the variable from this field
        config.signals_to_handle = _ELASTIC_SIGNALS
    return config


def _worker_env(plan: "LaunchPlan", rdzv_timeout_s: float) -> dict[str, str]:
    """The variables the workers start with, besides the launcher's own."""
    worker_env = {RDZV_TIMEOUT_ENV: str(rdzv_timeout_s), _SPAWNED_ENV: "1",
                  "TORCHELASTIC_SIGNALS_TO_HANDLE": _ELASTIC_SIGNALS}
    if "OMP_NUM_THREADS" not in os.environ:
        # NOTE: each worker would otherwise start one OpenMP thread per core of the machine, and
        # `devices` workers would fight over the cores; torchrun sets 1, a fair share is better on CPU.
        worker_env["OMP_NUM_THREADS"] = str(max(1, _usable_cores() // plan.devices))
    return worker_env


def _workers_failed(err: Any, world_size: int) -> BaseException:
    """What the launcher raises when workers ended with a non-zero status: exit 130 when Ctrl-C stopped them all,
    75 when they all stopped on a signal after a checkpoint, else the first failure (:func:`_report_failures`)."""
    if all(failure.exitcode == 130 for failure in err.failures.values()):  # Ctrl-C reached them first
        print("llmtrain: interrupted; the workers stopped", file=sys.stderr, flush=True)
        return SystemExit(130)
    if all(failure.exitcode == PREEMPTED_EXIT_CODE for failure in err.failures.values()):
        _ignore_late_stop_signals()
        print("llmtrain: the workers stopped on a signal after writing a checkpoint; resume with "
              "--resume auto", file=sys.stderr, flush=True)
        return SystemExit(PREEMPTED_EXIT_CODE)
    return _report_failures(err, world_size)


def _no_meeting(err: Exception, plan: "LaunchPlan", where: str, rdzv_timeout_s: float) -> RuntimeError:
    """The error for a meeting point that could not be opened (one node) or that not every node reached."""
    if plan.num_nodes == 1:
        return RuntimeError(f"could not open the meeting point {where} for the {plan.devices} workers "
                            f"({str(err).strip()}); another process may have taken the port")
    return RuntimeError(
        f"node {plan.node_rank} of {plan.num_nodes}: the nodes did not all meet at {where} within "
        f"{rdzv_timeout_s:g}s ({str(err).strip()}). Check that one task was started on every node "
        f"(srun --nodes {plan.num_nodes} --ntasks-per-node 1) and that {plan.master_addr} is "
        "reachable from each")


@contextlib.contextmanager
def _forward_signals_to_workers() -> Iterator[None]:
    """Pass TERM, USR1 and USR2 on to the workers while they run, and keep waiting for them.

    NOTE: srun hands USR1 (the time limit is near: checkpoint and stop) to every task, and SLURM or a
    user sends TERM on preemption. With one task per node that task is this launcher: USR1's default
    action would kill it and orphan the workers, and elastic's TERM handling would stop the workers
    and end with 143. Forwarded, TERM and USR1 make the workers checkpoint and exit with 75, which
    this launcher then exits with too. Elastic still passes INT, HUP and QUIT on as it stops the workers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        for pid in _child_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    forwarded = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    previous = {signum: signal.signal(signum, forward) for signum in forwarded}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _child_pids() -> list[int]:
    """This process's children (the workers the elastic agent started), read from /proc (Linux)."""
    me, children = os.getpid(), []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (command)": state, ppid, ...
            except (OSError, IndexError):
                continue
            if int(fields[1]) == me:
                children.append(int(entry))
    return children


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may run on, not all the machine's
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _pickle_call(entrypoint: Callable[..., None], args: tuple, kwargs: dict, devices: int) -> bytes:
    name = getattr(entrypoint, "__qualname__", repr(entrypoint))
    if getattr(entrypoint, "__module__", None) == "__main__":
        raise ValueError(f"launch() starts {devices} fresh interpreters that import {name} by name, but it is "
                         "defined in the __main__ script; move it into an importable module")
    try:
        return pickle.dumps((entrypoint, tuple(args), kwargs))
    except Exception as err:
        raise ValueError(
            f"launch() pickles {name} and its arguments to start {devices} workers, and that failed ({err}). "
            "Pass a module-level function and plain data (numbers, strings, paths, dataclasses), not lambdas, "
            "open files or built models") from err


@contextlib.contextmanager
def _patched_environ(updates: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    """The elastic agent narrates shutdowns and failures (naming whichever worker it polled first); we
    report the first failure ourselves, so only its crashes (CRITICAL) pass."""
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _report_failures(err: Any, world_size: int) -> WorkerFailedError:
    """The error that tells the first failure; print its traceback and one line per other failure first, unless
    it is told in one line (an input error a rank found, llmtrain.errors): then the returned error says it all."""
    failures = sorted(err.failures.items(), key=lambda item: _failure_order(item[1]))
    (rank, first), others = failures[0], failures[1:]
    message, callstack = _failure_text(first)
    told = first.error_file_data.get(_TOLD_KEY) if isinstance(first.error_file_data, dict) else None
    if isinstance(told, int) and not debugging():
        return WorkerFailedError(f"rank {rank} of {world_size}: {message}", exit_status=told)
    lines = [f"llmtrain: rank {rank} of {world_size} failed (exit code {first.exitcode}): {message}"]
    if callstack:
        lines.append(callstack.rstrip())
    for other, failure in others:
        lines.append(f"llmtrain: rank {other} also stopped: {_shorten(_failure_text(failure)[0])}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return WorkerFailedError(f"rank {rank} of {world_size} failed: {message}")


def _shorten(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _failure_order(failure: Any) -> tuple[bool, float]:
    """Sort key for "who failed first": workers the launcher stopped with SIGTERM after the first
    failure come last; then time, sub-second where our workers recorded it (elastic's is whole seconds)."""
    stopped_by_launcher = failure.exitcode == -signal.SIGTERM
    return stopped_by_launcher, float(failure.error_file_data.get("llmtrain_time", failure.timestamp))


def _failure_text(failure: Any) -> tuple[str, str]:
    if isinstance(failure.message, dict):
        extra = failure.message.get("extraInfo", {})
        return str(failure.message.get("message", "")), str(extra.get("py_callstack", ""))
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}", ""
    if not failure.error_file_data.get("message"):
        return f"exited with code {failure.exitcode} without an error report (see its output above)", ""
    return str(failure.message), ""


def in_worker() -> bool:
    """This process runs a rank's share (inside :func:`run_as_worker`): a nested launch just calls its entrypoint."""
    return _in_worker


# --------------------------------------------------------------------------------------------------
# Inside a worker


def run_as_worker(entrypoint: Callable[..., None], args: tuple = (), kwargs: Optional[dict] = None) -> NoReturn:
    """Run one rank's share of the job, then end the process: barrier, destroy the group, flush, ``os._exit``.

    NOTE: with gloo, an interpreter that shuts down normally after training can abort
    ("terminate called without an active exception") while tearing the process group down; an
    orderly teardown followed by ``os._exit`` avoids it. Exit status: 0 on success, 1 on an exception
    (recorded in TORCHELASTIC_ERROR_FILE for the launcher), 130 on Ctrl-C, 75 when training stopped
    on SIGTERM or SIGUSR1 after writing a checkpoint (llmtrain.signals).
    """
    global _in_worker
    _in_worker = True
    rank = os.environ.get("RANK", "0")
    if rank != "0" and os.environ.get(ALL_RANKS_PRINT_ENV) != "1":
        sys.stdout.flush()
        sys.stdout = open(os.devnull, "w")
    try:
        try:
            entrypoint(*args, **(kwargs or {}))
        except SystemExit as exc:
            if _exit_status(exc) != 0:
                raise
        _close_process_group()
        status = 0
    except KeyboardInterrupt:
        print(f"[rank {rank}] interrupted", file=sys.stderr)
        status = 130
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(f"[rank {rank}] {exc.code}", file=sys.stderr)
        status = _exit_status(exc)
        if status == PREEMPTED_EXIT_CODE:
            _ignore_late_stop_signals()
    except BaseException as exc:  # noqa: BLE001  (every failure must reach the launcher)
        exc = _naming_hung_ranks(exc)
        _record_failure(exc, rank)
        status = told_status(exc) or 1
    _flush_std()
    os._exit(status)


class CollectiveTimeoutError(RuntimeError):
    """A collective waited --dist_timeout for ranks that never came; the message names them. Exit 1, in one line:
    the cause is on those ranks, and this rank's traceback shows only where it waited."""

    exit_status = 1


_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
"""What gloo's ("Timed out waiting 20000ms for recv operation") and NCCL's ("collective operation timeout") say."""


def _naming_hung_ranks(exc: BaseException) -> BaseException:
    """A collective's timeout, with the ranks that never arrived named (:func:`ranks_that_never_arrived`)."""
    if not isinstance(exc, RuntimeError) or not _TIMED_OUT.search(str(exc)):
        return exc
    hung = ranks_that_never_arrived()
    if not hung:
        return exc
    ranks = f"rank {hung[0]}" if len(hung) == 1 else "ranks " + ", ".join(map(str, hung[:16])) + (
        f" and {len(hung) - 16} more" if len(hung) > 16 else "")
    error = CollectiveTimeoutError(
        f"{ranks} never reached the collective the other ranks waited in for --dist_timeout: "
        f"{'it is' if len(hung) == 1 else 'they are'} hung or stopped (look at {ranks}'s process and host), or in host "
        f"work that takes longer than --dist_timeout (then raise it). The timeout: {' '.join(str(exc).split())}")
    error.__cause__ = exc
    return error


def _ignore_late_stop_signals() -> None:
    """After a clean stop on a signal only the exit remains; a late TERM must not turn 75 into 143.

    NOTE: the ranks leave at almost the same moment, and srun's --kill-on-bad-exit (75 is not 0) or
    the elastic agent then sends TERM to the ones still on their way out.
    """
    with contextlib.suppress(ValueError):  # outside the main thread, handlers cannot change
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_IGN)


def _worker_main(call_file: str) -> NoReturn:
    """The body of a spawned worker: load the pickled call, then run it as a rank."""
    try:
        with open(call_file, "rb") as f:
            entrypoint, args, kwargs = pickle.load(f)
    except BaseException as exc:  # noqa: BLE001
        _record_failure(exc, os.environ.get("RANK", "?"))
        _flush_std()
        os._exit(1)
    run_as_worker(entrypoint, args, kwargs)


def _close_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        host_barrier()  # rank 0 may still be closing its loggers (a W&B upload): host work, off the device
        dist.destroy_process_group()
        leave_in_order()  # rank 0 may host the store that the others' barrier read


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def _record_failure(exc: BaseException, rank: str) -> None:
    """Write the error where the elastic launcher looks for it; print it unless our launcher will (in one line if
    it is an error told so, llmtrain.errors)."""
    callstack = traceback.format_exc()
    recorded = write_error_file(exc, callstack)
    report_failure(f"rank {rank} failed: {type(exc).__name__}: {exc}")  # after the record: the others fail later
    if recorded and os.environ.get(_SPAWNED_ENV) == "1":
        return
    if told_status(exc) is not None and not debugging():
        sys.stderr.write(f"[rank {rank}] error: {exc}\n")
    else:
        sys.stderr.write(f"[rank {rank}] {callstack}")


def write_error_file(exc: BaseException, callstack: str) -> bool:
    """Record ``exc`` in TORCHELASTIC_ERROR_FILE (the format of torch's ErrorHandler) if there is one."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    now = time.time()
    told = told_status(exc)
    report = {"message": {"message": str(exc) if told is not None else f"{type(exc).__name__}: {exc}",
                          "extraInfo": {"py_callstack": callstack, "timestamp": str(int(now))}},
              "llmtrain_time": now, _TOLD_KEY: told}
    # Written whole and renamed into place: the launcher reads the file as soon as it sees this process end, and a
    # SIGTERM it sent may end us mid-write; a half-written file would crash torchrun's own agent (JSONDecodeError).
    partial = f"{error_file}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            json.dump(report, f)
        os.replace(partial, error_file)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(partial)
        return False
    return True


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
