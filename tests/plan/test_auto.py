"""parallel.auto=true: the fastest runnable layout for the world a start gets, the degrees
the command line sets kept, the run directory independent of both."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT, compose_config

from launcher.cli import run_name
from launcher.plan import engine_plan
from launcher.plan.auto import choice_line, choose, fixed_degrees, on_world, plan_for
from launcher.plan.search import runnable


def test_the_choice_is_the_searchs_fastest_runnable_layout_for_the_world():
    cfg = compose_config([])
    for per_node in (1, 2, 3, 4):
        world = on_world(cfg, 1, per_node)
        best = runnable(world)[0]
        assert choose(world, {}).layout == best.layout
        assert (
            best.layout.dp_replicate
            * best.layout.dp_shard
            * best.layout.tp
            * (best.layout.pp * best.layout.cp)
            == per_node
        )
    three = choose(on_world(cfg, 1, 3), {}).layout
    assert (three.pp, three.dp_shard, three.tp) == (3, 1, 1)  # 8 heads and 16 sequences: no 3


def test_degrees_set_beside_auto_are_kept():
    assert fixed_degrees(["parallel.auto=true", "parallel.tp=2", "parallel.dp_shard=-1"]) == {
        "tp": 2
    }
    cfg = compose_config([])
    kept = choose(on_world(cfg, 1, 4), {"tp": 2}).layout
    assert kept.tp == 2 and choose(on_world(cfg, 1, 4), {}).layout.tp == 1


def test_the_chosen_overrides_plan_as_launcher_train_runs_them():
    extra, problem = plan_for(compose_config([]), ["parallel.auto=true"], 1, 3)
    assert problem is None
    plan = engine_plan(compose_config(extra))
    assert plan.ok and plan.world_size == 3 and plan.layout.pp == 3


def test_a_world_nothing_fits_on_is_refused_naming_the_smallest_that_would():
    _, problem = plan_for(compose_config([]), ["parallel.auto=true"], 1, 5)
    assert "fits and trains on 5 rank(s) (1 x 5)" in problem
    assert "the smallest world on which one does is 1 rank(s)" in problem
    _, problem = plan_for(compose_config(["model=llama3_8b"]), [], 1, 1)
    assert "the smallest world on which one does is" in problem  # more ranks shard it


def test_the_run_directory_does_not_depend_on_the_world_or_layout():
    auto = [
        "hardware.devices_per_node=4,parallel.auto=true,train.steps=12",
        "hardware.devices_per_node=3,parallel.auto=true,train.steps=12",
        "parallel.auto=true,parallel.tp=2,train.steps=12",
    ]
    assert len({run_name("llama3_debug", o) for o in auto}) == 1
    assert run_name("m", "train.steps=12") != run_name("m", "train.steps=13")
    assert run_name("m", "hardware.devices_per_node=4") != run_name(
        "m", "hardware.devices_per_node=3"
    )  # without auto the layout is part of the run, as before


def test_the_start_says_what_changed():
    cfg = compose_config(
        ["hardware.devices_per_node=3", "parallel.pp=3", "train.micro_batch_size=2"]
    )
    lay = engine_plan(cfg).layout
    was = {"world_size": 4, "layout": {"dp_shard": 4, "micro_batch_size": 4}}
    assert choice_line(lay, 3, was) == (
        "re-planned for 3 rank(s) (was 4): pp=3 1f1b, micro-batch 2 (was dp_shard=4, micro-batch 4)"
    )
    assert choice_line(lay, 3, None) == "planned for 3 rank(s): pp=3 1f1b, micro-batch 2"


def test_launcher_plan_shows_the_layout_train_would_choose_and_writes_nothing(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.plan",
            "parallel.auto=true",
            "hardware.devices_per_node=3",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dp_replicate=1  dp_shard=1  tp=1  pp=3" in out.stdout
    assert list(tmp_path.iterdir()) == []  # no outputs/<model>-<hash>/.hydra


def test_an_moe_with_a_per_micro_batch_balance_loss_keeps_its_micro_batch():
    cfg = compose_config(["model=mixtral_debug"])
    assert cfg.model.aux_loss_coef > 0
    for per_node in (1, 2, 4):
        lay = choose(on_world(cfg, 1, per_node), {}).layout
        assert lay.micro_batch_size == cfg.train.micro_batch_size
    free = compose_config(["model=mixtral_debug", "model.aux_loss_coef=0"])
    sizes = {choose(on_world(free, 1, n), {}).layout.micro_batch_size for n in (1, 2, 4)}
    assert sizes != {free.train.micro_batch_size}  # without it the choice is free


def test_a_sweep_of_plans_plans_every_point_and_writes_nothing(tmp_path):
    """`launcher.plan ... -m` (the flag after the overrides, as README's sweep line is often
    copied): each point is planned, not only the first; the status is the worst point's (exit
    2: tp=3 breaks the rules); nothing is written where it runs."""
    out = subprocess.run(
        [sys.executable, "-m", "launcher.plan", "parallel.tp=1,3", "-m"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "tp=1  pp=1" in out.stdout and "[tp_heads] tp=3 must divide n_heads=8" in out.stdout
    assert "Traceback" not in out.stderr and list(tmp_path.iterdir()) == []
