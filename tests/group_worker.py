"""One rank of a long-lived process group that runs many test jobs in turn (tests/group.py).

Run under torchrun: `group_worker.py JOBS.json`. JOBS.json lists jobs (`target` "module:function"
importable from tests/, `args`, `out`); every rank runs each job in order, skipping those already
done or failed by an earlier launch, then waits for the others (a barrier) before the next.

A job is `function(out: Path, *args)` running on every rank inside the group, which exists before
the first job: it builds its own meshes over it (launcher.runtime.distributed.init builds the
layout's mesh over a group that already exists). What a job prints goes to OUT/log.RANK.txt.

A job that raises on any rank writes OUT/error.RANK.txt and ends this process at once: torchrun
then ends the other ranks (which may be waiting for the failed one inside a collective), and the
driver reports that job failed and starts the group again for the jobs after it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

TESTS = Path(__file__).resolve().parent
DONE, FAILED = ".done", ".failed"


def run_job(job: dict, rank: int) -> float:
    """Run one job on this rank, its output captured in its directory; its seconds."""
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    module, name = job["target"].split(":")
    function = getattr(importlib.import_module(module), name)
    start = time.perf_counter()
    with (
        open(out / f"log.{rank}.txt", "a") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        function(out, *job["args"])
    return time.perf_counter() - start


def forget_groups(keep: set) -> None:
    """Destroy every process group but those in `keep` (the default group), and DTensor's
    caches, whose entries name the destroyed groups' meshes (a later mesh of the same shape is
    equal to them, so a cached plan would run on a destroyed group)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor.debug import (
        _clear_fast_path_sharding_prop_cache,
        _clear_python_sharding_prop_cache,
    )

    for pg in [g for g in _world.pg_map if g not in keep]:
        dist.destroy_process_group(pg)
    _clear_python_sharding_prop_cache()
    _clear_fast_path_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


def main(jobs_file: Path) -> None:
    # The repository first (tests/models would shadow the `models` package), then tests/ for
    # the jobs' modules.
    sys.path[:] = [str(TESTS.parent), *(p for p in sys.path if Path(p).resolve() != TESTS)]
    sys.path.append(str(TESTS))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from launcher.runtime.imports import uncollected

    # The imports' objects live as long as the group: frozen, so that a full collection (the
    # automatic ones, and the one after each job) scans only what the jobs made (0.3 CPU-s a
    # collection otherwise; with a job composed once, tests/jobs.py: a tenth of a group's CPU).
    with uncollected():
        import torch
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _world

        import launcher.training.engine  # noqa: F401  (what every training job imports)

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    jobs = json.loads(jobs_file.read_text())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        # A collective stuck on a dead peer gives up after this; the driver's own limit per
        # job (group.py) ends a hung group sooner.
        dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    for job in jobs:
        out = Path(job["out"])
        if (out / DONE).exists() or (out / FAILED).exists():
            continue
        groups = set(_world.pg_map)  # the default group (none on one process)
        try:
            seconds = run_job(job, rank)
            if world > 1:
                dist.barrier()
        except BaseException:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"error.{rank}.txt").write_text(traceback.format_exc())
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)
        # The job's meshes' groups go with it: every gloo group keeps three threads, and jobs
        # ran several times slower in a group that had gathered a few hundred of them.
        forget_groups(groups)
        gc.collect()
        gc.freeze()  # what outlived the job is the group's (caches)
        if rank == 0:
            (out / DONE).write_text(json.dumps({"seconds": round(seconds, 3)}))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
