"""`profile.steps` / `profile.memory`: torch.profiler around chosen training steps.

Each profiled step leaves RUN_DIR/profile/step_NNNNNNNN/rank_R.json (a Chrome / Perfetto trace
per rank) and, with profile.memory, a memory record per rank: on CPU the profiler's memory
timeline (rank_R_memory.json: allocated bytes against time, and the peak), on CUDA the
caching allocator's snapshot (rank_R_memory.pickle, for pytorch.org/memory_viz).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path


def resumed_past(steps, start: int) -> str | None:
    """The warning for profile.steps a run resumed at `start` has already trained (they would
    pass without a word), or None."""
    done = sorted(s for s in steps if s <= start)
    if not done:
        return None
    return (
        f"warning: profile.steps={sorted(steps)}: {done} trained before step {start}, where "
        "this run resumes, so not profiled (name later steps to profile them)"
    )


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "profile" / f"step_{step:08d}"


@contextlib.contextmanager
def profiled(step: int, cfg, run_dir: str | Path, rank: int, cuda: bool):
    """Profile the block when `step` is one of cfg.steps (a ProfileConfig); else nothing."""
    if step not in cfg.steps:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    # Kineto (read when the profiler starts) writes a "USDT:" line to stderr at each start and
    # stop of every rank's profiler; 6 is above its every level. KINETO_LOG_LEVEL set by the
    # user wins.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    out = step_dir(run_dir, step)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda and cfg.memory:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    with profile(activities=activities, profile_memory=cfg.memory) as prof:
        yield
    trace = out / f"rank_{rank}.json"
    memory = out / f"rank_{rank}_memory.{'pickle' if cuda else 'json'}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        if cfg.memory and cuda:
            torch.cuda.memory._dump_snapshot(str(memory))
        elif cfg.memory:
            memory.write_text(json.dumps(memory_timeline(trace)))
    except OSError as e:  # a full or read-only disk: the profile is lost, not the run
        for path in (trace, memory):
            with contextlib.suppress(OSError):
                path.unlink()
        print(
            f"warning: rank {rank}: the profile of step {step} could not be written to {out}: "
            f"{e.strerror or e}; training goes on",
            file=sys.stderr,
            flush=True,
        )
        return
    finally:
        if cfg.memory and cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
    if rank == 0:
        print(f"profiled step {step}: {out} (a trace per rank)", flush=True)


def memory_timeline(trace: Path) -> dict:
    """The CPU allocator's allocated bytes over the step, from the profiler's memory events in
    its trace (each allocation and free carries the running total). torch's own
    export_memory_timeline is deprecated and fails its internal checks on FSDP's steps."""
    events = json.loads(trace.read_text())["traceEvents"]
    points = sorted(
        (e["ts"], e["args"]["Total Allocated"])
        for e in events
        if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0
    )
    start = points[0][0] if points else 0.0
    return {
        "device": "cpu",
        "time_us": [round(ts - start, 3) for ts, _ in points],  # from the first event
        "allocated_bytes": [b for _, b in points],
        "peak_bytes": max((b for _, b in points), default=0),
    }
