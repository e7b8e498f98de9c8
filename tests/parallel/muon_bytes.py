"""What Muon exchanges and orthogonalises in one real training step, against the planner.

A job of tests/group.py: `job(OUT_DIR, *OVERRIDES)` builds the engine's Trainer for the composed
config (expert_bias.build_trainer: fp32, the parity batch), runs one step and writes
OUT_DIR/RANK.json: {"sent": bytes this rank's Muon sent to other ranks (launcher/training/
spread.py's messages), "flops": the Newton-Schulz FLOPs of the matrices it owned, "planned":
the planner's shares (launcher/plan/terms/muon.py) for this rank's pipeline stage}.
"""

from __future__ import annotations

import json
from pathlib import Path

from launcher.plan.context import layout_ranks
from launcher.plan.terms import rank_steps
from launcher.plan.terms.muon import shares
from launcher.training import spread
from parallel.expert_bias import build_trainer


def job(out: Path, *overrides: str) -> None:
    """One step of the overrides; writes OUT/RANK.json."""
    counted = {"sent": 0, "flops": 0.0}
    exchange, orthogonalised = spread._exchange, spread.orthogonalised

    def counting_exchange(sends, sizes, like):
        counted["sent"] += sum(b.numel() * b.element_size() for b in sends.values())
        return exchange(sends, sizes, like)

    def counting(units, directions, offsets, me, orthogonalise):
        steps = orthogonalise.keywords["steps"]
        counted["flops"] += sum(spread.ns_flops(u.shape, steps) for u in units if u.owner == me)
        return orthogonalised(units, directions, offsets, me, orthogonalise)

    spread._exchange, spread.orthogonalised = counting_exchange, counting
    try:
        trainer = build_trainer(out, ["train.steps=1", *overrides])
        trainer.train_step(1)
    finally:  # the next job in this process steps as usual
        spread._exchange, spread.orthogonalised = exchange, orthogonalised
    plan = trainer.plan
    # No pipeline in these cases: every rank alike.
    step = rank_steps(plan.context, plan.layout, layout_ranks(plan.context, plan.layout))[0]
    planned = [
        {"sent": s.sent, "flops": s.flops, "largest": s.largest_flops, "workers": s.workers}
        for s in shares(step)
    ]
    (out / f"{trainer.d.rank}.json").write_text(json.dumps({**counted, "planned": planned}))
