"""A real SLURM cluster on this machine, for tests: two fake nodes with two CPUs each.

``ensure_cluster()`` installs Debian's ``slurmctld slurmd slurm-client munge`` when they are missing
(and raises with apt's output when it cannot), writes a
private configuration under ``/tmp/llmtrain-slurm`` (``$LLMTRAIN_SLURM_DIR``), starts its own munged,
slurmctld and one ``slurmd -N NODE`` per fake node, and waits until both nodes are idle. A cluster
that an earlier call started with the same configuration is reused.

The fake nodes are separate slurmd daemons on 127.0.0.1 with their own ports, so SLURM gives every
task its own node id, local id and node name exactly as on real machines. Their names resolve to
127.0.0.1 (an ``/etc/hosts`` entry is added when they do not), as node names do on a real cluster.
Nothing here needs systemd or cgroups: processes are tracked through /proc and tasks are not bound.

``skip_reason()`` says whether the tests may try: as root with apt-get at hand they do, elsewhere they
skip, and ``LLMTRAIN_TEST_SLURM=1`` makes them run anyway, so that a missing prerequisite is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterable, Mapping, Optional

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
NODE_NAMES = ("llmtrain-node1", "llmtrain-node2")
CPUS_PER_NODE = 2
CONTROLLER_PORT = 26817  # away from SLURM's defaults (6817/6818) so a system cluster is left alone
NODE_PORTS = (26818, 26819)
FINISHED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE"}


FORCE_ENV = "LLMTRAIN_TEST_SLURM"


def skip_reason() -> Optional[str]:
    """Why the SLURM tests skip on this machine, or None when they run."""
    forced = os.environ.get(FORCE_ENV)
    if forced == "1":
        return None
    if forced == "0":
        return f"{FORCE_ENV}=0"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return (f"the SLURM tests need root and apt-get (they install slurmctld, slurmd, slurm-client and munge "
                f"and add the fake node names to /etc/hosts); {FORCE_ENV}=1 runs them anyway")
    return None


class SlurmError(RuntimeError):
    """The cluster could not be installed or started, or a job did not finish in time."""


def default_state_dir() -> Path:
    return Path(os.environ.get("LLMTRAIN_SLURM_DIR", "/tmp/llmtrain-slurm"))


def ensure_cluster(state_dir: Optional[Path] = None, ready_timeout_s: float = 300.0) -> "SlurmCluster":
    """A running cluster: the one already up under ``state_dir``, or a fresh one."""
    install_packages()
    ensure_node_names_resolve()
    cluster = SlurmCluster(state_dir or default_state_dir())
    if cluster.is_running():
        cluster.started_here = False
    else:
        cluster.start()
        cluster.started_here = True
    cluster.wait_until_idle(ready_timeout_s)
    return cluster


def install_packages(timeout_s: float = 600.0) -> None:
    """``apt-get install`` SLURM and munge unless their programs are already there."""
    if all(shutil.which(program) for program in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log = []
    for command in (["apt-get", "update"],
                    ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise SlurmError(f"could not install SLURM: `{' '.join(command)}` failed: {err}\n"
                             + "".join(log)) from None
        log.append(f"$ {' '.join(command)}  (exit {done.returncode})\n{done.stdout}{done.stderr}")
        if done.returncode != 0:
            raise SlurmError("could not install SLURM with apt (the SLURM tests need Debian's slurmctld, slurmd, "
                             "slurm-client and munge, and root):\n" + "".join(log))
    if not shutil.which("slurmctld"):
        raise SlurmError("apt-get install succeeded but slurmctld is not on PATH:\n" + "".join(log))


def ensure_node_names_resolve() -> None:
    """Make the fake node names resolve to 127.0.0.1, so that a rank can reach the first node by name."""
    missing = []
    for name in NODE_NAMES:
        try:
            address = socket.gethostbyname(name)
        except OSError:
            missing.append(name)
            continue
        if not address.startswith("127."):
            raise SlurmError(f"the fake node name {name} already resolves to {address}, not to this machine; "
                             "change NODE_NAMES in tests/helpers/slurm_cluster.py")
    if missing:
        try:
            with open("/etc/hosts", "a") as hosts:
                hosts.write(f"127.0.0.1 {' '.join(missing)}  # fake SLURM nodes of llmtrain's tests\n")
        except OSError as err:
            raise SlurmError(f"cannot add the fake node names {missing} to /etc/hosts: {err}") from None


class SlurmCluster:
    """Handle on the private cluster: start and stop it, submit jobs and wait for them."""

    def __init__(self, state_dir: Path):
        self.dir = Path(state_dir)
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge-socket" / "munge.socket"
        self.started_here = False

    # -- configuration ------------------------------------------------------------------------------

    def config_text(self) -> str:
        host = socket.gethostname().split(".")[0]
        d = self.dir
        nodes = ",".join(NODE_NAMES)
        return "\n".join([
            "# Written by tests/helpers/slurm_cluster.py: two fake nodes on this host, no systemd, no cgroups.",
            "ClusterName=llmtrain-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={CONTROLLER_PORT}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # NOTE: cred_expire is also how long a requeued job waits before it may start again (default 120 s).
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd.%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd.%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            # A requeued job becomes eligible while nothing happens; the periodic pass (default 60 s) starts it.
            "SchedulerParameters=sched_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "KillWait=5",
            "MinJobAge=600",
            f"NodeName={nodes} NodeHostname={host} NodeAddr=127.0.0.1 "
            f"Port={NODE_PORTS[0]}-{NODE_PORTS[-1]} CPUs={CPUS_PER_NODE} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    @property
    def env(self) -> dict[str, str]:
        """The environment for SLURM commands: ours, without the SLURM_* variables of any enclosing job."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _pid_files(self) -> dict[str, Path]:
        files = {"munged": self.dir / "munged.pid", "slurmctld": self.dir / "slurmctld.pid"}
        files.update({f"slurmd {name}": self.dir / f"slurmd.{name}.pid" for name in NODE_NAMES})
        return files

    # -- lifecycle ----------------------------------------------------------------------------------

    def is_running(self) -> bool:
        """Every daemon of this configuration is alive and the controller answers."""
        if not self.conf.is_file() or self.conf.read_text() != self.config_text():
            return False
        if not all(_alive(pid_file, name.split()[0]) for name, pid_file in self._pid_files().items()):
            return False
        return self.run("scontrol", "ping", check=False).stdout.count("UP") > 0

    def start(self) -> None:
        """Stop leftovers of an earlier cluster in this directory, then start munged, slurmctld and the slurmds."""
        self.stop()
        if self.dir.exists():
            shutil.rmtree(self.dir)
        for sub in ("state", "log", "munge", "munge-socket", *(f"spool/{n}" for n in NODE_NAMES)):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir / "munge", 0o700)
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.conf.write_text(self.config_text())

        self._daemon(["munged", f"--socket={self.munge_socket}", f"--key-file={key}",
                      f"--pid-file={self.dir / 'munged.pid'}", f"--log-file={self.dir / 'log/munged.log'}",
                      f"--seed-file={self.dir / 'munge/seed'}", "--force"])
        self._poll(lambda: subprocess.run(["munge", "-S", str(self.munge_socket), "-n"], capture_output=True,
                                          timeout=60).returncode == 0, 120, "munged to answer")
        self._daemon(["slurmctld", "-f", str(self.conf), "-c", "-i"])
        self._poll(lambda: "UP" in self.run("scontrol", "ping", check=False).stdout, 120, "slurmctld to answer")
        for name in NODE_NAMES:
            self._daemon(["slurmd", "-f", str(self.conf), "-N", name])

    def wait_until_idle(self, timeout_s: float) -> None:
        """Both nodes idle (nodes left down or drained by an earlier run are resumed)."""
        def idle() -> bool:
            states = self.node_states()
            stuck = [n for n, s in states.items() if s.startswith(("down", "drain", "drng", "fail"))]
            if stuck:
                self.run("scontrol", "update", f"NodeName={','.join(stuck)}", "State=RESUME", check=False)
            return sorted(states) == sorted(NODE_NAMES) and all(s == "idle" for s in states.values())
        self._poll(idle, timeout_s, "both nodes to be idle")

    def stop(self) -> None:
        """Cancel every job of this cluster and stop its daemons (only the processes named in its pid files)."""
        if self.conf.is_file() and _alive(self._pid_files()["slurmctld"], "slurmctld"):
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", "--full", *jobs, check=False)
                # Their tasks end with the job steps, which stop only while the slurmds are up.
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                    time.sleep(0.3)
        # The slurmds first and munged last: a daemon that shuts down still talks to the others.
        for name, pid_file in reversed(list(self._pid_files().items())):
            program = name.split()[0]
            pid = _alive(pid_file, program)
            if not pid:
                continue
            os.kill(pid, signal.SIGTERM)
            # NOTE: the pid file goes away at once; the process takes seconds to finish.
            deadline = time.monotonic() + 15
            while _running(pid, program) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _running(pid, program):
                os.kill(pid, signal.SIGKILL)

    teardown = stop

    # -- jobs ---------------------------------------------------------------------------------------

    def run(self, *command: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise SlurmError(f"`{' '.join(command)}` failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
        return done

    def submit(self, script: Path, args: Iterable[str] = (), env: Optional[Mapping[str, str]] = None,
               options: Iterable[str] = (), output: Optional[Path] = None) -> int:
        """``sbatch [options] script args`` with ``env`` added to the (SLURM-free) environment; the job id.

        The job's output goes to ``output`` (default: ``slurm-%j.out`` in the state directory).
        """
        output = output or self.dir / "jobs" / "slurm-%j.out"
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        command = ["sbatch", "--parsable", f"--output={output}", *options, str(script), *args]
        done = subprocess.run(command, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise SlurmError(f"sbatch failed (exit {done.returncode}): {done.stderr}{done.stdout}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """The fields of ``scontrol show job`` (JobState, ExitCode, Restarts, StdOut, ...)."""
        text = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def output(self, job_id: int) -> str:
        """What the job wrote to its output file so far."""
        try:
            path = Path(self.job(job_id)["StdOut"])
            return path.read_text(errors="replace") if path.is_file() else f"(no output file {path})"
        except (SlurmError, KeyError, OSError) as err:
            return f"(no output: {err})"

    def wait(self, job_id: int, timeout: float) -> str:
        """Wait until the job has finished and return its state; on timeout cancel it and raise with its output."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job(job_id).get("JobState", "UNKNOWN")
            if state in FINISHED_STATES:
                return state
            time.sleep(0.5)
        self.run("scancel", "--full", str(job_id), check=False)
        raise SlurmError(f"job {job_id} did not finish within {timeout:g}s (state {state}); cancelled it. "
                         f"Its output:\n{self.output(job_id)}\n{self.logs()}")

    def node_states(self) -> dict[str, str]:
        text = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
        return dict(line.split()[:2] for line in text.splitlines() if len(line.split()) >= 2)

    def logs(self, lines: int = 20) -> str:
        """The end of each daemon log, for error messages."""
        parts = []
        for log in sorted((self.dir / "log").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log}\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- helpers ------------------------------------------------------------------------------------

    def _daemon(self, command: list[str]) -> None:
        """Start a daemon that forks into the background; it must report success."""
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise SlurmError(f"`{' '.join(command)}` failed (exit {done.returncode}):\n"
                             f"{done.stdout}{done.stderr}\n{self.logs()}")

    def _poll(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out after {timeout_s:g}s waiting for {what}; "
                                 f"nodes: {self.node_states()}\n{self.logs()}")
            time.sleep(0.3)


def _alive(pid_file: Path, program: str) -> int:
    """The pid in ``pid_file`` if that process is alive and runs ``program``, else 0."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    return pid if _running(pid, program) else 0


def _running(pid: int, program: str) -> bool:
    """Process ``pid`` exists, runs ``program`` and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # /proc/PID/stat: "PID (COMM) STATE ..."; COMM is cut to 15 characters.
    comm, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()[0]
    return comm == program[:15] and state != "Z"
