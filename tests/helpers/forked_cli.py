"""Many `python -m llmtrain ARGS` command lines, each as its own process, for a fraction of the start-up cost.

One fresh interpreter imports what ``python -m llmtrain`` imports before it reads a flag, then forks one
child per command line (two at a time), which runs ``llmtrain/__main__.py`` as ``python -m llmtrain`` would.
A fresh interpreter per command would spend about two seconds each importing torch. Use it for command lines
that fail or finish in the launching process; one that starts workers still works (they are new processes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

# Runs in a fresh interpreter: it imports what `python -m llmtrain` imports before it parses a command line
# (llmtrain.cli, every subcommand's module, the data modules, jsonargparse), then forks one child per case,
# two at a time; each child runs llmtrain/__main__.py as `python -m llmtrain ARGS` does, with its stdout and
# stderr in files, and exits as that interpreter would. Prints the exit codes (negative: a signal), as JSON.
_FORK_EACH = """
import atexit, json, os, resource, runpy, sys, traceback
import jsonargparse, llmtrain.cli, llmtrain.data
llmtrain.cli.commands()
commands = json.loads(open(sys.argv[1]).read())

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
    while pending and len(running) < 2:
        index, command = pending.pop(0)
        pid = os.fork()
        if pid == 0:
            child(command)
        running[pid] = index
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps([codes[index] for index in range(len(commands))]))
"""


def run_forked(argvs: list[list[str]], workdir: Path, env: dict, timeout_s: float = 1200,
               memory_limit: Optional[int] = None) -> list[subprocess.CompletedProcess]:
    """Each command line's exit code (negative: a signal), stdout and stderr, in order.

    ``memory_limit``: bytes of address space each command may take (RLIMIT_AS); None: no limit."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    commands = [{"argv": argv, "stdout": str(workdir / f"{index}.out"), "stderr": str(workdir / f"{index}.err"),
                 "memory_limit": memory_limit}
                for index, argv in enumerate(argvs)]
    (workdir / "commands.json").write_text(json.dumps(commands))
    driver = subprocess.run([sys.executable, "-c", _FORK_EACH, str(workdir / "commands.json")], capture_output=True,
                            text=True, timeout=timeout_s, env=env)
    assert driver.returncode == 0, f"the driver failed:\n{driver.stdout}{driver.stderr}"
    codes = json.loads(driver.stdout)
    return [subprocess.CompletedProcess(command["argv"], code, Path(command["stdout"]).read_text(),
                                        Path(command["stderr"]).read_text()) for command, code in zip(commands, codes)]
