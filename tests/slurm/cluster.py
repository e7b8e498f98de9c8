"""A real, throw-away SLURM cluster on this machine, for tests.

`start_cluster(tmp_dir)` starts, as root, Debian's slurm-wlm daemons against a slurm.conf
written into tmp_dir:

- munged (the munge user's authentication daemon), only if none answers yet; it uses the
  host's /etc/munge/munge.key (created if missing) and socket, as Slurm's auth/munge expects;
- slurmctld (the controller) on a free port;
- one slurmd per node (`slurmd -N n1`, each on its own free port). Every node is this host
  (NodeAddr=127.0.0.1): the host's own name is no node name, hence `-N`, and a node name
  such as `n1` does not resolve, so use `Cluster.node_addr("n1")` where an address is needed
  (MASTER_ADDR).

The daemons run in the foreground as our children, so their PIDs are known and they are
stopped by those PIDs when `scontrol shutdown` was not enough. Every daemon, and every job
submitted with `Cluster.env`, carries `SLURM_TEST_CLUSTER=<tmp_dir>` in its environment;
teardown kills whatever still carries it (slurmstepd, job processes), so nothing is left
behind. Client commands (sbatch, srun, scontrol, ...) find the cluster through `SLURM_CONF`
in `Cluster.env`, which also puts the stand-in `sacct` (see `SACCT`) first on PATH.

Why each setting, see `_slurm_conf`. Only one process may use a cluster at a time; two
clusters may run side by side (own ports and directories), but the one that started munged
stops it on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch")
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_RUN = Path("/run/munge")
MARKER = "SLURM_TEST_CLUSTER"
# The daemons live in /usr/sbin, which a non-login shell may leave off PATH.
_SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])

# Slurm's `sacct` reads the accounting database (slurmdbd), which this cluster does not run,
# so the real one fails. submitit polls `sacct` for the state of its jobs and, when that
# fails, only sees a job end once its result file appears: a job killed by SIGKILL (the OOM
# killer, a node failure) writes none, and submitit would wait forever. This stand-in answers
# the part of sacct that submitit 1.5.4 calls,
#     sacct -o JobID,State,NodeList --parsable2 -j ID [-j ID ...]
# from `scontrol show job -o ID`, which keeps finished jobs for MinJobAge seconds.
SACCT = r'''#!{python}
"""Stand-in for sacct (no accounting here): JobID, State, ... from `scontrol show job -o`."""

import argparse
import subprocess
import sys

FIELDS = {{  # sacct field -> (scontrol key, value when missing)
    "JobIDRaw": ("JobId", ""),
    "JobName": ("JobName", ""),
    "State": ("JobState", ""),
    "NodeList": ("NodeList", "None assigned"),
    "ExitCode": ("ExitCode", ""),
    "Partition": ("Partition", ""),
    "User": ("UserId", ""),
    "Elapsed": ("RunTime", ""),
    "Start": ("StartTime", "Unknown"),
    "End": ("EndTime", "Unknown"),
    "Reason": ("Reason", ""),
}}


def records(job_id):
    """One dict per job (per array task) that scontrol still knows; none if it forgot it."""
    cmd = ["scontrol", "show", "job", "-o"] + ([job_id] if job_id else [])
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "JobId=" in line:
            yield parse(line)


def parse(line):
    """key=value pairs; the first of a key wins (a Command= with spaces comes late)."""
    rec = {{}}
    for item in line.split():
        if "=" in item:
            rec.setdefault(*item.split("=", 1))
    return rec


def job_id(rec):
    """123, 123_4 for an array task, 123_[5-9] for the tasks still pending together."""
    task = rec.get("ArrayTaskId")
    if not task:
        return rec["JobId"]
    return f"{{rec['ArrayJobId']}}_{{task if task.isdigit() else '[' + task + ']'}}"


def value(rec, field):
    if field == "JobID":
        return job_id(rec)
    key, missing = FIELDS.get(field, (field, ""))
    found = rec.get(key, missing)
    return missing if found in ("(null)", "") else found


parser = argparse.ArgumentParser()
parser.add_argument("-o", "--format", default="JobID,JobName,Partition,State,ExitCode")
parser.add_argument("-j", "--jobs", action="append", default=[])
parser.add_argument("-P", "--parsable2", action="store_true")
parser.add_argument("-p", "--parsable", action="store_true")
parser.add_argument("-n", "--noheader", action="store_true")
args, _ignored = parser.parse_known_args()  # -X, -a, -u ...: accepted, no effect

fields = [f.split("%")[0] for f in args.format.split(",") if f]
ids = [i for group in args.jobs for i in group.split(",") if i] or [None]
rows = [] if args.noheader else [fields]
seen = set()
for wanted in ids:
    for rec in records(wanted):
        if (rec["JobId"], rec.get("ArrayTaskId")) not in seen:
            seen.add((rec["JobId"], rec.get("ArrayTaskId")))
            rows.append([value(rec, f) for f in fields])
for row in rows:
    if args.parsable2 or args.parsable:
        print("|".join(row) + ("|" if args.parsable else ""))
    else:
        print(" ".join(v.ljust(20) for v in row).rstrip())
'''


def slurm_available() -> str | None:
    """None when a cluster can be started here, else why not (for pytest.skip)."""
    missing = [name for name in DAEMONS if shutil.which(name, path=_SBIN_PATH) is None]
    if missing:
        return f"SLURM not installed (missing {', '.join(missing)}; run tests/slurm/install.sh)"
    if os.geteuid() != 0:
        return "starting a SLURM cluster needs root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"--- {path}: (none)"
    return "\n".join([f"--- {path}:", *text])


class SlurmError(RuntimeError):
    pass


class Cluster:
    """A running cluster; see the module's docstring. Made by `start_cluster`."""

    def __init__(self, tmp_dir: Path, nodes: Sequence[str], cpus_per_node: int):
        self.dir = Path(tmp_dir).resolve()
        self.nodes = tuple(nodes)
        self.cpus_per_node = cpus_per_node
        self.conf = self.dir / "slurm.conf"
        # slurmd puts a socket per job step, spool/<node>/<node>_<job>.<step>, into the spool
        # directory, and a socket's path has at most 107 bytes.
        if max(len(str(self.dir / "spool" / n / n)) for n in nodes) + 22 > 107:
            raise SlurmError(f"{self.dir} is too long a path for slurmd's sockets")
        self.bin = self.dir / "bin"
        self.ctld_port = _free_port()
        self.node_ports = {n: _free_port() for n in self.nodes}
        self.procs: dict[str, subprocess.Popen] = {}  # name -> a daemon WE started
        self.env = {
            **os.environ,
            "SLURM_CONF": str(self.conf),
            "PATH": os.pathsep.join([str(self.bin), _SBIN_PATH]),
            MARKER: str(self.dir),
        }
        for var in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
            if var not in ("SLURM_CONF", MARKER):  # when the tests run inside a SLURM job
                del self.env[var]

    # -- writing files ---------------------------------------------------------------------
    def _slurm_conf(self) -> str:
        d = self.dir
        lines = [
            "ClusterName=test",
            "SlurmctldHost=localhost",
            # Root runs everything: no slurm user, and jobs may run as root (the test user).
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # Free ports chosen now: a stale cluster on the default 6817/6818 cannot collide.
            f"SlurmctldPort={self.ctld_port}",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd_%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd_%n.log",
            # No cgroups in a container: track job processes through /proc, bind no CPUs.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            # No slurmdbd: the stand-in sacct answers from the controller instead.
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            # First in, first out, and at once: batch jobs are otherwise scheduled up to 3 s
            # after submission (batch_sched_delay).
            "SchedulerType=sched/builtin",
            "SchedulerParameters=batch_sched_delay=0",
            "MpiDefault=none",
            # Trust the CPUs given here even where the host has fewer cores than all nodes.
            "SlurmdParameters=config_overrides",
            # A node that was down comes back as soon as its slurmd registers.
            "ReturnToService=2",
            # Finished jobs stay visible to `scontrol show job` (and so to sacct) for 10 min.
            "MinJobAge=600",
            # scancel: SIGKILL 2 s after SIGTERM rather than 30 s, so teardown is quick.
            "KillWait=2",
            "MailProg=/bin/true",
        ]
        for name in self.nodes:
            lines.append(
                f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 "
                f"Port={self.node_ports[name]} CPUs={self.cpus_per_node} State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
            "MaxTime=INFINITE State=UP"
        )
        return "\n".join(lines) + "\n"

    def _write_files(self) -> None:
        for sub in ["state", "bin", *(f"spool/{n}" for n in self.nodes)]:
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._slurm_conf())
        sacct = self.bin / "sacct"
        sacct.write_text(SACCT.format(python=sys.executable))
        sacct.chmod(0o755)

    # -- daemons ---------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str], **kw) -> None:
        with open(self.dir / f"{name}.out", "wb") as log:
            self.procs[name] = subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, **kw,
            )  # fmt: skip

    def _munge_answers(self) -> bool:
        return subprocess.run(["munge", "-n"], capture_output=True).returncode == 0

    def _start_munged(self) -> None:
        if self._munge_answers():
            return  # someone else's munged: use it, and leave it running
        if not MUNGE_KEY.exists():
            MUNGE_KEY.parent.mkdir(mode=0o700, exist_ok=True)
            subprocess.run(["mungekey", "--create", f"--keyfile={MUNGE_KEY}"], check=True)
            shutil.chown(MUNGE_KEY, "munge", "munge")
            MUNGE_KEY.chmod(0o400)
        MUNGE_RUN.mkdir(mode=0o755, exist_ok=True)
        shutil.chown(MUNGE_RUN, "munge", "munge")
        self._spawn("munged", ["munged", "--foreground"], user="munge", group="munge")
        self._wait(self._munge_answers, 10, "munged does not answer")

    def start(self) -> Cluster:
        self._write_files()
        self._start_munged()
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(f"slurmd_{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
        self.wait_idle(30)
        return self

    def wait_idle(self, timeout: float = 60) -> None:
        """Every node idle: no job of an earlier test still running or completing on one."""
        self._wait(self._all_idle, timeout, "nodes are not idle")

    def _all_idle(self) -> bool:
        run = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        idle = {line.split()[0] for line in run.stdout.splitlines() if line.endswith(" idle")}
        return idle >= set(self.nodes)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"after {timeout:.0f} s"
                raise SlurmError(f"{what} ({why})\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, lines: int = 20) -> str:
        files = sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out"))
        return "\n".join(_tail(f, lines) for f in files)

    def stop(self) -> None:
        """Cancel every job, shut the daemons down, kill what remains."""
        self._quiet("scancel", "--user=root")
        self._wait_for(lambda: not self._quiet("squeue", "-h").strip(), 10)
        self._quiet("scontrol", "shutdown")
        slurm = [p for n, p in self.procs.items() if n != "munged"]
        self._wait_for(lambda: all(p.poll() is not None for p in slurm), 10)
        for p in slurm:
            if p.poll() is None:
                p.kill()
        ours = {p.pid for p in self.procs.values()}
        for pid in set(stray_pids(self.dir)) - ours:  # slurmstepd and job processes
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if "munged" in self.procs:
            self.procs["munged"].terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _quiet(self, *cmd: str) -> str:
        """stdout of a client command; "" if it failed (the controller may be gone)."""
        try:
            return self.run(*cmd, check=False, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    @staticmethod
    def _wait_for(done, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if done():
                return True
            time.sleep(0.2)
        return False

    # -- clients ---------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, timeout: float = 60):
        """Run a client command (sbatch, scontrol, ...) against this cluster."""
        run = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=self.dir
        )
        if check and run.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)}: exit {run.returncode}\n{run.stderr}")
        return run

    def sbatch(self, *args: str) -> str:
        """Submit; returns the job id."""
        return self.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o ID` as a dict: the first record (an array's first task),
        {} once the controller forgot the job (MinJobAge after it ended)."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        return _parse(out.splitlines()[0]) if out.strip() else {}

    def node_addr(self, name: str) -> str:
        """The address of node `name` (its name does not resolve: use this as MASTER_ADDR)."""
        return _parse(self.run("scontrol", "show", "node", name, "-o").stdout)["NodeAddr"]


def _parse(line: str) -> dict[str, str]:
    """scontrol's one-line key=value records; the first of a key wins (values with spaces,
    such as Command=, come late and may hold '=')."""
    record: dict[str, str] = {}
    for item in line.split():
        if "=" in item:
            key, value = item.split("=", 1)
            record.setdefault(key, value)
    return record


def stray_pids(cluster_dir: Path) -> list[int]:
    """Processes (daemons, slurmstepd, jobs) whose environment names this cluster."""
    needle = f"{MARKER}={Path(cluster_dir).resolve()}\0".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in entry.joinpath("environ").read_bytes() + b"\0":
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


@contextlib.contextmanager
def start_cluster(
    tmp_dir: Path, nodes: Sequence[str] = ("n1", "n2"), cpus_per_node: int = 2
) -> Iterator[Cluster]:
    """Start a cluster in tmp_dir, yield it, stop it (also when the body raises)."""
    cluster = Cluster(tmp_dir, nodes, cpus_per_node)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
