"""A run SIGKILLed (its whole process group) at each instant of a save loses nothing: the rerun
of the same command resumes from a whole checkpoint, the newest one that was complete, and
trains on bitwise as the uninterrupted run did (tests/checkpoint/save_window.py kills and
reruns; 1 and 2 ranks, checkpoint.keep=1 and 3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_metrics

from checkpoint.save_window import KEEPS, KILL_AT, POINTS, STEPS
from launcher.checkpoint.reader import checkpoint_damage
from launcher.checkpoint.store import newest_complete

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def drivers(tmp_path_factory) -> dict[int, tuple[Path, dict]]:
    """Every kill and rerun, on 1 and on 2 ranks (the two drivers side by side): per world
    size, (their directory, what the driver saw)."""
    out = {world: tmp_path_factory.mktemp(f"save_window_{world}") for world in (1, 2)}
    running = {
        world: subprocess.Popen(
            [sys.executable, str(HERE / "save_window.py"), str(path), str(world)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for world, path in out.items()
    }
    results = {}
    for world, driver in running.items():
        output, _ = driver.communicate(timeout=600)
        assert driver.returncode == 0, output[-3000:]
        results[world] = (out[world], json.loads((out[world] / "results.json").read_text()))
    return results


def final_parameters(run: Path) -> dict:
    return torch.load(run / "final_model.pt", weights_only=True)


@pytest.mark.parametrize("keep", KEEPS, ids=lambda k: f"keep={k}")
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("world", [1, 2], ids=["1 rank", "2 ranks"])
def test_a_kill_at_any_instant_of_a_save_resumes_whole_and_bitwise(drivers, world, point, keep):
    out, results = drivers[world]
    seen, run = results[f"{point}-keep{keep}"], out / f"{point}-keep{keep}"
    assert all(code == -9 for code in seen["killed"]), seen  # killed inside the save
    # What the kill left: the checkpoint of the step before, whole, or (once the rename
    # happened) the new one; never a half-deleted one that still looks complete.
    published = point in ("published", "pruning")
    assert seen["newest"] == (KILL_AT if published else KILL_AT - 1) and seen["damage"] == [], seen
    log = (run / "log.0.txt").read_text()
    assert seen["again"] == [0] * len(seen["again"]), log[-3000:]
    assert f"starting from step {seen['newest']} of" in log
    assert "damaged" not in log and "start over" not in log
    # Nothing partial or half-removed stays; keep holds.
    assert seen["after"] == [f"step_{s:08d}" for s in range(STEPS - keep + 1, STEPS + 1)]
    assert checkpoint_damage(newest_complete(run / "checkpoints")) == []
    reference = out / "reference"
    losses = {r["step"]: r["loss"] for r in read_metrics(run)}
    assert losses == {r["step"]: r["loss"] for r in read_metrics(reference)}
    mine, theirs = final_parameters(run), final_parameters(reference)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
