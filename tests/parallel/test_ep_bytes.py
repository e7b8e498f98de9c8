"""The planner's expert-parallel traffic is what a real training step sends (ep_bytes.py)."""

from __future__ import annotations

import pytest
from group import Job, per_rank

pytestmark = pytest.mark.dist


def case(n: int, *layout: str) -> Job:
    overrides = ("model=mixtral_debug", f"hardware.devices_per_node={n}", *layout)
    return Job("parallel.ep_bytes:job", n, overrides)


CASES = {
    "ep=2": case(2, "parallel.ep=2"),
    # ep borrows the tp pair, each tp rank routes half the tokens; full recompute runs the
    # forward all-to-alls once more in backward.
    "tp=2 x ep=2, recompute=full": case(4, "parallel.tp=2", "parallel.ep=2", "recompute=full"),
}


@pytest.mark.parametrize("job", list(CASES.values()), ids=list(CASES))
def test_all_to_all_bytes_equal_the_planner(job, group):
    for rank, out in per_rank(group, job).items():
        assert out["planned"] > 0
        assert out["sent"] == pytest.approx(out["planned"], rel=1e-9), f"rank {rank}: {out}"
