"""A second line of the session's own work, run in a background thread beside its last tests.

Once the groups (tests/group.py) have run every job, the session's tests run one at a time,
and a test that waits on its processes' start-up, on SLURM or on a restart leaves a core idle
(docs/testing.md). Work that only runs commands, and whose result a test reads, can run beside
them: the docs' example blocks (each a bash script of CLI runs, five minutes of the session in
all) are the lane's work.

- Work is declared at collection, as the `lane(key, fn)` marker of the test that reads it
  (conftest adds the selected tests' work in their order, and runs those tests last). conftest
  starts the lane when the groups are done; it calls each `fn()` in turn. `result(key)` waits
  for that work and returns what `fn` returned, or raises what it raised; asked before the lane
  started, the test calls the work itself.
- One piece of work runs at a time, whoever runs it, in the order declared (two blocks of a page
  may share a directory). Work the lane runs must not touch what the session's other tests read
  (the repository's files, a path a test uses): it runs while they do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Lane:
    def __init__(self):
        self.work: dict[str, Callable] = {}  # declared, in order
        self.done: dict[str, tuple[object, Exception | None]] = {}
        self._taken: set[str] = set()  # running or done
        self._cv = threading.Condition()
        self._one = threading.Lock()  # held while a piece of work runs
        self._thread: threading.Thread | None = None
        self._stopping = False

    def declare(self, key: str, fn: Callable) -> None:
        with self._cv:
            self.work.setdefault(key, fn)

    def start(self) -> None:
        with self._cv:
            if self._thread is None and not self._stopping and self.work:
                self._thread = threading.Thread(target=self._drain, name="lane", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Start no more work; wait for the work running now (its processes end with it)."""
        with self._cv:
            self._stopping = True
            thread = self._thread
        if thread is not None:
            thread.join()

    def result(self, key: str):
        with self._cv:
            while key not in self.done:
                if self._thread is None and key not in self._taken:  # the test's, then
                    self._taken.add(key)
                    break
                self._cv.wait(timeout=1.0)
        if key not in self.done:
            self._call(key)
        value, error = self.done[key]
        if error is not None:
            raise error
        return value

    def _drain(self) -> None:
        try:
            while True:
                with self._cv:
                    key = next((k for k in self.work if k not in self._taken), None)
                    if key is None or self._stopping:
                        return
                    self._taken.add(key)
                self._call(key)
        finally:
            with self._cv:
                self._thread = None
                self._cv.notify_all()

    def _call(self, key: str) -> None:
        with self._one:
            try:
                value, error = self.work[key](), None
            except Exception as e:  # raised again in the test that reads it
                value, error = None, e
        with self._cv:
            self.done[key] = (value, error)
            self._cv.notify_all()
