"""What the engine's pipeline really runs, recorded in real gloo runs: the action lists the
planner replays (every schedule on 4 pipeline ranks, 8 micro-batches, from torch's stage methods
in schedule_order.py, compared rank by rank with launcher.plan.timeline.actions), and what FSDP
holds between micro-batches with and without pipeline.reshard_each_microbatch
(reshard_check.py)."""

from __future__ import annotations

import pytest
from conftest import ROOT, torchrun

from launcher.layout import SINGLE
from launcher.parallel.pipeline import SCHEDULE_CLASSES
from launcher.plan import timeline as tl
from parallel.schedule_order import MICROBATCHES

pytestmark = pytest.mark.dist
P = 4


def run_script(script: str, out) -> dict[int, dict]:
    """Run tests/parallel/SCRIPT on P processes; each rank's JSON."""
    return torchrun(ROOT / "tests" / "parallel" / script, P, out)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    return run_script("schedule_order.py", tmp_path_factory.mktemp("schedule_order"))


@pytest.mark.parametrize("schedule", list(SCHEDULE_CLASSES))
def test_engine_runs_the_planners_action_lists(recorded, schedule):
    v = 1 if schedule in SINGLE else 2
    planned = tl.actions(schedule, P, v, MICROBATCHES)
    for rank in range(P):
        ran = [tuple(a) for a in recorded[rank][schedule]]
        assert ran == list(planned[rank]), f"{schedule} rank {rank}"


def test_fsdp_reshards_every_microbatch_only_when_asked(tmp_path):
    """pp=2 x dp_shard=2, 1f1b, 4 micro-batches: after each backward but the last, torch keeps
    every FSDP group gathered and every gradient unreduced; with the option, none."""
    for rank, held in run_script("reshard_check.py", tmp_path).items():
        default, asked = held["false"], held["true"]
        assert len(default) == len(asked) == 4, rank
        for gathered, groups, unreduced, params in default[:-1]:
            assert gathered == groups and unreduced == params > 0, (rank, default)
        for gathered, groups, unreduced, params in asked:
            assert gathered == 0 and unreduced == 0 and groups > 0 and params > 0, (rank, asked)
