"""A second line of the session's own work, run in a background thread beside its tests.

The session runs its tests one at a time, and a test that waits on its processes' start-up or
on another process leaves a core idle (docs/testing.md). Work that only runs commands and whose
result a test reads later can run beside them: the docs' example blocks (each a bash script of
CLI runs, five minutes of the session in all) are the lane's work.

- Work is declared at collection, as the `lane(key, fn)` marker of the test that reads it (conftest
  adds the selected tests' work in their order). The lane starts with the session's first test
  and calls each `fn()` in turn, at the groups' priority (tests/group.py GROUP_NICE: a thread's
  nice value is its own on Linux, and the processes it starts inherit it); `result(key)` waits
  for that work and returns what `fn` returned, or raises what it raised.
- Work the lane runs must not touch what the session's tests read (the repository's files, a
  path a test uses): it runs while they do.
- Without `start` (a module run alone), `result` calls the work itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from group import GROUP_NICE


class Lane:
    def __init__(self, nice: int = GROUP_NICE):
        self.nice = nice
        self.work: dict[str, Callable] = {}  # declared, in order
        self.done: dict[str, tuple[object, BaseException | None]] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def declare(self, key: str, fn: Callable) -> None:
        with self._cv:
            self.work.setdefault(key, fn)

    def start(self) -> None:
        with self._cv:
            if self._thread is None and self.work:
                self._thread = threading.Thread(target=self._drain, name="lane", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Start no more work; wait for the work running now (its processes end with it)."""
        self._stopping = True
        if self._thread is not None:
            self._thread.join()

    def result(self, key: str):
        with self._cv:
            while self._thread is not None and key in self.work and key not in self.done:
                self._cv.wait(timeout=1.0)
        if key not in self.done:
            self._call(key)
        value, error = self.done[key]
        if error is not None:
            raise error
        return value

    def _drain(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        try:
            for key in list(self.work):
                if self._stopping:
                    return
                self._call(key)
        finally:
            with self._cv:
                self._thread = None
                self._cv.notify_all()

    def _call(self, key: str) -> None:
        try:
            value, error = self.work[key](), None
        except Exception as e:  # raised again in the test that reads it
            value, error = None, e
        with self._cv:
            self.done[key] = (value, error)
            self._cv.notify_all()
