"""The planner's pipeline formulas against the schedules' own action lists, and the drawing.

launcher/plan/timeline.py replays the action lists torch's schedule classes build (the ones the
engine runs; tests/parallel/test_schedule_order.py records them from a real run) on the unit
clock. The planner's closed forms (launcher/plan/bubble.py, from the papers) must give the
same bubble and the same per-rank activation peak for every valid shape.
"""

from __future__ import annotations

import json
from collections import Counter

import matplotlib.image
import numpy as np
import pytest
from conftest import compose_config, run_cli

from launcher.layout import LOOPED, SINGLE, V_SCHEDULES, rank_stages
from launcher.plan import bubble as pl
from launcher.plan import engine_plan, make_plan
from launcher.plan import timeline as tl
from launcher.plan.draw import BUBBLE, COLOURS, draw_plan


def shapes(schedule: str):
    """Every (p, v, m) the rules let through, p up to 8 and m up to 4p."""
    for p in (2, 3, 4, 8):
        for v in (1,) if schedule in SINGLE else (2,) if schedule in V_SCHEDULES else (2, 3):
            for m in range(p, 4 * p + 1):
                if schedule in LOOPED and m % p:
                    continue
                if schedule == "dualpipev" and m < p * v:
                    continue
                yield p, v, m


@pytest.mark.parametrize("schedule", SINGLE + LOOPED + V_SCHEDULES)
def test_planner_bubble_and_inflight_match_the_action_lists(schedule):
    checked = 0
    for p, v, m in shapes(schedule):
        t = tl.simulate(schedule, p, v, m)
        where = f"{schedule} p={p} v={v} m={m}"
        assert t.bubble_fraction == pytest.approx(pl.bubble_fraction(schedule, p, v, m)), where
        for r in range(p):
            assert t.peak_inflight(r) == pytest.approx(
                pl.inflight_microbatches(schedule, p, v, m, r)
            ), f"{where} rank {r}"
        checked += 1
    assert checked >= 12


@pytest.mark.parametrize("schedule", SINGLE + LOOPED + V_SCHEDULES)
def test_action_lists_run_every_piece_once_on_its_rank(schedule):
    p, v, m = 4, 1 if schedule in SINGLE else 2, 8
    orders = tl.actions(schedule, p, v, m)
    done = Counter()
    for rank, acts in orders.items():
        for kind, stage, mb in acts:
            assert stage in rank_stages(rank, p, v, schedule)
            done[kind, stage, mb] += 1
    assert set(done.values()) == {1}
    for stage in range(p * v):
        for mb in range(m):
            kinds = {k for k, s, i in done if (s, i) == (stage, mb)}
            assert kinds in ({"F", "B"}, {"F", "I", "W"}), (stage, mb, kinds)
    split = {k for k, _, _ in done} & {"I", "W"}
    assert bool(split) == (schedule in ("interleaved_zb", "zbv", "dualpipev"))


def test_zero_bubble_and_interleaving_beat_1f1b():
    """What docs/parallelism.md's schedule section claims, on the same p and m."""
    p, m = 8, 16
    bubble = {s: tl.simulate(s, p, 1 if s in SINGLE else 2, m).bubble_fraction for s in
              SINGLE + LOOPED + V_SCHEDULES}  # fmt: skip
    assert bubble["gpipe"] == bubble["1f1b"] == pytest.approx(7 / 16)
    assert bubble["interleaved_1f1b"] == pytest.approx(bubble["1f1b"] / 2)
    assert bubble["interleaved_zb"] == pytest.approx(bubble["interleaved_1f1b"] / 3)
    assert bubble["zbv"] == pytest.approx(bubble["dualpipev"]) == pytest.approx(7 / 96)


def pipeline_plan(schedule: str):
    v = 1 if schedule in SINGLE else 2
    cfg = compose_config(
        [
            "hardware.devices_per_node=4",
            "parallel.pp=4",
            "parallel.dp_shard=1",
            "model.n_layers=8",
            f"pipeline={schedule}",
            f"pipeline.stages_per_rank={v}",
            "train.global_batch_size=32",
        ]
    )
    plan = make_plan(cfg)
    assert plan.ok, plan.errors
    return plan


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])
def test_drawing_bubble_equals_the_planners(schedule, tmp_path):
    plan = pipeline_plan(schedule)
    drawing = draw_plan(plan, tmp_path / f"{schedule}.png")
    assert drawing.bubble_fraction == pytest.approx(plan.estimate.time.bubble_fraction)
    assert drawing.bubble_fraction == pytest.approx(3 / 8 if schedule == "gpipe" else 3 / 16)
    pixels = matplotlib.image.imread(drawing.path)[..., :3]
    colours = {tuple(np.round(c * 255).astype(int)) for c in pixels.reshape(-1, 3)}
    hex_of = lambda h: tuple(int(h[i : i + 2], 16) for i in (1, 3, 5))  # noqa: E731
    assert hex_of(BUBBLE) in colours and hex_of(COLOURS["F"]) in colours
    assert hex_of(COLOURS["B"]) in colours


DRAWN = [
    "hardware.devices_per_node=4",
    "parallel.pp=4",
    "parallel.dp_shard=1",
    "model.n_layers=8",
    "pipeline=interleaved_1f1b",
    "train.global_batch_size=32",
]


@pytest.mark.e2e
def test_plan_draw_cli(tmp_path):
    """The command end to end: the drawing written and named in the JSON (its refusals are
    bad-input cases: tests/e2e/bad_inputs.py)."""
    out = run_cli("launcher.plan", *DRAWN, f"plan.draw={tmp_path / 's.png'}", "plan.format=json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["drawing"]["bubble_fraction"] == pytest.approx(got["predicted"]["bubble_fraction"])
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plans_drawing_line(tmp_path):
    """What the text plan prints after a drawing, and for a plan without a pipeline."""
    from launcher.plan.__main__ import draw

    drawing, note = draw(engine_plan(compose_config(DRAWN)), str(tmp_path / "s.svg"))
    assert "bubble 18.8% of compute" in note and drawing.path.exists()
    flat, note = draw(engine_plan(compose_config([])), str(tmp_path / "none.png"))
    assert flat is None and "nothing drawn, pp=1" in note and not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("schedule", SINGLE + LOOPED + V_SCHEDULES)
def test_inflight_is_monotone_in_the_rank(schedule):
    """evaluate() relies on it to compare only the ends of each group of equally loaded ranks."""
    for p, v, m in shapes(schedule):
        held = [pl.inflight_microbatches(schedule, p, v, m, r) for r in range(p)]
        assert held == sorted(held) or held == sorted(held, reverse=True), (p, v, m, held)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=llama3_405b", "parallel.pp=8", "pipeline=zbv", "train.global_batch_size=80"],
        ["model=llama3_405b", "parallel.pp=16", "pipeline=interleaved_1f1b"],
        ["model=deepseek_v3", "parallel.pp=16", "parallel.ep=8", "pipeline=dualpipev"],
        ["model=llama3_70b", "parallel.pp=4", "pipeline.layers_per_stage=[10,30,20,20]"],
    ],
    ids=["zbv-underfilled", "interleaved", "dualpipev-moe", "1f1b-uneven"],
)
def test_memory_verdict_is_the_most_loaded_pipeline_rank(overrides):
    from launcher.plan.context import rank_layers
    from launcher.plan.estimate import rank_memory

    cfg = compose_config(
        ["hardware=h100_80g", "hardware.nodes=64", "parallel.tp=8", "train.micro_batch_size=1"]
        + ["train.global_batch_size=128", "recompute=full", *overrides]
    )
    plan = make_plan(cfg)
    assert plan.valid, plan.errors
    ctx, lay = plan.context, plan.layout
    s = ctx.shape
    ranks = rank_layers(
        s.n_layers, s.n_dense_layers, lay.pp, lay.stages_per_rank, lay.schedule, lay.stage_layers
    )
    every = [rank_memory(ctx, lay, r, *ranks[r]).total for r in range(lay.pp)]
    assert plan.memory.total == max(every)
