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
from launcher.plan.terms.optimizer import optimizer
from launcher.plan.terms.pp import bubble_fraction, pp
from launcher.plan.terms.recompute import recompute
from launcher.plan.terms.tp import tp

TERMS = (compute, experts, recompute, tp, cp, ep, pp, dp, optimizer, checkpoint)
NAMES = tuple(t.__name__ for t in TERMS)


def bottleneck(ctx: Context, lay: Layout, ranks) -> Step:
    """The pipeline rank whose micro-batches take longest (its layers, reruns and head)."""
    head_rank = last_stage_rank(lay.pp, lay.schedule)
    recomputed = layout_recomputed(ctx, lay)
    costs = layer_costs(ctx, lay)
    best = None
    for r, (layers, dense) in enumerate(ranks):
        head = r == head_rank
        device, host = rank_micro(ctx, lay, costs, layers, dense, head or r == 0, head)
        rc_dense, rc_moe = recomputed[r]
        step = Step(
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
        # Reruns weigh too: compare forward + backward + a third of the recomputed layers'.
        weight = device + host + (rc_dense + rc_moe) * device / max(1, layers) / 3
        if best is None or weight > best[0]:
            best = (weight, step)
    return best[1]


def step_time(ctx: Context, lay: Layout, ranks=None) -> Time:
    """Predicted seconds per step on the bottleneck pipeline rank, term by term."""
    step = bottleneck(ctx, lay, ranks if ranks is not None else layout_ranks(ctx, lay))
    for term in TERMS:
        found = term(step)
        if found is not None:
            step.done[found.name] = found
    return Time(tuple(step.done.values()), bubble_fraction(step))


__all__ = ["NAMES", "TERMS", "Step", "Term", "Time", "step_time"]
