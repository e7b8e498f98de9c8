"""The action lists the planner replays are the ones the engine runs: every schedule on 4
pipeline ranks, 8 micro-batches, recorded from torch's stage methods in a real gloo run
(schedule_order.py) and compared, rank by rank, with launcher.plan.timeline.actions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from launcher.parallel.pipeline import SCHEDULES
from launcher.plan import pipeline as pl
from launcher.plan import timeline as tl
from parallel.schedule_order import MICROBATCHES

pytestmark = pytest.mark.dist
P = 4


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("schedule_order")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={P}",
            str(ROOT / "tests" / "parallel" / "schedule_order.py"),
            str(out),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return {r: json.loads((out / f"{r}.json").read_text()) for r in range(P)}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_engine_runs_the_planners_action_lists(recorded, schedule):
    v = 1 if schedule in pl.SINGLE else 2
    planned = tl.actions(schedule, P, v, MICROBATCHES)
    for rank in range(P):
        ran = [tuple(a) for a in recorded[rank][schedule]]
        assert ran == list(planned[rank]), f"{schedule} rank {rank}"
