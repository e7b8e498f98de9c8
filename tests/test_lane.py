"""The session's lane (tests/lane.py): its work runs in order in a background thread, at the
groups' priority and the processes it starts too; a test reads a result or what was raised."""

from __future__ import annotations

import os
import subprocess
import threading
from functools import partial

import pytest
from group import GROUP_NICE
from lane import Lane


def work(seen: list, i: int) -> tuple[int, int]:
    """(the nice value of the thread that runs it, of a process it starts)"""
    seen.append(i)
    if i == 2:
        raise ValueError("work 2 fails")
    child = subprocess.run(["sh", "-c", "ps -o ni= -p $$"], capture_output=True, text=True)
    thread = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    return thread, int(child.stdout)


def test_work_runs_in_order_beside_the_test_at_the_groups_priority():
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    lane, seen = Lane(), []
    for i in range(4):
        lane.declare(str(i), partial(work, seen, i))
    lane.start()
    assert lane.result("1") == (own + GROUP_NICE, own + GROUP_NICE)
    with pytest.raises(ValueError, match="work 2 fails"):
        lane.result("2")
    assert lane.result("3") == (own + GROUP_NICE,) * 2
    lane.stop()
    assert seen == [0, 1, 2, 3]  # each once, in order, although read out of order
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # this thread's


def test_without_start_a_result_is_computed_by_the_test_that_reads_it():
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    lane, seen = Lane(), []
    lane.declare("0", partial(work, seen, 0))
    lane.declare("1", partial(work, seen, 1))
    assert lane.result("1") == (own, own)
    assert seen == [1]
