"""`python -m launcher.selftest` on CPU ranks over gloo: every row passes on 4 ranks, and a
corrupted collective fails exactly the rows that use it (the rows and the comparison:
tests/test_selftest.py)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from launcher.selftest.rows import rows_for

pytestmark = pytest.mark.e2e


def report(run_dir) -> dict:
    return json.loads((run_dir / "selftest.json").read_text())


def test_every_row_passes_on_4_ranks_and_the_report_says_so(tmp_path):
    proc = run_cli("launcher.selftest", "hardware.devices_per_node=4", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = report(tmp_path)
    assert [r["row"] for r in got["rows"]] == [r.name for r in rows_for(4)]
    assert got["world"] == 4 and got["backend"] == "gloo" and got["failed"] == 0
    for r in got["rows"]:
        assert r["status"] == "pass", r
        assert r["loss_rel"] <= 1e-5 and r["grad_norm_rel"] <= 5e-4 and r["params_abs"] < 1e-3
    table = (tmp_path / "selftest.md").read_text()
    assert "8 of 8 rows pass, 0 fail" in table and table in proc.stdout
    assert "Traceback" not in proc.stderr


def test_a_corrupted_send_fails_the_pipeline_and_ring_rows_and_no_other(tmp_path):
    """selftest.fault=send scales every floating-point point-to-point send by 1.01: the
    pipeline's and CP's ring rows fail, naming what differed; the rest pass; exit 1."""
    proc = run_cli(
        "launcher.selftest",
        "hardware.devices_per_node=2",
        "selftest.fault=send",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    rows = {r["row"]: r for r in report(tmp_path)["rows"]}
    failed = {name for name, r in rows.items() if r["status"] == "FAIL"}
    assert failed == {"pp=2 1f1b", "cp=2 ring"}, rows
    assert all(r["status"] == "pass" for name, r in rows.items() if name not in failed)
    for name in failed:
        assert "loss at step" in rows[name]["reason"] and "> 1e-05" in rows[name]["reason"]
        assert f"- {name}: loss at step" in proc.stdout
    assert "5 of 7 rows pass, 2 fail" in proc.stdout
