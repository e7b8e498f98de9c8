"""qk_clip: optimizer.qk_clip's largest-logit pass (launcher/models/layers.py max_logits): each
attention's forward computes q k^T once more, unfused, for every query row of the rank's
micro-batch against every key of its sequence (no causal skip: the mask only hides scores), and
again where the layer reruns its forward in backward; under context parallelism over every
rank's keys, gathered (an all-gather of the keys over cp). The clip's scaling of the rows after
the step is a few element-wise passes over q and k's weights, left out."""

from __future__ import annotations

from launcher.plan import comm
from launcher.plan.terms.base import Step, Term
from launcher.plan.terms.compute import gemm_seconds


def qk_clip(step: Step) -> Term | None:
    ctx, lay = step.ctx, step.lay
    if ctx.cfg.optimizer.qk_clip <= 0:
        return None
    s = ctx.shape
    tokens = step.mb_tokens  # the micro-batch's, of this cp rank
    flops = 2 * tokens * ctx.seq * s.q_width / lay.tp  # per layer and micro-batch
    layer = gemm_seconds(ctx, flops, min(s.d_qk, tokens))
    if lay.cp > 1:
        keys = tokens * s.k_width / lay.tp * ctx.act_b
        layer += comm.all_gather(comm.group(ctx.links, lay.cp, lay.tp), lay.cp * keys)
    seconds = step.microbatches * (step.layers + step.recomputed) * layer
    return Term("qk_clip", seconds, seconds)
