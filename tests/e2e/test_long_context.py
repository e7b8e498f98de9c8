"""The long-context recipe (llama3_debug at 4,096 tokens, ring attention): the bytes a rank keeps
for backward fall with cp as the planner says. Measured on the real Trainer (long_context.py,
jobs of tests/group.py) at cp = 1, 2 and 4, each held to the planner's activations plus the
logits it books under `other` (tokens x vocab x (4 + 4) bytes in fp32: the logits and their fp32
log-softmax), within 2%. The planner leaves out per-token scalars (each RMSNorm's 1/rms, the
attention log-sum-exp: about 0.3% here) and the (S / cp, E) RoPE angles looked up once.
"""

from __future__ import annotations

import pytest
from group import Job, per_rank

VOCAB = 320  # llama3_debug
JOBS = {
    cp: Job(
        "e2e.long_context:job",
        cp,
        (f"parallel.cp={cp}", f"hardware.devices_per_node={cp}"),
        f"long context cp={cp}",
    )
    for cp in (1, 2, 4)
}
pytestmark = [pytest.mark.dist, pytest.mark.e2e, pytest.mark.jobs(*JOBS.values())]


@pytest.fixture(scope="module")
def measured(group):
    return {cp: per_rank(group, job) for cp, job in JOBS.items()}


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_saved_bytes_per_rank_match_the_planner(measured, cp):
    for rank, r in measured[cp].items():
        assert r["tokens"] == 4096 // cp, (rank, r)
        planned = r["planned_activations"] + r["tokens"] * VOCAB * 8
        assert r["saved_bytes"] == pytest.approx(planned, rel=0.02), (rank, r, planned)


def test_activation_memory_falls_with_cp(measured):
    """Close to 1 / cp: what does not shrink (each rank's K/V blocks in flight, a few tensors
    per rank rather than per token) stays under 10% here."""
    one = measured[1][0]["saved_bytes"]
    for cp in (2, 4):
        worst = max(r["saved_bytes"] for r in measured[cp].values())
        assert worst < one / cp * 1.1, (cp, worst, one)
