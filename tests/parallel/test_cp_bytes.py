"""What context parallelism costs one rank, measured on the engine's own CP (cp_bytes.py, jobs
of tests/group.py: cp = 2 on 2 processes; cp = 4, and cp = 2 x tp = 2 with and without sequence
parallelism, on 4), against the planner: the bytes a block keeps for backward per local token
(`layer_activation`) and the bytes a rank sends per layer, forward and backward (`cp_bytes_sent`),
for both methods and every recompute mode.

Sent bytes must match exactly: the planner counts the K/V tensors the engine sends. Both leave
out the key positions (an all-gather of 8 bytes per position), checked here to stay under 2%.

Saved bytes, tolerance 0.75%: as in test_saved_activations.py the planner leaves out what is
per head or per token rather than per channel: the log-sum-exp (H / tp fp32 values per token,
SDPA's or the ring's), each RMSNorm's 1/rms (one fp32 value per token) and the ring's gathered
key positions (8 cp / B bytes per token), at most 56 bytes of llama3_debug's ~10 kB (0.55%).
The smallest CP term the planner models, allgather's gathered K/V at cp = 2, is 5% or more; a
second copy of the attention output (what the cores kept before they returned it in the
layout the output projection takes as a view) would be about 5%.
"""

from __future__ import annotations

import pytest
from conftest import compose_config
from group import per_rank
from jobs import mesh_job

from launcher.plan import make_plan
from launcher.plan.estimate import layer_activation
from launcher.plan.terms.cp import cp_bytes_sent
from parallel import saved_bytes

SETTINGS = [(2, 1, False), (4, 1, False), (2, 2, False), (2, 2, True)]  # (cp, tp, sp)
SETTING_IDS = ["cp=2", "cp=4", "cp=2 tp=2", "cp=2 tp=2 sp"]
METHODS = ("allgather", "ring")
RECOMPUTE = ("none", "selective", "full")  # cp_bytes.RECOMPUTE
JOBS = [mesh_job("parallel.cp_bytes:job", (n,), ("cp",), label=f"cp_bytes {n}") for n in (2, 4)]
pytestmark = [pytest.mark.dist, pytest.mark.jobs(*JOBS)]


def planned(cp: int, tp: int, sp: bool, method: str, recompute: str):
    cfg = compose_config(
        [
            # The block cp_bytes.py measures: one llama3_debug layer, fp32, fused attention.
            "model=llama3_debug",
            "model.n_layers=1",
            f"model.max_seq_len={saved_bytes.SEQ}",
            f"train.seq_len={saved_bytes.SEQ}",
            "precision=fp32",
            f"recompute={recompute}",
            f"parallel.tp={tp}",
            "parallel.dp_shard=1",
            f"tensor.sequence_parallel={str(sp).lower()}",
            f"train.micro_batch_size={saved_bytes.BATCH}",
            f"train.global_batch_size={saved_bytes.BATCH}",
            f"hardware.devices_per_node={cp * tp}",
            f"parallel.cp={cp}",
            f"context={method}",
        ]
    )
    plan = make_plan(cfg)
    assert plan.valid, plan.errors
    return plan.context, plan.layout


@pytest.fixture(scope="module")
def measured(group):
    """{(cp, tp, sp, method, recompute): [row of each rank]}, one job per world size."""
    rows: dict[tuple, list[dict]] = {}
    for job in JOBS:
        for rank_rows in per_rank(group, job).values():
            for r in rank_rows:
                key = (r["cp"], r["tp"], r["sp"], r["method"], r["recompute"])
                rows.setdefault(key, []).append(r)
    return rows


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("cp", "tp", "sp"), SETTINGS, ids=SETTING_IDS)
def test_saved_bytes_match_planner(measured, cp, tp, sp, method, recompute):
    ctx, lay = planned(cp, tp, sp, method, recompute)
    want = layer_activation(ctx, lay, True, recompute)
    got = [r["bytes_per_token"] for r in measured[(cp, tp, sp, method, recompute)]]
    assert len(got) == cp * tp
    assert got == pytest.approx([want] * len(got), rel=0.0075)


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("cp", "tp", "sp"), SETTINGS, ids=SETTING_IDS)
def test_sent_bytes_match_planner(measured, cp, tp, sp, method, recompute):
    ctx, lay = planned(cp, tp, sp, method, recompute)
    forward, backward = cp_bytes_sent(ctx, lay)
    for r in measured[(cp, tp, sp, method, recompute)]:
        sent = r["sent"]
        assert [sent["forward"]["kv"], sent["backward"]["kv"]] == [forward, backward], r
        positions = sent["forward"]["positions"] + sent["backward"]["positions"]
        assert positions < 0.02 * (forward + backward), r


@pytest.mark.parametrize("method", METHODS)
def test_only_the_local_kv_heads_travel(measured, method):
    """Under tp = 2 each rank holds, and sends, half of the kv heads."""
    one, two = (measured[(2, tp, False, method, "none")][0]["sent"] for tp in (1, 2))
    for phase in ("forward", "backward"):
        assert two[phase]["kv"] * 2 == one[phase]["kv"]
