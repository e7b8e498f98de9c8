"""The session's lane (tests/lane.py): its work runs in order in a background thread, one piece
at a time whoever runs it; a test reads a result, or what was raised."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
from lane import Lane


class Log:
    def __init__(self):
        self.ran, self.running, self.most = [], 0, 0
        self.lock = threading.Lock()

    def work(self, i: int, seconds: float = 0.0) -> str:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(seconds)
        with self.lock:
            self.running -= 1
            self.ran.append((i, threading.current_thread().name))
        if i == 2:
            raise ValueError("work 2 fails")
        return f"work {i}"


def test_work_runs_in_order_in_the_background_and_a_failure_is_the_readers():
    lane, log = Lane(), Log()
    for i in range(4):
        lane.declare(str(i), partial(log.work, i))
    lane.start()
    assert lane.result("1") == "work 1"
    with pytest.raises(ValueError, match="work 2 fails"):
        lane.result("2")
    assert lane.result("3") == "work 3"
    lane.stop()
    assert log.ran == [(i, "lane") for i in range(4)]  # each once, in order


def test_a_test_runs_work_the_lane_has_not_started_and_one_piece_runs_at_a_time():
    lane, log = Lane(), Log()
    for i in (0, 1):
        lane.declare(str(i), partial(log.work, i, 0.3))
    taken = threading.Thread(target=lane.result, args=("0",), name="test")
    taken.start()
    time.sleep(0.05)  # the test is running work 0 when the lane starts
    lane.start()
    assert lane.result("1") == "work 1"
    taken.join()
    lane.stop()
    assert log.ran == [(0, "test"), (1, "lane")] and log.most == 1
