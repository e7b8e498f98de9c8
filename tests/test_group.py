"""The process-group harness (tests/group.py) itself: a job that raises or kills its process
fails alone, with what went wrong, and the jobs after it still run in a new launch."""

from __future__ import annotations

import json
import os
import time

import pytest
from group import Group, Job, JobFailed, UndeclaredJob

pytestmark = pytest.mark.dist


def write(out, text: str) -> None:
    (out / "result.json").write_text(json.dumps(text))


def boom(out, text: str) -> None:
    raise ValueError(f"job says {text}")


def die(out) -> None:
    os._exit(7)  # no Python error: a crash


def test_a_failing_job_fails_alone_and_the_rest_run(tmp_path):
    group = Group(tmp_path)
    jobs = [
        Job("test_group:write", 1, ("first",)),
        Job("test_group:boom", 1, ("no",)),
        Job("test_group:die", 1),
        Job("test_group:write", 1, ("last",)),
    ]
    for job in jobs:
        group.declare(job)
    first, raised, crashed, last = jobs
    assert json.loads((group.result(first) / "result.json").read_text()) == "first"
    assert json.loads((group.result(last) / "result.json").read_text()) == "last"
    with pytest.raises(JobFailed, match="ValueError: job says no"):
        group.result(raised)
    with pytest.raises(JobFailed, match="exit status 1 and no Python error"):
        group.result(crashed)
    # One launch for the four jobs, and one more after each failure.
    assert [n for n, _, _ in group.launches] == [1]
    assert len(list(tmp_path.glob("launch-1-0-*.log"))) == 3


def ended(group: Group, wait_s: float = 60) -> None:
    deadline = time.monotonic() + wait_s
    while group._runner is not None:
        assert time.monotonic() < deadline, "the group's runner never ended"
        time.sleep(0.1)


def test_jobs_run_in_the_background_and_a_test_waits_for_its_own(tmp_path):
    group = Group(tmp_path)
    first, last = Job("test_group:write", 1, ("a",)), Job("test_group:write", 1, ("b",))
    group.declare(first)
    group.declare(last)
    group.start()
    assert json.loads((group.result(last) / "result.json").read_text()) == "b"
    assert json.loads((group.result(first) / "result.json").read_text()) == "a"
    ended(group)  # the runner ended after its last job
    assert [n for n, _, _ in group.launches] == [1]


def test_a_job_no_test_declared_is_refused_once_the_groups_started(tmp_path):
    group = Group(tmp_path)
    declared, other = Job("test_group:write", 1, ("a",)), Job("test_group:write", 1, ("b",))
    group.declare(declared)
    group.start()
    assert json.loads((group.result(declared) / "result.json").read_text()) == "a"
    ended(group)
    with pytest.raises(UndeclaredJob, match=r"declared by no test: name it in the test's"):
        group.result(other)
    assert other.key not in group.dirs and [n for n, _, _ in group.launches] == [1]
