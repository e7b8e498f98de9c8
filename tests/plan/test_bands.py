"""Every prediction's band (launcher/plan/bands.py): its residuals as the runs and the planner
give them now, how often the band of the others holds a held-out run's measured figure, the
memory verdict on the band's high figure."""

from __future__ import annotations

import math

import pytest
from conftest import compose_config

from launcher.plan import bands, calibrate, held_out, make_plan
from launcher.plan.memory import GIB
from launcher.plan.report import plan_json


def test_the_residuals_file_is_what_the_held_out_runs_and_the_planner_give_now():
    """launcher/plan/residuals.py is written by `python -m launcher.plan.held_out --write`: a
    change of the planner, the runs or their uses that moves a residual fails here until it is
    written again."""
    now = held_out.residual_rows()
    assert [r.name for r in now] == [r.name for r in bands.RESIDUALS]
    for got, kept in zip(now, bands.RESIDUALS, strict=True):
        assert got.key(bands.FIELDS) == kept.key(bands.FIELDS), got.name
        assert got.speed == pytest.approx(kept.speed, abs=1e-4), got.name
        if kept.memory is None:
            assert got.memory is None, got.name
        else:
            assert got.memory == pytest.approx(kept.memory, abs=1e-4), got.name


@pytest.mark.parametrize("kind", ["speed", "memory"])
def test_the_band_of_the_others_holds_at_least_four_in_five_held_out_figures(kind):
    """Leave one out: each held-out run's band computed without it, from the runs of its class
    (or the wider class it falls back to), holds its measured figure in 80% of cases or more."""
    held = held_out.coverage(list(bands.RESIDUALS), kind)
    assert len(held) >= (15 if kind == "speed" else 6)
    inside = sum(ok for _, _, ok in held)
    assert inside / len(held) >= 0.8, [(r.name, s) for r, s, ok in held if not ok]


def test_no_held_out_runs_measured_memory_is_above_its_plans_high_figure():
    """The plan of each held-out run with a measured peak (published, and this engine's:
    peak allocated, which holds no reserve) puts its high memory figure at or above it."""
    checked = 0
    for run, _, plan in calibrate.published_plans()[0]:
        if run.use == "held-out" and run.memory_gib:
            assert plan.estimate.memory_band[1] / GIB >= run.memory_gib, run.name
            checked += 1
    runs = calibrate.engine_runs()
    uses = calibrate.engine_uses(runs)
    for d, row, cfg in runs:
        if uses[f"{d}/{row['job']}"] == "-":
            plan = make_plan(cfg)
            high = (plan.estimate.memory_band[1] - plan.context.reserve) / GIB
            assert high >= row["peak_allocated_gib"], row["job"]
            checked += 1
    assert checked >= 6


def test_a_superseded_run_is_never_held_out():
    uses = calibrate.engine_uses(calibrate.engine_runs())
    for old, new in calibrate.SUPERSEDED.items():
        assert uses[old] == f"superseded by {new}" and new in uses
    assert "h200-2026-11-27/gpt_eager" not in {r.name for r in bands.RESIDUALS}


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model=mixtral_debug", "parallel.ep=2"],
        ["hardware=h200", "model=llama3_8b", "train.seq_len=4096", "train.compile=true"],
        ["hardware=b200", "model=llama3_8b", "train.seq_len=4096"],
    ],
    ids=["default", "moe", "h200 compiled", "b200"],
)
def test_every_plan_carries_its_band_in_the_json_and_the_point_lies_inside(overrides):
    plan = make_plan(compose_config(overrides))
    predicted, memory = plan_json(plan)["predicted"], plan_json(plan)["memory_gib"]
    band = predicted["band"]
    assert band["step_time_s"][0] <= predicted["step_time_s"] <= band["step_time_s"][1]
    tokens = predicted["tokens_per_s_per_device"]
    assert band["tokens_per_s_per_device"][0] <= tokens <= band["tokens_per_s_per_device"][1]
    assert band["memory_gib"][0] <= memory["total"] <= band["memory_gib"][1]
    assert "held-out runs" in band["speed_from"] and "held-out runs" in band["memory_from"]
    # The step's band is the tokens/s band turned over (the same tokens per step).
    lo, hi = band["tokens_per_s_per_device"]
    assert band["step_time_s"][0] == pytest.approx(predicted["step_time_s"] * tokens / hi)


def test_a_part_measured_nowhere_takes_a_wider_class_and_names_it():
    b200 = bands.ratios(compose_config(["hardware=b200"]))
    h200 = bands.ratios(compose_config(["hardware=h200", "train.compile=true"]))
    assert "b200" not in b200.speed.of and "GH100" in h200.speed.of
    assert b200.speed.runs >= bands.MIN_RUNS


H200_8B = [
    "hardware=h200",
    "model=llama3_8b",
    "train.seq_len=4096",
    "train.micro_batch_size=1",
    "train.global_batch_size=8",
]


def test_the_fit_verdict_reads_the_high_figure_and_a_straddling_band_says_so():
    """Between the low and the high memory figure the layout is planned as not fitting, with
    a warning that it may; above the high one, no warning. (A CUDA device's reserve is 2 GiB
    and 5% of its memory: the modelled bytes, `base`, stay as memory_gib moves.)"""
    plan = make_plan(compose_config(H200_8B))
    reserve = plan.context.reserve
    base = plan.memory.total - reserve
    high = (plan.estimate.memory_band[1] - reserve) / base
    assert high > 1 and plan.ok

    def at(ratio: float):
        gib = (2 + base / GIB * ratio) / 0.95
        return make_plan(compose_config([*H200_8B, f"hardware.memory_gib={gib:.6f}"]))

    tight = at((1 + high) / 2)
    assert tight.memory.total <= tight.cfg.hardware.memory_gib * GIB
    assert not tight.fits and [p.rule for p in tight.errors] == ["memory"]
    assert "in its band" in tight.errors[0].message
    assert [p for p in tight.warnings if p.rule == "memory_band"]
    roomy = at(high * 1.001)
    assert roomy.ok and not [p for p in roomy.warnings if p.rule == "memory_band"]
    short = at(0.99)
    assert not short.fits and not [p for p in short.warnings if p.rule == "memory_band"]


def test_the_interval_is_students():
    """Three ratios e^-d, 1, e^d: mean 0, s = d, so the half-width is t(2) d sqrt(4/3)."""
    d = 0.1
    low, high = bands.interval([math.exp(-d), 1.0, math.exp(d)])
    assert math.log(high) == pytest.approx(2.920 * d * math.sqrt(4 / 3))
    assert math.log(low) == pytest.approx(-math.log(high))
    assert bands.t95(11) == bands.T95[10] and bands.t95(500) == bands.T95[120]


def test_the_cpu_preset_holds_what_its_fit_sweep_gives_and_its_other_runs_are_held_out():
    """hardware=cpu's figures are `calibrate --from` of this machine's fit sweep
    (docs/measured/cpu-2026-12-03/fit); the other sweeps there are the cpu part's held-out runs,
    none a copy of a fit run's workload."""
    import contextlib
    import io
    import re

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        calibrate.main(["--from", str(held_out.CPU / held_out.CPU_FIT)])
    fitted = dict(re.findall(r"hardware\.(\w+)=([0-9.]+)", out.getvalue().splitlines()[-1]))
    hw = compose_config(["hardware=cpu"]).hardware
    for name, value in fitted.items():
        assert getattr(hw, name) == pytest.approx(float(value), rel=0.01), name
    uses = [use for _, use, _, _ in held_out.cpu_runs()]
    assert uses.count("fit") == 6 and uses.count("held-out") >= 7 and "copy" not in uses
    assert sum(r.part == "cpu" for r in bands.RESIDUALS) == uses.count("held-out")
