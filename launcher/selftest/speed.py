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

from launcher.layout import V_SCHEDULES

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


def carved_ep(cfg, world: int, pp: int) -> int:
    """The largest divisor of the run's ep that dp_shard x cp x tp carves at this pp."""
    par = cfg.parallel
    shard = world // (par.tp * par.cp * par.dp_replicate * pp)
    ep = par.ep
    while ep > 1 and (shard * par.cp * par.tp % ep or par.ep % ep):
        ep -= 1
    return ep


def pipeline_cut(cfg, world: int) -> tuple[int, int]:
    """The pipeline degree and virtual stages per rank of the cut: the largest divisor of the
    run's pp for which the world holds tp x cp x dp_replicate x pp (tp and cp, which set the
    per-device shapes the timing is for, are kept) and the rest carves as much of the run's ep
    as any such pp would (the experts' share a device holds), at most 2 stages a rank (2 on
    one rank for a V schedule, which needs them)."""
    par = cfg.parallel
    fixed = par.tp * par.cp * par.dp_replicate
    fits = [p for p in range(par.pp, 0, -1) if par.pp % p == 0 and world % (fixed * p) == 0]
    pp = max(fits or [1], key=lambda p: (carved_ep(cfg, world, p), p))
    v = cfg.pipeline.stages_per_rank
    if pp == 1:
        return pp, 2 if cfg.pipeline.schedule in V_SCHEDULES else 1
    return pp, min(v, 2)


def cut_overrides(cfg, overrides: list[str]) -> list[str]:
    """The command line's run, cut to fit this world and time in a few seconds, at its own
    widths, sequence, micro-batch, tp and cp: its pipeline (pipeline_cut) one layer a stage
    (one expert layer at least after a model's leading dense ones), the experts split as far
    as the rest of the world carves them, a global batch of at most 2 micro-batches a
    pipeline stage (2 for no pipeline) a data-parallel rank; run for STEPS steps with
    nothing saved or logged but metrics.jsonl."""
    par, hw, model, lay = cfg.parallel, cfg.hardware, cfg.model, cfg.pipeline
    world = hw.nodes * hw.devices_per_node
    pp, stages = pipeline_cut(cfg, world)
    layers = min(model.n_layers, pp * stages)
    kept = [o for o in overrides if not o.lstrip("+~").startswith(OWN)]
    cut = [*kept, f"model.n_layers={layers}"]
    if model.n_routed_experts and model.n_dense_layers >= layers:
        cut.append(f"model.n_dense_layers={layers - 1}")
    if (pp, stages) != (par.pp, lay.stages_per_rank):
        cut += [f"parallel.pp={pp}", f"pipeline.stages_per_rank={stages}"]
    if lay.layers_per_stage or lay.first_stage_layers or lay.last_stage_layers:
        cut += ["pipeline.layers_per_stage=[]", "pipeline.first_stage_layers=0",
                "pipeline.last_stage_layers=0"]  # fmt: skip
    fixed = par.tp * par.cp * par.dp_replicate * pp
    if world % fixed == 0:  # else the planner says why the world does not hold the run
        shard = world // fixed
        if par.dp_shard not in (-1, shard):
            cut.append(f"parallel.dp_shard={shard}")
        if (ep := carved_ep(cfg, world, pp)) != par.ep:
            cut.append(f"parallel.ep={ep}")
        dp, micro = shard * par.dp_replicate, cfg.train.micro_batch_size
        gbs = cfg.train.global_batch_size
        per_rank = min(max(gbs // (micro * dp), pp), 2 * pp)
        if gbs != micro * dp * per_rank or lay.microbatches:
            cut += [f"train.global_batch_size={micro * dp * per_rank}", "pipeline.microbatches=0"]
    return [*cut, *QUIET]


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
