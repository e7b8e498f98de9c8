"""pp: the pipeline's bubble (each schedule's idle share of the work it waits on) and the
activations and gradients sent between stages, which each stage waits for before it runs
(torch's schedules post the receives before the compute that needs them)."""

from __future__ import annotations

from launcher.plan import bubble as pl
from launcher.plan import comm
from launcher.plan.terms.base import Step, Term

# What the bubble idles on: every term a micro-batch's stage work waits for.
STAGE_WORK = ("compute", "recompute", "tp", "cp", "ep")


def bubble_fraction(step: Step) -> float:
    lay = step.lay
    return pl.bubble_fraction(lay.schedule, lay.pp, lay.stages_per_rank, lay.microbatches)


def pp(step: Step) -> Term | None:
    ctx, lay = step.ctx, step.lay
    if lay.pp == 1:
        return None
    bubble = bubble_fraction(step) * step.exposed(*STAGE_WORK)
    group = comm.group(ctx.links, lay.pp, lay.dp * lay.cp * lay.tp)
    width = ctx.model.dim / (lay.tp if lay.sequence_parallel else 1)
    message = comm.send(group, step.mb_tokens * width * ctx.act_b)
    sends = 2 * lay.stages_per_rank * step.microbatches * message
    return Term("pp", bubble + sends, bubble + sends)
