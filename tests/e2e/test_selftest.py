"""`python -m launcher.selftest` on CPU ranks over gloo: every row passes on 4 ranks, and one
rank times the speed row alone (the rows and the comparison: tests/test_selftest.py; a
corrupted send failing exactly the pipeline's and CP's ring rows, and a site's preset fitted
beside it in its own config directory: docs/cluster.md's checked blocks)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from launcher.selftest import fabric
from launcher.selftest.rows import rows_for

pytestmark = pytest.mark.e2e


def report(run_dir) -> dict:
    return json.loads((run_dir / "selftest.json").read_text())


def test_every_row_and_a_recipe_s_composition_pass_on_4_ranks(tmp_path):
    """Every axis row of 4 ranks, and mixtral_8x22b_debug's tp x pp x ep (interleaved, SP,
    full recompute) cut to 4 ranks on mixtral_debug, each against one process: all pass,
    exit 0, the table printed and written."""
    proc = run_cli(
        "launcher.selftest",
        "recipe=mixtral_8x22b_debug",
        "hardware.devices_per_node=4",
        "selftest.steps=2",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = report(tmp_path)
    names = [r.name for r in rows_for(4)]
    assert [r["row"] for r in got["rows"]][:-1] == names
    recipe = got["rows"][-1]
    assert recipe["row"] == "mixtral_8x22b_debug: mixtral_debug tp=2 x pp=2 x ep=2"
    assert "pipeline=interleaved_1f1b" in recipe["overrides"]
    assert got["world"] == 4 and got["backend"] == "gloo" and got["failed"] == 0
    for r in got["rows"]:
        assert r["status"] == "pass", r
        assert r["loss_rel"] <= 1e-5 and r["grad_norm_rel"] <= 5e-4 and r["params_abs"] < 1e-3
    table = (tmp_path / "selftest.md").read_text()
    assert f"{len(names) + 1} of {len(names) + 1} rows pass, 0 fail" in table
    assert table in proc.stdout and "Traceback" not in proc.stderr
    # The fabric: every collective over pairs and the node at every size, a preset fitted to
    # them, which the planner then plans with by name (saying what it was fitted on).
    wire = got["fabric"]
    assert {(r["group"], r["ranks"]) for r in wire} == {("pairs", 2), ("node", 4)}
    assert {r["collective"] for r in wire} == set(fabric.KINDS)
    assert all(r["seconds"] > 0 and r["predicted_s"] > 0 for r in wire)
    assert got["fitted"]["intra_node_gbps"] > 0
    preset = tmp_path / "conf" / "hardware" / "cpu_selftest.yaml"
    assert got["preset"] == str(preset) and preset.exists()
    # The speed row: the recipe's run cut to its pipeline's fewest layers, timed; the preset
    # (its fitted efficiency) plans that cut within 10% of what was measured.
    timed = got["speed"]
    assert "model.n_layers=4" in timed["overrides"] and timed["measured_s"] > 0
    conf = ("--config-dir", str(tmp_path / "conf"))
    plan = run_cli("launcher.plan", *conf, *timed["overrides"], "hardware=cpu_selftest",
                   "plan.format=json")  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)
    assert planned["config_files"]["hardware=cpu_selftest"].endswith("cpu_selftest.yaml")
    step = planned["predicted"]["step_time_s"]
    assert abs(step - timed["measured_s"]) <= 0.1 * timed["measured_s"], (step, timed)
    shown = run_cli("launcher.plan", *conf, "hardware=cpu_selftest")
    assert "launcher.selftest" in shown.stdout and "4 x cpu (cpu, gloo)" in shown.stdout


def test_one_rank_times_the_speed_row_alone_and_fits_its_efficiency(tmp_path):
    """One device (a machine with one GPU): no layout to compare and no fabric, the speed row
    alone, its efficiency fitted into the preset; the directory is then refused to another."""
    proc = run_cli("launcher.selftest", "hardware.devices_per_node=1", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = report(tmp_path)
    assert got["rows"] == [] and got["fabric"] == [] and list(got["fitted"]) == ["efficiency"]
    # (Whether the fitted step reaches the measured one depends on this machine's speed: one
    # rank's step may be faster than the planner allows at efficiency 1; the 4-rank row
    # checks the fit itself.)
    assert got["speed"]["measured_s"] > 0 and 0 < got["fitted"]["efficiency"] <= 1
    preset = (tmp_path / "conf" / "hardware" / "cpu_selftest.yaml").read_text()
    written = float(f"{got['fitted']['efficiency']:.4g}")  # four digits, as the preset holds it
    assert f"efficiency: {written}\n" in preset
    again = run_cli("launcher.selftest", "hardware.devices_per_node=1", f"hydra.run.dir={tmp_path}")
    assert again.returncode == 2 and "holds a self-test already" in again.stderr
