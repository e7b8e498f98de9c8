"""A job of tests/group.py: each rank's resident memory from start to its first forward, and
over a whole (one-step) run, beside the planner's figures for that rank.

`job(OUT, CASE, ...)`: first glibc is told to serve every allocation of 1 MiB or more by its own
mapping, unmapped when freed (mallopt's M_MMAP_THRESHOLD, fixed; M_TRIM_THRESHOLD likewise), so
that the resident set follows the bytes the engine holds rather than what malloc's heaps keep
after a free (with the default, dynamic threshold the peaks of the same run differ by 100 MB and
more between ranks). Then for each case (space-separated overrides) in turn, on this group: the
memory freed by the jobs before it is handed back to the system (malloc_trim) and the peak
resident set reset (/proc/self/clear_refs, 5); then the engine's Trainer is built (the meta
build, each rank materialising its share) and the peak read (`start`); the run trains and the
peak is read again (`run`). Writes OUT/RANK.json: {case: {"start": bytes above the resident
set before the build, "run": the same over the run, "planned": the planner's figure for this
rank without its reserve (states, activations, the gathered blocks and the loss's logits)}}.
At its end the thresholds are set to the largest the dynamic ones grow to (32 MiB, and twice that
to trim): with 1 MiB every later job of the group would map and unmap its tensors.
"""

from __future__ import annotations

import ctypes
import gc
import json
from pathlib import Path

import torch.distributed as dist
from jobs import trainer_of

from launcher.plan.estimate import layout_ranks, rank_memory
from launcher.runtime.failures import NoStops


def status(key: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


LIBC = ctypes.CDLL("libc.so.6")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64 bits


def fresh_peak() -> int:
    """Give freed memory back, reset the peak resident set; the resident set now."""
    gc.collect()
    LIBC.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return status("VmRSS")


def job(out: Path, *cases: str) -> None:
    for option in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD):
        assert LIBC.mallopt(option, 1 << 20) == 1, f"mallopt({option}) refused"
    result = {}
    for i, case in enumerate(cases):
        dist.barrier()
        (out / str(i)).mkdir(exist_ok=True)
        before = fresh_peak()
        _, d, trainer = trainer_of(out / str(i), case.split())
        start = status("VmHWM") - before
        trainer.train(NoStops())
        run = status("VmHWM") - before
        ctx, lay = trainer.plan.context, trainer.plan.layout
        pp_rank = d.local_rank_of("pp")
        m = rank_memory(ctx, lay, pp_rank, *layout_ranks(ctx, lay)[pp_rank])
        planned = m.total - ctx.reserve  # states, activations and their transients
        result[case] = {"start": start, "run": run, "planned": planned}
        del trainer
    (out / f"{dist.get_rank()}.json").write_text(json.dumps(result))
    LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
    LIBC.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_MAX)
