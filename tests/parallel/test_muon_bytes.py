"""The planner's Muon term counts what a real step exchanges and orthogonalises (muon_bytes.py):
over the ranks, the bytes sent equal the planner's per-rank figure times the ranks, and the
Newton-Schulz FLOPs its matrices' once each; the most-loaded owner within the greedy split's
bound (4/3 of the planner's share, itself no less than the largest matrix)."""

from __future__ import annotations

import pytest
from group import Job, per_rank

pytestmark = pytest.mark.dist

MUON = ("optimizer=muon", "optimizer.ns_dtype=fp32")


def case(n: int, model: str, *layout: str) -> Job:
    overrides = (f"model={model}", *MUON, f"hardware.devices_per_node={n}", *layout)
    return Job("parallel.muon_bytes:job", n, overrides)


CASES = {
    "fsdp dp_shard=2": case(2, "llama3_debug"),
    "fsdp dp_shard=2 x tp=2": case(4, "llama3_debug", "parallel.tp=2"),
    "hsdp 2x2": case(4, "llama3_debug", "parallel.dp_replicate=2", "parallel.dp_shard=2"),
    "ddp 2": case(2, "llama3_debug", "data_parallel=ddp", "parallel.dp_replicate=2",
                  "parallel.dp_shard=1"),
    "zero1 x tp=2": case(4, "llama3_debug", "data_parallel=zero1", "parallel.tp=2"),
    "mixtral ep=2": case(2, "mixtral_debug", "parallel.ep=2"),
    "mixtral dp_shard=4 ep=2": case(4, "mixtral_debug", "parallel.ep=2"),
}  # fmt: skip


@pytest.mark.parametrize("job", list(CASES.values()), ids=list(CASES))
def test_exchanged_bytes_and_newton_schulz_work_are_the_planners(job, group):
    ranks = per_rank(group, job)
    planned = ranks[0]["planned"]
    assert all(out["planned"] == planned for out in ranks.values())
    world = job.nproc
    assert sum(out["sent"] for out in ranks.values()) == pytest.approx(
        world * sum(s["sent"] for s in planned), rel=1e-9
    )
    assert sum(out["flops"] for out in ranks.values()) == pytest.approx(
        sum(s["flops"] * world / s["workers"] for s in planned), rel=1e-9
    )
    share = sum(max(s["flops"] / s["workers"], s["largest"]) for s in planned)
    for rank, out in ranks.items():
        assert out["flops"] <= 4 / 3 * share, f"rank {rank}: {out['flops']} against {share}"
