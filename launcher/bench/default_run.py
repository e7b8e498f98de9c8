"""`make bench`'s default-run row: the run `make train` starts (the embedded default, two CPU
ranks), cut to `steps` steps, its measured tokens/s per device (the median step after the
first, as `launcher.plan.calibrate --from` reads a run) against the plan's figure and band
(launcher/plan/bands.py: the cpu part's held-out runs), which the acceptance of issue 65 holds
it inside."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from launcher.cli import compose
from launcher.plan import make_plan

REPOSITORY = Path(__file__).resolve().parents[2]


def default_against_band(steps: int = 40, progress=print) -> dict:
    """The default run's measured tokens/s per device beside its plan's point and band."""
    overrides = [f"train.steps={steps}", "logging.wandb.mode=disabled"]
    plan = make_plan(compose(overrides))
    with tempfile.TemporaryDirectory(prefix="bench-default-") as tmp:
        progress(f"the default run, {steps} steps")
        run = Path(tmp) / "run"
        path = [str(REPOSITORY), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}  # this checkout's launcher
        subprocess.run(
            [sys.executable, "-m", "launcher.train", *overrides, f"hydra.run.dir={run}"],
            cwd=tmp, env=env, check=True, capture_output=True, text=True,
        )  # fmt: skip
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in rows[1:] if r.get("tokens_per_s")]
    low, high = plan.estimate.band.tokens_per_s
    measured = statistics.median(speeds)
    return {
        "steps": steps,
        "measured": measured,
        "planned": plan.estimate.tokens_per_s_per_device,
        "band": (low, high),
        "inside": low <= measured <= high,
        "band_from": plan.estimate.band.speed_from,
    }
