"""Shared helpers: compose configs in-process, run the CLI as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

# One thread per process in the whole session, before anything imports torch: the groups run
# two to eight ranks on the machine's cores beside this process and the CLI runs it starts, and
# an OpenMP pool per process that waits spinning for cores it shares slows everyone (measured:
# tests/e2e/test_own_data.py 15 s alone, 100 s beside the groups with torch's default pool).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from launcher.runtime.imports import uncollected  # noqa: E402

# The collection's imports (torch, transformers, the engine) without the cyclic collector, their
# objects frozen once it ends (`pytest_collection_finish`), as for the engine's processes.
COLLECTING = uncollected()
COLLECTING.__enter__()

import pytest  # noqa: E402
from group import Group, Job  # noqa: E402
from hypothesis import settings  # noqa: E402

from launcher.cli import compose  # noqa: E402
from launcher.configs import BUILTIN  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONF = BUILTIN  # the built-in configs (launcher/conf; the root's conf/ links there)
# Property tests: a few dozen random examples in every run, many more in `make test-all`
# (HYPOTHESIS_PROFILE=thorough).
settings.register_profile("default", max_examples=40)
settings.register_profile("thorough", max_examples=400)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
# The session's multi-process jobs (tests/group.py): declared at collection, run by world size.
GROUP = Group()
# Recipes whose published layout launcher.train cannot run yet, with the limitation that refuses
# them (issue 24 closes these; docs/planner.md's recipes table shows the same).
REFUSED_RECIPES: dict[str, str] = {}


def declared_jobs(item) -> list[Job]:
    """The jobs a test reads: its parameters' (a Job, or a value with a `jobs` attribute) and
    its `jobs` markers'."""
    found = []
    params = item.callspec.params.values() if hasattr(item, "callspec") else ()
    for value in params:
        if isinstance(value, Job):
            found.append(value)
        found += getattr(value, "jobs", ())
    for marker in item.iter_markers("jobs"):
        found += marker.args
    return found


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected what does not run
def pytest_collection_modifyitems(config, items):
    """Declare the selected tests' jobs, and order the session around the groups, which run
    them in the background from the first test on (`group`): first the tests that start no
    process of their own (one core beside the groups' processes), then the other end-to-end
    and multi-process tests, and last the tests that read jobs."""
    for item in items:
        for job in declared_jobs(item):
            GROUP.declare(job)

    def order(item) -> int:
        if declared_jobs(item):
            return 2
        return 1 if item.get_closest_marker("dist") or item.get_closest_marker("e2e") else 0

    items.sort(key=order)  # stable: file order within each part


def pytest_collection_finish(session):
    COLLECTING.__exit__(None, None, None)


@pytest.fixture(scope="session", autouse=True)
def group(tmp_path_factory) -> Group:
    """The jobs' groups: `group.result(job)` is the job's output directory. Set up with the
    session's first test, which starts the groups in the background."""
    if GROUP.root is None:
        GROUP.root = tmp_path_factory.mktemp("group")
    GROUP.start()
    yield GROUP
    GROUP.stop()


def pytest_terminal_summary(terminalreporter):
    lines = GROUP.summary()
    if lines:
        terminalreporter.section("process groups (tests/group.py)")
        for line in lines:
            terminalreporter.write_line(line)


def compose_config(overrides: list[str] | None = None):
    """The typed Config the CLI would build from these overrides (launcher.cli.compose: composed
    once per session for each list of overrides, each call given its own copy)."""
    return compose(list(overrides or ()))


def cli_env(env: dict | None = None) -> dict:
    full_env = {**os.environ, "WANDB_SILENT": "true", **(env or {})}
    full_env.pop("WANDB_API_KEY", None)
    return full_env


def run_cli(module: str, *args: str, env: dict | None = None, timeout: float = 600):
    """Run `python -m module args` from the repo root; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=cli_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli(module: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`python -m module args` started from the repo root, its output piped (text)."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=cli_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 240) -> int:
    """Wait until the run `proc` trains into `run_dir` has a metrics.jsonl row at `step` or
    later; returns the newest step. Fails with the run's stderr if it ends first."""
    deadline = time.monotonic() + timeout
    while (done := newest_step(run_dir)) < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"training never reached step {step}"
        time.sleep(0.1)
    return done


def newest_step(run_dir: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(run_dir)), default=0)
    except (FileNotFoundError, ValueError):  # not yet written, or a row half written
        return 0


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, which Python writes but JSON has not."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows, each held to be strict JSON."""
    return [strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def survivors(run_dir: Path) -> list[str]:
    """Command lines of processes still running for this run directory."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmd = entry.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(run_dir) in cmd and int(entry.name) != os.getpid():
            found.append(f"{entry.name}: {cmd}")
    return found
