"""tp: tensor parallelism's collectives, all exposed.

Per layer and micro-batch, 4 all-reduces of the (b, s, h) activations (2 forward, 2 backward);
with sequence parallelism each is a reduce-scatter + all-gather of the same tensor, and
backward gathers the two saved norm-output shards again where the hooks keep shards (eager
blocks not checkpointed) or per-op recompute reruns the gathers; full recompute reruns the
forward's 2. The engine's DTensor TP (launcher/parallel/tensor_parallel.py) runs each
collective between the matmuls that need it, with no async TP to overlap them.
"""

from __future__ import annotations

from launcher.plan import comm
from launcher.plan.terms.base import Step, Term


def tp(step: Step) -> Term | None:
    ctx, lay = step.ctx, step.lay
    if lay.tp == 1:
        return None
    units = 4 * step.layers
    if lay.recompute == "full":
        units += 2 * step.recomputed
    sp = lay.sequence_parallel
    if sp and lay.recompute == "op":
        units += step.recomputed
    if sp and not ctx.compiled:
        units += step.layers - (step.recomputed if lay.recompute in ("full", "op") else 0)
    group = comm.group(ctx.links, lay.tp, 1)
    nbytes = step.mb_tokens * ctx.model.dim * ctx.act_b
    if sp:
        one = comm.all_gather(group, nbytes) + comm.reduce_scatter(group, nbytes)
    else:
        one = comm.all_reduce(group, nbytes)
    seconds = step.microbatches * units * one
    return Term("tp", seconds, seconds)
