"""optimizer=muon's step against AdamW's: the engine's training step on one process, the same
model, batch and layout, the two taking turns (launcher/bench/timing.py); beside them what the
planner predicts for each (its `muon` term: the Newton-Schulz iterations; AdamW's and the
momentum's passes are its `optimizer` term)."""

from __future__ import annotations

from launcher.bench.peers import engine
from launcher.bench.timing import interleaved, least_disturbed
from launcher.bench.timing import threads as torch_threads

ADAMW, MUON = "adamw", "muon"


def muon_against_adamw(
    overrides: list[str], rounds: int, steps: int, warmup: int, threads: int, progress=print
) -> dict:
    """Seconds per step of each optimizer (fastest of the turns) and the planner's."""
    with torch_threads(threads):
        adamw, work, adamw_plan = engine([*overrides, "optimizer=adamw"])
        muon, _, muon_plan = engine([*overrides, "optimizer=muon"])
        times = interleaved(
            {ADAMW: adamw, MUON: muon}, rounds, steps, warmup, work.device, progress
        )
    best = {name: least_disturbed(t) for name, t in times.items()}
    planned = {ADAMW: adamw_plan.estimate.time, MUON: muon_plan.estimate.time}
    return {
        "model": work.model["name"],
        "tokens_per_step": work.tokens,
        "best": best,
        "ratio": best[MUON] / best[ADAMW],
        "planned": {name: t.step for name, t in planned.items()},
        "planned_ratio": planned[MUON].step / planned[ADAMW].step,
        "planned_muon_term": planned[MUON]["muon"],
    }
