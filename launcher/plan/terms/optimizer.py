"""optimizer: the step after the last micro-batch, memory-bound: AdamW reads each parameter
this rank updates, its gradient, master copy and both moments and writes all but the gradient
back; the gradient-norm clip reads the gradients once more and zeroing writes them. ZeRO-1 and
up update the rank's shard only. Nothing runs beside it."""

from __future__ import annotations

from launcher.plan.terms.base import Step, Term
from launcher.plan.terms.dp import rank_parameters


def optimizer(step: Step) -> Term:
    ctx, lay = step.ctx, step.lay
    params = rank_parameters(step)
    shard = lay.dp_shard * lay.cp
    if lay.zero_stage >= 1 and shard > 1:
        params /= shard
    per_param = 2 * ctx.param_b + 3 * ctx.grad_b + 2 * ctx.master_b + 2 * ctx.optim_b
    seconds = params * per_param / ctx.memory_bw
    return Term("optimizer", seconds, seconds)
