"""Run many multi-process test jobs in one long-lived torchrun group per world size.

Starting a torchrun group costs every rank about 5 s of CPU (torch, the engine) before its first
step, more than a parity row's few training steps. So the jobs of a test session that need the
same number of processes run in one group (tests/group_worker.py), one after the other, each
building its own meshes over that group.

- A job is a function in a module under tests/ (`Job.target`, "module:function") called on every
  rank as `function(out, *args)`; it writes what the test reads into `out`. Jobs with equal
  target, world size and arguments are one job, made once per session (the single-process
  references shared by every parity file).
- Tests declare their jobs at collection (a parametrized value with a `jobs` attribute, or the
  `jobs` marker); once the groups started, asking for a job no test declared is an error (it
  would run in a launch of its own: a torchrun and its ranks' start-up for one job). In a pytest
  session the groups then run in a background thread (`start`),
  one world size after another, while the session runs the tests that need no job (conftest
  puts the tests that read jobs last); a test asking for a job's result waits for that job.
  Without `start`, the first request for a job runs the group of its world size, every pending
  job of that size.
- A job that raises fails that job alone: the test asking for it sees each rank's traceback, and
  the group starts again for the jobs after it. A crash (a rank killed, a segfault) is that job's
  failure too, and so is a job that runs past `JOB_TIMEOUT_S` (the group is killed).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from group_worker import DONE, FAILED

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
WORKER = TESTS / "group_worker.py"
JOB_TIMEOUT_S = 420


@dataclass(frozen=True)
class Job:
    """One job: `target` ("module:function" under tests/) on `nproc` processes with `args`."""

    target: str
    nproc: int
    args: tuple = ()
    label: str = field(default="", compare=False)
    # Jobs whose output this one reads (their directories named with `path`): they run first.
    needs: tuple[Job, ...] = field(default=(), compare=False)

    @property
    def key(self) -> str:
        text = json.dumps([self.target, self.nproc, list(self.args)])
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def path(self, sub: str = "") -> str:
        """This job's output directory (or a path inside it), for another job's arguments:
        the group fills it in when it writes the jobs file."""
        return f"{{job:{self.key}}}/{sub}".rstrip("/")


class UndeclaredJob(AssertionError):
    pass


class JobFailed(AssertionError):
    pass


class Group:
    """The session's jobs and the groups that ran them."""

    def __init__(self, root: Path | None = None):
        self.root = root  # set before the first job runs (conftest's `group` fixture)
        self.pending: dict[str, Job] = {}  # declared, not run yet, in declaration order
        self.dirs: dict[str, Path] = {}  # jobs run (or running), and where
        self.labels: dict[str, str] = {}
        self.launches: list[tuple[int, int, float]] = []  # (nproc, jobs, seconds)
        # The background runner (`start`): what it and the tests waiting for it share.
        self._cv = threading.Condition()
        self._runner: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._stopping = False
        self.started = False  # `start` was called: every job is declared by then

    def declare(self, job: Job) -> None:
        with self._cv:
            for need in job.needs:
                self.declare(need)
            if job.key not in self.dirs and job.key not in self.pending:
                self.pending[job.key] = job
                self.labels[job.key] = f"{job.label or job.target} ({job.nproc} process(es))"

    def result(self, job: Job) -> Path:
        """The job's output directory, once it ran; raises JobFailed with what went wrong."""
        with self._cv:
            if self.started and job.key not in self.pending and job.key not in self.dirs:
                raise UndeclaredJob(
                    f"{job.label or job.target} ({job.nproc} process(es)) was declared by no "
                    "test: name it in the test's @pytest.mark.jobs(...) or pass it as a "
                    "parameter (pytest.param(..., marks=pytest.mark.jobs(job))), so that it "
                    "runs in its world size's launch, not in one of its own"
                )
            self.declare(job)
            while self._runner is not None and not (job.key in self.dirs and self._ended(job.key)):
                self._cv.wait(timeout=1.0)
        if self._runner is None:
            self._ensure(job)
        out = self.dirs[job.key]
        if (out / FAILED).exists():
            text = (out / FAILED).read_text()
            raise JobFailed(f"{job.label or job.target} {list(job.args)} failed:\n{text}")
        if not (out / DONE).exists():
            raise JobFailed(f"{job.label or job.target} {list(job.args)} never ended")
        return out

    def start(self) -> None:
        """Run every job declared so far, and every job declared while it runs, in a background
        thread: one group per world size, smallest first."""
        with self._cv:
            self.started = True
            if self._runner is None and self.pending:
                self._runner = threading.Thread(target=self._drain, name="groups", daemon=True)
                self._runner.start()

    def stop(self) -> None:
        """End the background runner and the group it runs (the session is over)."""
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    def _drain(self) -> None:
        try:
            while not self._stopping:
                with self._cv:
                    nproc = next_size(self.pending.values(), self.dirs)
                    if nproc is None:
                        return  # (a job whose needs never ran runs when a test asks for it)
                if not self.run(nproc):
                    return
        finally:
            with self._cv:
                self._runner = None
                self._cv.notify_all()

    def _ensure(self, job: Job) -> None:
        if job.key in self.dirs:
            return
        for need in job.needs:
            self._ensure(need)
        self.run(job.nproc)

    def dir(self, job: Job) -> Path:
        return self.root / f"{job.target.replace(':', '.')}-{job.key}"

    def _fill(self, arg):
        """An argument with its `{job:KEY}` placeholders replaced by directories."""
        if not isinstance(arg, str) or "{job:" not in arg:
            return arg
        return re.sub(r"\{job:(\w+)\}", lambda m: str(self.dirs[m[1]]), arg)

    def run(self, nproc: int) -> int:
        """Every pending job on nproc processes whose needs have run (or run before it in
        this group), in one group; again after a failure, for the jobs after it. How many
        jobs it ran."""
        with self._cv:
            jobs = next_launch(self.pending.values(), self.dirs, nproc)
            for j in jobs:
                del self.pending[j.key]
                self.dirs[j.key] = self.dir(j)
        if not jobs:
            return 0
        listed = [
            {
                "target": j.target,
                "args": [self._fill(a) for a in j.args],
                "out": str(self.dirs[j.key]),
            }
            for j in jobs
        ]
        jobs_file = self.root / f"jobs-{nproc}-{len(self.launches)}.json"
        jobs_file.write_text(json.dumps(listed, indent=1))
        start = time.perf_counter()
        attempt = 0
        while True:
            left = [j for j in jobs if not self._ended(j.key)]
            if not left or self._stopping:  # (stopping: the session is over, start nothing)
                break
            for j in left:  # a job cut short by another's failure starts again from nothing
                shutil.rmtree(self.dirs[j.key], ignore_errors=True)
            log = self.root / f"launch-{nproc}-{len(self.launches)}-{attempt}.log"
            code, hung = self._launch(nproc, jobs_file, [self.dirs[j.key] for j in jobs], log)
            attempt += 1
            left = [j for j in jobs if not self._ended(j.key)]
            if not left:
                break
            self._blame(left, code, hung, log)
            with self._cv:
                self._cv.notify_all()
        self.launches.append((nproc, len(jobs), time.perf_counter() - start))
        return len(jobs)

    def _ended(self, key: str) -> bool:
        out = self.dirs[key]
        return (out / DONE).exists() or (out / FAILED).exists()

    def _launch(self, nproc: int, jobs_file: Path, outs: list[Path], log: Path) -> tuple[int, bool]:
        """One torchrun group over the jobs file (its jobs' directories `outs`); its exit
        status, and whether it was killed for making no progress."""
        # (--log-dir: torchrun's own temporary directory for it would stay in $TMPDIR)
        cmd = [sys.executable, "-m", "torch.distributed.run",
               "--standalone", f"--nproc-per-node={nproc}", f"--log-dir={log}.d",
               str(WORKER), str(jobs_file)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
        env.pop("WANDB_API_KEY", None)
        with open(log, "w") as f:
            proc = self._proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
            done = sum((out / DONE).exists() for out in outs)
            last = time.monotonic()
            while proc.poll() is None:
                time.sleep(0.2)
                now = sum((out / DONE).exists() for out in outs)
                if now != done:
                    done, last = now, time.monotonic()
                    with self._cv:
                        self._cv.notify_all()  # tests waiting for a job that just ended
                elif time.monotonic() - last > JOB_TIMEOUT_S:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return proc.returncode, True
        return proc.returncode, False

    def _blame(self, left: list[Job], code: int, hung: bool, log: Path) -> None:
        """Mark the job that ended the group as failed, with its ranks' tracebacks (or why the
        group ended); the jobs after it run in the next launch."""
        errors = {j: sorted(self.dirs[j.key].glob("error.*.txt")) for j in left}
        culprit = next((j for j in left if errors[j]), left[0])
        out = self.dirs[culprit.key]
        out.mkdir(parents=True, exist_ok=True)
        if errors[culprit]:
            why = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in errors[culprit])
        elif hung:
            why = f"no progress for {JOB_TIMEOUT_S} s: the group was killed"
        else:
            why = f"the group ended with exit status {code} and no Python error"
        logs = "".join(
            f"--- {p.name} (last lines)\n{p.read_text()[-2000:]}\n"
            for p in sorted(out.glob("log.*.txt"))
        )
        tail = log.read_text()[-3000:]
        (out / FAILED).write_text(f"{why}\n{logs}--- torchrun (last lines)\n{tail}")

    def summary(self, slowest: int = 10) -> list[str]:
        """One line per group launched (world size, jobs, seconds), then the slowest jobs."""
        lines = [f"{n} process(es): {k} job(s) in {s:.0f} s" for n, k, s in self.launches]
        timed = []
        for key, out in self.dirs.items():
            if (out / DONE).exists():
                seconds = json.loads((out / DONE).read_text())["seconds"]
                timed.append((seconds, self.labels.get(key, out.name)))
        timed.sort(reverse=True)
        lines += [f"{s:7.1f} s  {label}" for s, label in timed[:slowest]]
        return lines


def next_size(pending, ran) -> int | None:
    """The world size the background runner launches next: the smallest among the pending
    jobs whose needs have run (`ran`: their keys) or share their size."""
    ready = [j.nproc for j in pending if all(n.key in ran or n.nproc == j.nproc for n in j.needs)]
    return min(ready, default=None)


def next_launch(pending, ran, nproc: int) -> list[Job]:
    """The pending jobs one launch of `nproc` processes runs, in declaration order: those
    whose needs have run or run before them in it."""
    jobs = []
    for j in list(pending):
        if j.nproc == nproc and all(n.key in ran or n in jobs for n in j.needs):
            jobs.append(j)
    return jobs


def per_rank(group: Group, job: Job) -> dict[int, dict]:
    """What each rank of a job wrote as OUT/RANK.json."""
    out = group.result(job)
    return {r: json.loads((out / f"{r}.json").read_text()) for r in range(job.nproc)}
