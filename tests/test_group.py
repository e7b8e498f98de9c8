"""The process-group harness (tests/group.py) itself: a job that raises or kills its process
fails alone, with what went wrong, and the jobs after it still run in a new launch."""

from __future__ import annotations

import json
import os
import time

import pytest
from group import GROUP_NICE, Group, Job, JobFailed, autogroup_nice

pytestmark = pytest.mark.dist


def write(out, text: str) -> None:
    (out / "result.json").write_text(json.dumps(text))


def boom(out, text: str) -> None:
    raise ValueError(f"job says {text}")


def priority(out) -> None:
    """The rank's own nice value and its session's."""
    write(out, [os.getpriority(os.PRIO_PROCESS, 0), autogroup_nice(os.getpid())])


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


def test_jobs_run_in_the_background_and_a_test_waits_for_its_own(tmp_path):
    """...at a lower priority than the test's own processes: theirs, and their session's
    where the kernel schedules sessions as wholes (autogroup)."""
    group = Group(tmp_path)
    first, last = Job("test_group:write", 1, ("a",)), Job("test_group:write", 1, ("b",))
    niced = Job("test_group:priority", 1)
    for job in (first, last, niced):
        group.declare(job)
    group.start()
    assert json.loads((group.result(last) / "result.json").read_text()) == "b"
    assert json.loads((group.result(first) / "result.json").read_text()) == "a"
    own, session = json.loads((group.result(niced) / "result.json").read_text())
    assert own == min(19, os.getpriority(os.PRIO_PROCESS, 0) + GROUP_NICE)
    assert session == (GROUP_NICE if autogroup_nice(os.getpid()) is not None else None)
    deadline = time.monotonic() + 60  # the group ends after its last job is done
    while group._runner is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group._runner is None and [n for n, _, _ in group.launches] == [1]


def test_the_launch_order_is_the_runners():
    """conftest orders the tests that read jobs by the launch that runs them: smallest world
    first, a job after the launch of what it needs (its own size's may share its launch)."""
    group = Group()
    two = Job("test_group:write", 2, ("two",))
    one = Job("test_group:write", 1, ("one",))
    after = Job("test_group:write", 1, ("after",), needs=(two,))
    same = Job("test_group:write", 2, ("same",), needs=(two,))
    for job in (two, after, one, same):
        group.declare(job)
    assert group.launch_order() == {one.key: 0, two.key: 1, same.key: 1, after.key: 2}
