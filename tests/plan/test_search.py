"""The search ranks layouts that fit, and each one checks out through the ordinary plan."""

from __future__ import annotations

import json
import re

import pytest
from conftest import compose_config, run_cli

from launcher.plan import make_plan
from launcher.plan.rules import engine_problems
from launcher.plan.search import search

BASE = ["model=llama3_8b", "hardware=h100_80g", "train.seq_len=8192", "train.global_batch_size=64"]


def test_search_ranks_fitting_layouts_that_replan_identically():
    cfg = compose_config(BASE)
    evaluated, fitting = search(cfg)
    assert evaluated > len(fitting) > 10
    speeds = [e.tokens_per_s_per_device for e in fitting]
    assert speeds == sorted(speeds, reverse=True)
    pipelined = [e for e in fitting if e.layout.pp > 1 and e.layout.stages_per_rank > 1]
    assert pipelined
    for est in fitting[:5] + pipelined[:3]:
        # Launched as it is: the layout's overrides give the engine exactly this layout.
        plan = make_plan(compose_config(BASE + est.layout.overrides()))
        assert plan.ok, plan.errors
        assert plan.layout == est.layout
        assert plan.estimate.tokens_per_s_per_device == pytest.approx(est.tokens_per_s_per_device)


def test_search_prefers_cheapest_recompute_that_fits():
    cfg = compose_config(
        [
            "model=llama3_70b",
            "hardware=h100_80g",
            "hardware.nodes=8",
            "train.seq_len=8192",
            "train.global_batch_size=256",
        ]
    )
    _, fitting = search(cfg)
    top = fitting[0]
    assert top.memory.total <= 79.6 * 2**30
    if top.layout.recompute == "full":  # then the same layout without recompute must not fit
        lay = top.layout
        plan = make_plan(
            compose_config(
                [
                    "model=llama3_70b",
                    "hardware=h100_80g",
                    "hardware.nodes=8",
                    "train.seq_len=8192",
                    "train.global_batch_size=256",
                ]
                + [o for o in lay.overrides() if "recompute" not in o]
                + ["recompute=none"]
            )
        )
        assert not plan.fits


@pytest.mark.e2e
def test_search_cli_json():
    result = run_cli("launcher.plan", *BASE, "plan.search=true", "plan.format=json", "plan.top_k=3")
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    assert out["evaluated"] > 0 and len(out["top"]) == 3
    assert all(t["memory_gib"]["total"] <= t["memory_gib"]["capacity"] for t in out["top"])


@pytest.mark.e2e
def test_plan_cli_json_shape_and_exit_status():
    ok = run_cli("launcher.plan", "recipe=llama3_405b_8192gpu", "plan.format=json")
    assert ok.returncode == 0, ok.stderr[-2000:]
    out = json.loads(ok.stdout)
    assert {
        "valid",
        "fits",
        "errors",
        "warnings",
        "world_size",
        "degrees",
        "params",
        "memory_gib",
        "predicted",
    } <= out.keys()
    assert out["degrees"] == {
        "dp_replicate": 1,
        "dp_shard": 64,
        "tp": 8,
        "pp": 16,
        "cp": 1,
        "ep": 1,
    }
    assert {"params", "grads", "optimizer", "activations", "other", "total", "capacity"} <= out[
        "memory_gib"
    ].keys()
    assert {"step_time_s", "tokens_per_s_per_device", "mfu", "bubble_fraction"} <= out[
        "predicted"
    ].keys()
    bad = run_cli(
        "launcher.plan",
        "model=llama3_405b",
        "hardware=h100_80g",
        "train.micro_batch_size=1",
        "train.global_batch_size=8",
        "plan.format=json",
    )
    assert bad.returncode == 2
    out = json.loads(bad.stdout)
    assert out["valid"] and not out["fits"] and out["errors"][0]["rule"] == "memory"


@pytest.mark.e2e
def test_search_shows_what_the_engine_runs_and_explains_its_choice():
    """By default the search ranks only layouts launcher.train runs, says why #1 beats #2 in one
    line (or that they tie), and its launch line composes into a plan without engine problems; under
    plan.planner_only=true the layouts it refuses (op recompute under the split schedules, a
    limitation) rank too, marked, with the limitation named."""
    overrides = ["model=llama3_405b", "hardware=h100_80g", "hardware.nodes=32"]
    overrides += ["train.seq_len=8192", "train.global_batch_size=256", "plan.search=true"]
    text = run_cli("launcher.plan", *overrides)
    assert text.returncode == 0, text.stderr[-2000:]
    assert "planner only" not in text.stdout
    assert re.search(
        r"#1 (over|and) #\d+(: [0-9.]+% faster| tie: [0-9.]+% apart) \([0-9.]+ s vs [0-9.]+ s "
        r"per step\) with \w+ ",
        text.stdout,
    )
    launch = text.stdout.split("the fastest that launcher.train runs")[1]
    cfg = compose_config(
        [o for o in overrides if o != "plan.search=true"] + launch.split("plus:")[1].split()
    )
    plan = make_plan(cfg)
    assert plan.ok and not engine_problems(cfg, plan.layout), plan.errors
    out = json.loads(run_cli("launcher.plan", *overrides, "plan.format=json").stdout)
    assert not any(t["engine_problems"] for t in out["top"])
    assert out["why_first"].startswith(("#1 over #", "#1 and #"))
    assert set(out["top"][0]["predicted"]["terms"]) >= {"compute", "pp", "tp"}
    every = run_cli(
        "launcher.plan", *overrides, "plan.planner_only=true", "plan.top_k=40", "plan.format=json"
    )
    refused = [t for t in json.loads(every.stdout)["top"] if t["engine_problems"]]
    assert refused and all("recompute=op" in t["engine_problems"][0] for t in refused)


@pytest.mark.parametrize("model", ["llama3_8b", "gpt_1_7b"])
def test_alternate_matmuls_sit_between_op_and_full(model):
    """The search tries recompute in the order of RECOMPUTE and stops at the first that fits:
    each step must keep less and run longer than the one before (op keeping every other
    matmul's output between op and full)."""
    from launcher.layout import RECOMPUTE

    assert RECOMPUTE.index(("op", "all")) < RECOMPUTE.index(("op", "alternate"))
    assert RECOMPUTE.index(("op", "alternate")) < RECOMPUTE.index(("full", "all"))
    base = [f"model={model}", "hardware=h100_80g", "train.seq_len=8192", "train.micro_batch_size=2"]
    plans = [
        make_plan(compose_config([*base, f"recompute={mode}", f"recompute.matmuls={matmuls}"]))
        for mode, matmuls in (("op", "all"), ("op", "alternate"), ("full", "all"))
    ]
    memory = [p.estimate.memory.activations for p in plans]
    step = [p.estimate.time.step for p in plans]
    assert memory[0] > memory[1] > memory[2]
    assert step[0] < step[1] < step[2]


def test_two_layouts_whose_gap_is_within_the_band_of_their_separating_terms_tie():
    """The search's line on #1 against its runner-up: a gap smaller than the separating terms'
    differences times the relative half-width of the class's speed spread (what its held-out
    runs missed by, less their common offset) is a tie, said so; a gap from one term alone,
    which outgrows its own band, is a win."""
    from dataclasses import replace

    from launcher.plan.search import explain, separating_band
    from launcher.plan.terms.base import Term, Time

    cfg = compose_config(["model=llama3_8b", "hardware=h100_80g", "train.global_batch_size=64"])
    first = make_plan(cfg).estimate
    step = first.time.step
    width = first.band.spread
    assert 0 < width < 1

    def other(**extra: float):
        terms = [Term(t.name, t.exposed + extra.pop(t.name, 0.0), t.work) for t in first.time.terms]
        terms += [Term(name, seconds, seconds) for name, seconds in extra.items()]
        return replace(first, time=Time(tuple(terms)))

    # 1% slower net, from 10% more compute and a new term 9% of the step less elsewhere.
    swapped = other(compute=0.10 * step, dp=-0.09 * step)
    deltas = [("compute", 0.10 * step), ("dp", -0.09 * step)]
    assert separating_band(first, deltas) == pytest.approx(width * 0.19 * step)
    assert explain(first, swapped).startswith("#1 and #2 tie: 1.0% apart")
    assert "measure both" in explain(first, swapped)
    # 1% slower from one term alone: its band is 1% x width, below the gap.
    slower = other(compute=0.01 * step)
    assert explain(first, slower).startswith("#1 over #2: 1.0% faster")
