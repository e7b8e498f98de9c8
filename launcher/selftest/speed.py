"""The self-test's speed row: a few timed steps of the run the command line describes (its
model, layout and batch; a recipe's), cut to fit (as few layers as its pipeline allows, same
widths), against the planner's step time for the same cut: with the preset's figures, and
with the fabric's fitted ones and the compute efficiency fitted to this measurement.

The efficiency is hardware.efficiency (the fraction of peak_tflops every kernel reaches, as a
run measures it: docs/planner.md, "Calibration"), found by bisection so that the planner's
step time for the cut equals the measured one.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

STEPS = 4  # the first is a warm-up; the median of the rest is the measured step
QUIET = (
    f"train.steps={STEPS}",
    "train.eval_interval=0",
    "train.save_final=false",
    "checkpoint.interval=0",
    "logging.wandb.mode=disabled",
    "logging.tensorboard=false",
    "profile.steps=[]",
)
# What the speed row leaves out of the command line: the self-test's own options, Hydra's.
OWN = ("selftest.", "hydra.", "hydra/", "+hydra", "~hydra")


def cut_overrides(cfg, overrides: list[str]) -> list[str]:
    """The command line's run, cut to the fewest layers its pipeline splits into (at most its
    own), run for STEPS steps with nothing saved or logged but metrics.jsonl."""
    lay = cfg.pipeline
    stages = cfg.parallel.pp * (lay.stages_per_rank if cfg.parallel.pp > 1 else 1)
    layers = min(cfg.model.n_layers, stages)
    kept = [o for o in overrides if not o.lstrip("+~").startswith(OWN)]
    return [*kept, f"model.n_layers={layers}", *QUIET]


def measured_step(run_dir: Path) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows[1:])


def fit_efficiency(cfg, fitted: dict, measured: float, plan_of) -> tuple[float, float]:
    """hardware.efficiency for which the planner's step time of `cfg` (with the fitted
    collective figures) is `measured`: (efficiency, that prediction). plan_of(cfg) plans."""

    def step(efficiency: float) -> float:
        hw = dataclasses.replace(cfg.hardware, **fitted, efficiency=efficiency)
        return plan_of(dataclasses.replace(cfg, hardware=hw)).estimate.time.step

    low, high = 1e-4, 1.0  # the step time falls as the efficiency rises
    if step(high) >= measured:
        return high, step(high)
    if step(low) <= measured:
        return low, step(low)
    for _ in range(24):  # the efficiency to 1e-5 of itself over the four decades
        mid = (low * high) ** 0.5
        low, high = (mid, high) if step(mid) > measured else (low, mid)
    return high, step(high)
