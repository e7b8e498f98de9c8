"""A step's time as a list of named cost terms, one small unit per cause.

Each term is a function of the bottleneck rank's `Step` (and the terms before it, in
`step.done`) returning a `Term` (its exposed seconds, its work before overlap, what hides the
rest) or None where the layout does not have it. `TERMS` registers them in the order they are
computed: the pipeline's bubble idles on the work before it, and data-parallel traffic hides
behind compute. Reports, JSON and the search iterate over the list; a new cause is one new
module and one line here.
"""

from __future__ import annotations

from launcher.layout import Layout, last_stage_rank
from launcher.plan.context import Context, layout_ranks, layout_recomputed
from launcher.plan.terms.base import Step, Term, Time
from launcher.plan.terms.checkpoint import checkpoint
from launcher.plan.terms.compute import compute, experts, layer_costs, rank_micro
from launcher.plan.terms.cp import cp
from launcher.plan.terms.dp import dp
from launcher.plan.terms.ep import ep
from launcher.plan.terms.muon import muon
from launcher.plan.terms.optimizer import optimizer
from launcher.plan.terms.pp import bubble_fraction, pp
from launcher.plan.terms.qk_clip import qk_clip
from launcher.plan.terms.recompute import recompute
from launcher.plan.terms.tp import tp

TERMS = (compute, experts, recompute, qk_clip, tp, cp, ep, pp, dp, optimizer, muon, checkpoint)
NAMES = tuple(t.__name__ for t in TERMS)


def rank_steps(ctx: Context, lay: Layout, ranks) -> list[Step]:
    """Each pipeline rank's Step (its layers, reruns, and whether it holds the head or the
    embedding), the first of each kind only: ranks alike take the same time."""
    head_rank = last_stage_rank(lay.pp, lay.schedule)
    recomputed = layout_recomputed(ctx, lay)
    costs = layer_costs(ctx, lay)
    out, seen = [], set()
    for r, (layers, dense) in enumerate(ranks):
        head = r == head_rank
        kind = (layers, dense, recomputed[r], head, r == 0)
        if kind in seen:
            continue
        seen.add(kind)
        device, host = rank_micro(ctx, lay, costs, layers, dense, head or r == 0, head)
        rc_dense, rc_moe = recomputed[r]
        out.append(
            Step(
                ctx=ctx,
                lay=lay,
                rank=r,
                layers=layers,
                dense=dense,
                rc_dense=rc_dense,
                rc_moe=rc_moe,
                holds_head=head,
                holds_embedding=r == 0,
                mb_tokens=lay.micro_batch_size * ctx.seq / lay.cp,
                costs=costs,
                device=device,
                host=host,
            )
        )
    return out


def step_time(ctx: Context, lay: Layout, ranks=None) -> Time:
    """Predicted seconds per step on the bottleneck pipeline rank, term by term: the rank
    whose whole step (every term: its layers' compute and their communication, reruns, the
    head) is longest, as the pipeline runs at its slowest stage's pace."""
    slowest = None
    for step in rank_steps(ctx, lay, ranks if ranks is not None else layout_ranks(ctx, lay)):
        for term in TERMS:
            found = term(step)
            if found is not None:
                step.done[found.name] = found
        time = Time(tuple(step.done.values()), bubble_fraction(step))
        if slowest is None or time.step > slowest.step:
            slowest = time
    return slowest


__all__ = ["NAMES", "TERMS", "Step", "Term", "Time", "step_time"]
