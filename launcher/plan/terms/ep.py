"""ep: expert parallelism's dispatch and combine all-to-alls, forward and backward (and once
more forward for a recomputed layer), all exposed: DualPipe hides them behind the other
chunk's compute, but torch 2.13's DualPipeV runs its overlapped forward and backward one after
the other unless a custom function is registered for them, and this engine registers none."""

from __future__ import annotations

from launcher.layout import Layout
from launcher.plan import comm
from launcher.plan.context import Context
from launcher.plan.terms.base import Step, Term


def ep_layer_bytes(ctx: Context, lay: Layout, recomputed: bool | None = None) -> float:
    """Bytes one rank sends to other ranks per MoE layer and step in the expert-parallel
    all-to-alls, with balanced routing: each micro-batch's routed copies (its tokens split
    over cp and tp, top_k copies of dim values each) go out in the dispatch and come back in
    the combine, forward and backward (and once more forward when the layer is recomputed,
    full or op: `recomputed`, by default whether the layout recomputes); with E / ep experts per
    rank, (ep - 1) / ep of them leave the rank."""
    if recomputed is None:
        recomputed = lay.recompute in ("full", "op")
    passes = 6 if recomputed else 4
    return lay.microbatches * passes * routed_bytes(ctx, lay) * (lay.ep - 1) / lay.ep


def routed_bytes(ctx: Context, lay: Layout) -> float:
    """Bytes of one micro-batch's routed copies on one rank (one all-to-all's input)."""
    m = ctx.model
    return lay.micro_batch_size * ctx.seq / (lay.cp * lay.tp) * m.top_k * m.dim * ctx.act_b


def ep(step: Step) -> Term | None:
    ctx, lay = step.ctx, step.lay
    if lay.ep == 1 or not step.moe:
        return None
    group = comm.group(ctx.links, lay.ep, 1)
    one = comm.all_to_all(group, routed_bytes(ctx, lay))
    rerun = lay.recompute in ("full", "op")
    plain = step.moe - (step.rc_moe if rerun else 0)
    passes = 4 * plain + 6 * (step.moe - plain)
    seconds = step.microbatches * passes * one
    return Term("ep", seconds, seconds)
