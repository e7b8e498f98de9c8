"""Bad input to every command ends with exit 2 and a named message, never a traceback or a
segfault (tests/e2e/bad_inputs.py holds the cases and runs them in one worker process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.bad_inputs import ACCEPTED, CASES, DISKS

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Every case, run once by the worker (a crash of the worker leaves its case unrun)."""
    base = tmp_path_factory.mktemp("bad_inputs")
    out = base / "results.jsonl"
    # Wide enough that no message is wrapped inside the plan's table.
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT), "COLUMNS": "1000"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "bad_inputs.py"), str(base / "work"), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return proc, rows, base / "work"


def test_there_are_at_least_120_cases_each_named_once():
    assert len(CASES) >= 120
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_by_name(case, results):
    proc, rows, work = results
    disks = work / "disks.json"
    if case in DISKS and disks.exists() and "why" in (why := json.loads(disks.read_text())):
        pytest.skip(f"no tmpfs mounts here (needs root): {why['why']}")
    done = {r["id"]: r for r in rows if "id" in r}
    assert case.id in done, (
        f"the worker died before finishing this case (exit {proc.returncode}, a segfault is "
        f"-11): {proc.stderr[-2000:]}"
    )
    r = done[case.id]
    assert not r["crash"] and "Traceback" not in r["output"], r["output"][-3000:]
    if case.expect.startswith(ACCEPTED):
        assert r["code"] == 0, r["output"][-3000:]
    else:
        assert r["code"] == case.status, r["output"][-3000:]
        assert case.expect.replace("{W}", str(work)) in r["output"], r["output"][-3000:]


def test_no_checkpoint_ran_its_code(results):
    """The crafted .metadata would have touched WORK/pwned when unpickled."""
    _, rows, _ = results
    assert {"pwned": False} in rows


def test_no_input_and_no_file_the_launcher_did_not_make_was_written_over(results):
    """Outputs named onto a checkpoint's own files or the run's metrics were refused, and a
    user's own OUT.partial was not touched: those are as they were."""
    from launcher.checkpoint.reader import checkpoint_damage
    from launcher.checkpoint.store import open_checkpoint

    _, _, work = results
    for users in ("mine.partial", "shards.partial", "shards.replaced"):
        assert (work / "out" / users / "notes.txt").read_text() == "mine"
    checkpoint = work / "ckpt" / "checkpoints" / "step_00000002"
    assert checkpoint_damage(open_checkpoint(checkpoint)) == []
    assert not (checkpoint / "model.pt").exists()
    assert (work / "ckpt" / "metrics.jsonl").read_text().startswith('{"step": 1')
    if (work / "full" / "old.png").exists():  # the disks were mounted (root)
        assert (work / "full" / "old.png").read_bytes() == b"an older plot"
