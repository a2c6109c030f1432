"""Many `python -m llmtrain ARGS` command lines, each as its own process, for a fraction of the start-up cost.

One fresh interpreter imports what ``python -m llmtrain`` imports before it reads a flag, then forks one
child per command line (two at a time by default), which runs ``llmtrain/__main__.py`` as ``python -m llmtrain`` would.
A fresh interpreter per command would spend about two seconds each importing torch. Use it for command lines
that fail or finish in the launching process; one that starts workers still works (they are new processes).

``forked_driver`` gives the driver's command line instead of running it, for a launcher to start (torchrun
``--no-python``): each rank's children then see that rank's launcher variables, as ``-m llmtrain`` would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

# Runs in a fresh interpreter: it imports what `python -m llmtrain` imports before it parses a command line
# (llmtrain.cli, every subcommand's module, the data modules, jsonargparse) and torch._dynamo, which the first
# optimizer a command builds imports (the recipes' check of --optimizer does, before any run starts), then forks one child per case,
# `at_once` at a time; each child runs llmtrain/__main__.py as `python -m llmtrain ARGS` does, with its stdout and
# stderr in files, and exits as that interpreter would. Prints the exit codes (negative: a signal), as JSON, and
# writes them to the `codes` file. With a `barrier` (a folder; under a launcher), it then waits until every rank's
# driver is done and exits with its commands' common exit code (1 if they differ), as `-m llmtrain` would have.
_FORK_EACH = """
import atexit, json, os, resource, runpy, sys, time, traceback
import jsonargparse, llmtrain.cli, llmtrain.data
import torch._dynamo  # what building an optimizer imports (torch.optim's add_param_group), 1.5 s each otherwise
llmtrain.cli.commands()
settings = json.loads(open(sys.argv[1]).read())
commands = settings["commands"]

def child(command):
    if command["memory_limit"]:  # a command that would allocate without end fails instead of eating the machine
        resource.setrlimit(resource.RLIMIT_AS, (command["memory_limit"], resource.getrlimit(resource.RLIMIT_AS)[1]))
    for fd, path in ((1, command["stdout"]), (2, command["stderr"])):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.argv = ["-m", *command["argv"]]  # run_module puts __main__.py's path first, as `python -m` does
    code = 0
    try:
        runpy.run_module("llmtrain", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

codes, running, pending = {}, {}, list(enumerate(commands))
while pending or running:
    while pending and len(running) < settings["at_once"]:
        index, command = pending.pop(0)
        pid = os.fork()
        if pid == 0:
            child(command)
        running[pid] = index
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
codes = [codes[index] for index in range(len(commands))]
print(json.dumps(codes))
with open(settings["codes"], "w") as handle:
    json.dump(codes, handle)
if settings["barrier"]:
    barrier = settings["barrier"]
    open(os.path.join(barrier, os.environ["RANK"]), "w").close()
    while len(os.listdir(barrier)) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.1)
    sys.stdout.flush()
    os._exit(codes[0] if len(set(codes)) == 1 else 1)
"""


def forked_driver(argvs: list[list[str]], workdir: Path, memory_limit: Optional[int] = None, at_once: int = 2,
                  barrier: Optional[Path] = None) -> list[str]:
    """The driver's command line for ``argvs`` (their outputs go to ``workdir``; read them with forked_results).
    ``barrier``: a folder the drivers of every rank of a launch share (see _FORK_EACH)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    commands = [{"argv": argv, "stdout": str(workdir / f"{index}.out"), "stderr": str(workdir / f"{index}.err"),
                 "memory_limit": memory_limit}
                for index, argv in enumerate(argvs)]
    if barrier is not None:
        Path(barrier).mkdir(parents=True, exist_ok=True)
    settings = {"commands": commands, "at_once": at_once, "codes": str(workdir / "codes.json"),
                "barrier": None if barrier is None else str(barrier)}
    (workdir / "commands.json").write_text(json.dumps(settings))
    return [sys.executable, "-c", _FORK_EACH, str(workdir / "commands.json")]


def forked_results(workdir: Path) -> list[subprocess.CompletedProcess]:
    """What the driver's commands did, in order: exit code (negative: a signal), stdout and stderr."""
    workdir = Path(workdir)
    commands = json.loads((workdir / "commands.json").read_text())["commands"]
    codes = json.loads((workdir / "codes.json").read_text())
    return [subprocess.CompletedProcess(command["argv"], code, Path(command["stdout"]).read_text(),
                                        Path(command["stderr"]).read_text()) for command, code in zip(commands, codes)]


def run_forked(argvs: list[list[str]], workdir: Path, env: dict, timeout_s: float = 1200,
               memory_limit: Optional[int] = None, at_once: int = 2) -> list[subprocess.CompletedProcess]:
    """Each command line's exit code (negative: a signal), stdout and stderr, in order.

    ``memory_limit``: bytes of address space each command may take (RLIMIT_AS); None: no limit. ``at_once``: how
    many run side by side (1: each starts once the one before it has ended, for commands that build on each other)."""
    driver = subprocess.run(forked_driver(argvs, workdir, memory_limit, at_once), capture_output=True, text=True,
                            timeout=timeout_s, env=env)
    assert driver.returncode == 0, f"the driver failed:\n{driver.stdout}{driver.stderr}"
    return forked_results(workdir)
