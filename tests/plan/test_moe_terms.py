"""The planner's MoE terms come from what launcher/models/moe.py runs: an `experts` term beside
compute (router, permutation traffic, grouped GEMMs at each expert's rows, autocast's casts of the
stacks), in the plan table and the JSON, and the per-expert loop priced by its launches where
no grouped kernel runs (the rule launcher/models/expert_kernel.py shares with the engine)."""

from __future__ import annotations

import json

import pytest
from conftest import compose_config
from rich.console import Console

from launcher.plan import kernels, make_plan
from launcher.plan.context import Context
from launcher.plan.report import plan_json, plan_table
from launcher.plan.terms.compute import experts_seconds, layer_costs, rank_micro


def plan_of(*overrides: str):
    return make_plan(compose_config(list(overrides)))


def test_the_experts_term_is_in_the_table_and_the_json():
    plan = plan_of("model=mixtral_debug")
    tm = plan.estimate.time
    assert tm["experts"] > 0 and tm.step == pytest.approx(sum(t.exposed for t in tm.terms))
    console = Console(width=200, record=True)
    console.print(plan_table(plan))
    text = console.export_text()
    assert "+ experts " in text and "one grouped matmul per weight stack" in text
    data = json.loads(json.dumps(plan_json(plan)))
    assert data["predicted"]["terms"]["experts"]["exposed_s"] == pytest.approx(tm["experts"])
    assert data["experts"] == {"kernel": "grouped", "why": None}
    assert plan_of("model=llama3_debug").estimate.time.term("experts") is None


def test_the_per_expert_loop_is_priced_by_its_launches_where_no_grouped_kernel_runs():
    """CUDA's grouped kernel takes bf16 only: an fp32 MoE run there loops over its experts,
    and 24 more experts per layer cost 24 x OPS_PER_EXPERT launches per MoE layer."""
    common = ["model=mixtral_debug", "hardware=h100_80g", "hardware.devices_per_node=1"]
    hosts = {}
    for precision in ("fp32", "bf16_mixed"):
        for e in (8, 32):
            cfg = compose_config([*common, f"precision={precision}", f"model.n_routed_experts={e}"])
            plan = make_plan(cfg)
            ctx, lay = plan.context, plan.layout
            layers = cfg.model.n_layers
            costs = layer_costs(ctx, lay)
            hosts[precision, e] = rank_micro(ctx, lay, costs, layers, 0, False, False)[1]
        expected = plan_json(make_plan(cfg))["experts"]
        assert expected["kernel"] == ("loop" if precision == "fp32" else "grouped")
    extra = 4 * 24 * kernels.OPS_PER_EXPERT * ctx.op_overhead
    assert hosts["fp32", 32] - hosts["fp32", 8] == pytest.approx(extra)
    assert hosts["bf16_mixed", 32] == pytest.approx(hosts["bf16_mixed", 8])
    # launcher.train prints the plan before it builds: its "experts" line is the announcement.
    looped = make_plan(compose_config([*common, "precision=fp32"]))
    console = Console(width=200, record=True)
    console.print(plan_table(looped))
    assert "one at a time, CUDA's grouped matmul takes bf16 only" in console.export_text()
    assert "takes bf16 only" in plan_json(looped)["experts"]["why"]


def test_autocast_pays_for_casting_the_stacks_and_fsdp_does_not():
    """bf16_mixed under ZeRO-1 computes under autocast over fp32 stacks (launcher/models/moe.py
    casts them each forward, and their gradients back); under FSDP the stacks arrive in bf16."""
    common = ["model=mixtral_debug", "precision=bf16_mixed", "hardware.devices_per_node=2"]
    zero1, fsdp = (plan_of(*common, f"data_parallel={dp}") for dp in ("zero1", "fsdp"))
    ctx: Context = zero1.context
    m = ctx.model
    tokens = zero1.layout.micro_batch_size * ctx.seq
    cast = 3 * m.n_routed_experts * m.dim * m.moe_ffn_dim * 2 * (4 + 2) / ctx.memory_bw
    assert experts_seconds(ctx, zero1.layout, tokens) - experts_seconds(
        fsdp.context, fsdp.layout, tokens
    ) == pytest.approx(cast)
