"""Heavy imports (torch and the engine) with the cyclic garbage collector off, their objects
frozen after.

Importing torch and the engine makes about 340,000 objects that live as long as the process.
With the collector on, the collections those allocations trigger scan them again and again:
the imports cost 6.5 CPU-seconds on this machine, 4.8 with the collector off
(docs/measured/history.md).
After them the objects are frozen (`gc.freeze`): no later collection scans them, so a full one
in a training loop walks only what the run made (0.3 s each otherwise), and a process forked
from this one (launcher.agent's ranks) does not write into the pages it shares by touching
their objects' collector fields, as CPython's documentation of gc.freeze advises. What the
imports left as cyclic garbage (about 10,000 small objects) is frozen with them: a full
collection to find it would cost half a second. At the interpreter's exit they are unfrozen
again (an exit that tears modules down would otherwise leave nanobind's objects, triton's,
uncollected, and it prints a warning about them). Standard library only.
"""

from __future__ import annotations

import atexit
import contextlib
import gc


@contextlib.contextmanager
def uncollected():
    """The block's imports without collections; every object alive after it frozen."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
        atexit.unregister(gc.unfreeze)  # (once)
        atexit.register(gc.unfreeze)
