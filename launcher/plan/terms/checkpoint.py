"""checkpoint: a save every checkpoint.interval steps, spread over those steps: the most loaded
node's share at the storage's bandwidth (launcher/plan/checkpoint_size.py); under
checkpoint.async_save it is written while training goes on."""

from __future__ import annotations

from launcher.plan.checkpoint_size import checkpoint_size
from launcher.plan.terms.base import Step, Term


def checkpoint(step: Step) -> Term | None:
    ck = step.ctx.cfg.checkpoint
    if ck.interval <= 0:
        return None  # saves only at the end and on a stop
    seconds = checkpoint_size(step.ctx, step.lay).save_seconds / ck.interval
    if ck.async_save:
        return Term("checkpoint", 0.0, seconds, "training (async_save)")
    return Term("checkpoint", seconds, seconds)
