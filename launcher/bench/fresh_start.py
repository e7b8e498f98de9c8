"""`make bench`'s first table of the start: `make train` as a new user meets it, on a fresh clone.

The checkout's committed tree (or each commit named) is cloned into a temporary directory, and
there `make setup` (what `make train` runs first) is timed and its `.venv` weighed: the runtime
environment. pip's download cache is this machine's: the time is an install, not a download.
The base Python is the one the checkout's own venv was made from, so a machine whose Python
has torch (a GPU image) gets a venv that sees it, as `make train` would.

Then the default run itself, as `make train` starts it, shortened to its first two steps: one
untimed run (files in the page cache: warm), then `runs` timed ones, each from the command's
start to the first row of its metrics.jsonl (its first step, done); and the same command again
on a finished run, to its answer that nothing is left to train. Each figure is the median.

`python -m launcher.bench.fresh_start REV [REV ...]` measures other commits the same way, their
runs taking turns: docs/speed.md's before and after come from this command at both commits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
FIRST_STEPS = ["train.steps=2"]  # the embedded default, cut to its first steps


def size_mb(path: Path) -> float:
    """Bytes on disk under `path` (hard links counted once), in MB."""
    out = subprocess.run(["du", "-s", "--block-size=1M", str(path)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return float(out.split()[0])


def base_python() -> str:
    """The interpreter this process's venv was made from (a venv's python is not a base)."""
    return getattr(sys, "_base_executable", sys.executable)


def to_first_row(python: Path, cwd: Path, run_dir: Path) -> tuple[float, float]:
    """Seconds from the default run's start to its first metrics row, and to its end."""
    metrics = run_dir / "metrics.jsonl"
    with tempfile.TemporaryFile("w+") as err:  # a file: a pipe nobody reads could fill
        began = time.perf_counter()
        proc = subprocess.Popen(
            [str(python), "-m", "launcher.train", *FIRST_STEPS, f"hydra.run.dir={run_dir}"],
            cwd=cwd, stdout=subprocess.DEVNULL, stderr=err, text=True,
        )  # fmt: skip
        first = None
        while proc.poll() is None:
            if first is None and metrics.exists() and metrics.stat().st_size > 0:
                first = time.perf_counter() - began
            time.sleep(0.01)
        end = time.perf_counter() - began
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"the default run failed:\n{err.read()[-2000:]}")
    return (end if first is None else first), end


def set_up(revision: str, where: Path, progress) -> dict:
    """A fresh clone of `revision` in `where`, set up by `make setup`: its time and size."""
    sha = subprocess.run(["git", "-C", str(REPOSITORY), "rev-parse", "--short", revision],
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    clone = where / sha
    progress(f"cloning {sha}")
    subprocess.run(["git", "clone", "-q", str(REPOSITORY), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", sha], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    progress(f"make setup in a fresh clone of {sha}")
    began = time.perf_counter()
    setup = subprocess.run(["make", "-s", "setup", f"PY={base_python()}"], cwd=clone, env=env,
                           capture_output=True, text=True)  # fmt: skip
    if setup.returncode != 0:
        raise RuntimeError(f"make setup failed:\n{setup.stderr[-2000:]}")
    return {
        "revision": sha,
        "clone": clone,
        "python": clone / ".venv" / "bin" / "python",
        "setup_s": time.perf_counter() - began,
        "venv_mb": size_mb(clone / ".venv"),
    }


def fresh_clones(revisions=("HEAD",), runs: int = 3, progress=print) -> list[dict]:
    """Each revision's set-up, and its default run's start; with several, their runs take
    turns (the order rotated each round), so that a slower minute of this shared machine
    falls on all of them."""
    with tempfile.TemporaryDirectory(prefix="fresh-start-") as tmp:
        clones = [set_up(r, Path(tmp), progress) for r in revisions]
        runs_of = {c["revision"]: Path(tmp) / "runs" / c["revision"] for c in clones}
        first = {c["revision"]: [] for c in clones}
        whole = {c["revision"]: [] for c in clones}
        done = {c["revision"]: [] for c in clones}
        for i in range(runs + 1):
            for c in clones[i % len(clones) :] + clones[: i % len(clones)]:
                sha = c["revision"]
                progress(f"the default run of {sha}, {i} of {runs}")
                f, w = to_first_row(c["python"], c["clone"], runs_of[sha] / str(i))
                if i:  # the first is the warm-up
                    first[sha].append(f)
                    whole[sha].append(w)
        for i in range(runs):
            for c in clones:
                sha = c["revision"]
                progress(f"nothing left to train ({sha}), {i + 1} of {runs}")
                finished = runs_of[sha] / str(runs)  # the last timed run
                done[sha].append(to_first_row(c["python"], c["clone"], finished)[1])
        return [
            {
                "revision": c["revision"],
                "setup_s": c["setup_s"],
                "venv_mb": c["venv_mb"],
                "first_step_s": statistics.median(first[c["revision"]]),
                "command_s": statistics.median(whole[c["revision"]]),
                "nothing_left_s": statistics.median(done[c["revision"]]),
                "runs": runs,
            }
            for c in clones
        ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.bench.fresh_start",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("revisions", nargs="*", default=["HEAD"],
                        help="the commits to clone (HEAD); several take turns")  # fmt: skip
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each (3)")
    args = parser.parse_args(argv)
    print(json.dumps(fresh_clones(args.revisions, args.runs, progress=lambda m: print(
        m, file=sys.stderr, flush=True)), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
