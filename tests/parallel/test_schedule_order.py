"""What the engine's pipeline really runs, recorded in real gloo runs: the action lists the
planner replays (every schedule on 4 pipeline ranks, 8 micro-batches, from torch's stage methods
in schedule_order.py, compared rank by rank with launcher.plan.timeline.actions), and what FSDP
holds between micro-batches with and without pipeline.reshard_each_microbatch
(reshard_check.py)."""

from __future__ import annotations

import pytest
from group import per_rank
from jobs import mesh_job

from launcher.layout import SINGLE
from launcher.parallel.pipeline_parallel import SCHEDULE_CLASSES
from launcher.plan import timeline as tl
from parallel.schedule_order import MICROBATCHES

pytestmark = pytest.mark.dist
P = 4
ORDER = mesh_job("parallel.schedule_order:job", (P,), ("pp",), label="schedule order")
RESHARD = mesh_job("parallel.reshard_check:job", (2, 2), ("pp", "dp_shard"), label="reshard")


@pytest.fixture(scope="module")
def recorded(group):
    return per_rank(group, ORDER)


@pytest.mark.jobs(ORDER)
@pytest.mark.parametrize("schedule", list(SCHEDULE_CLASSES))
def test_engine_runs_the_planners_action_lists(recorded, schedule):
    v = 1 if schedule in SINGLE else 2
    planned = tl.actions(schedule, P, v, MICROBATCHES)
    for rank in range(P):
        ran = [tuple(a) for a in recorded[rank][schedule]]
        assert ran == list(planned[rank]), f"{schedule} rank {rank}"


@pytest.mark.jobs(RESHARD)
def test_fsdp_reshards_every_microbatch_only_when_asked(group):
    """pp=2 x dp_shard=2, 1f1b, 4 micro-batches: after each backward but the last, torch keeps
    every FSDP group gathered and every gradient unreduced; with the option, none."""
    for rank, held in per_rank(group, RESHARD).items():
        default, asked = held["false"], held["true"]
        assert len(default) == len(asked) == 4, rank
        for gathered, groups, unreduced, params in default[:-1]:
            assert gathered == groups and unreduced == params > 0, (rank, default)
        for gathered, groups, unreduced, params in asked:
            assert gathered == 0 and unreduced == 0 and groups > 0 and params > 0, (rank, asked)
