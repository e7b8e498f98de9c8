"""The planner's context-parallel terms on Llama 3 405B's long-context layout (TP8 CP16 PP16 DP8,
seq 131072, docs/sources.md, published layouts). The bytes themselves are held to a recorded run in
tests/parallel/test_cp_bytes.py; here: their scale at 405B, and how much of them each method
exposes."""

from __future__ import annotations

import pytest
from conftest import compose_config

from launcher.plan import make_plan
from launcher.plan.estimate import layer_activation
from launcher.plan.terms.cp import cp_bytes_sent, cp_layer_time

SEQ, CP, TP, KV_WIDTH = 131072, 16, 8, 8 * 128  # 8 kv heads of 128


def plan_128k(method: str):
    plan = make_plan(compose_config(["recipe=llama3_405b_16384gpu_ctx128k", f"context={method}"]))
    assert plan.valid, plan.errors
    return plan


@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_only_the_local_kv_heads_travel(method):
    """Each rank sends its 8192 tokens of its one kv head (of 8, over tp 8), K and V, bf16, to
    the 15 other cp ranks; backward sends as much again, plus the forward's rerun under full
    recompute, plus for the ring 16 hops of fp32 dK/dV."""
    plan = plan_128k(method)
    local = SEQ // CP * 2 * KV_WIDTH // TP * 2  # bytes of K and V this rank holds: 4 MiB
    forward, backward = cp_bytes_sent(plan.context, plan.layout)
    assert forward == (CP - 1) * local
    ring = CP * local * 2 if method == "ring" else 0
    assert backward == 2 * (CP - 1) * local + ring


def test_allgather_is_all_exposed_and_small_next_to_attention():
    """Llama 3 (section 3.3.2) exposes the all-gather: attention is O(S^2), the K/V O(S)."""
    plan = plan_128k("allgather")
    ctx, lay = plan.context, plan.layout
    forward, backward = cp_bytes_sent(ctx, lay)
    exposed = cp_layer_time(ctx, lay)
    # Three all-gathers' worth (forward, the gradients' reduce-scatter, the rerun under
    # per-op recompute), each with its start-up and 15 steps across nodes (one rank per node).
    latency = ctx.links.base_latency + (CP - 1) * ctx.links.inter_hop
    assert exposed == pytest.approx((forward + backward) / ctx.inter + 3 * latency)
    tokens = SEQ // CP
    attention = tokens * ctx.attn_core_flops / TP / ctx.attention_rate  # forward + backward
    assert exposed < 0.2 * attention


def test_ring_hides_each_hop_behind_one_block():
    """Each K/V hop (84 us at 50 GB/s) is shorter than the block attended meanwhile: only the
    accumulators' last hop home is exposed. With no compute to hide behind, all of it is."""
    plan = plan_128k("ring")
    ctx, lay = plan.context, plan.layout
    hop_latency = ctx.links.base_latency + ctx.links.inter_hop
    last_hop = SEQ // CP * 2 * KV_WIDTH // TP * 4 / ctx.inter + hop_latency  # fp32 dK/dV
    assert cp_layer_time(ctx, lay) == pytest.approx(last_hop)
    forward, backward = cp_bytes_sent(ctx, lay)
    ctx.attention_rate = float("inf")
    # Every message exposed: 15 K/V hops forward, again for the rerun and in backward, and 16
    # accumulator hops.
    messages = 3 * (CP - 1) + CP
    exposed = (forward + backward) / ctx.inter + messages * hop_latency
    assert cp_layer_time(ctx, lay) == pytest.approx(exposed)


def test_allgather_keeps_the_gathered_kv_and_nothing_else():
    """Both methods save the same per-token tensors except the gathered K/V: allgather keeps
    15 more kv heads' worth at 128K (no mask: its blocks run in the same kernels as the ring's),
    and under full recompute neither keeps anything of the core."""
    ring, allgather = (plan_128k(m) for m in ("ring", "allgather"))
    per_token = {
        p.cfg.context.method.value: layer_activation(p.context, p.layout, True, "none")
        for p in (ring, allgather)
    }
    s = allgather.context.shape
    gathered = (CP - 1) * (s.k_width + s.v_width) / TP * 2
    assert per_token["allgather"] - per_token["ring"] == gathered
    assert layer_activation(allgather.context, allgather.layout, True, "full") == (
        layer_activation(ring.context, ring.layout, True, "full")
    )
