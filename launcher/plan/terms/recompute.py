"""recompute: forward work rerun in backward, on the bottleneck rank.

full reruns the recomputed blocks' forward (a third of their forward + backward); selective
reruns their attention core, and so does op when the core is unfused (op keeps fused
attention's output); op also reruns the memory-bound forward operators (norms, activations,
rotary: a third of their forward + backward time; measured on an H200, Llama 3.2 1B at 8,192
tokens: op 2.2% slower than none, docs/speed.md); op reruns the matmuls whose outputs it does
not keep: under recompute.matmuls=alternate every other one, under tp in eager blocks the
attention output projection's partial sum (parallel/recompute.py; the MLP's, last in the block,
the recompute stops before). Document masking reruns the attention forward in
backward (models.layers document_attention) in the layers no recompute reran already, except
in the CPU fused kernel, which takes the rebuilt mask itself; CP's blocks rebuild theirs in
their own backward.
"""

from __future__ import annotations

from launcher.plan import kernels
from launcher.plan.model_size import block_matmuls
from launcher.plan.terms.base import Step, Term
from launcher.plan.terms.compute import exposed_host, linear_seconds


def matmul_rerun(step: Step) -> float:
    """Seconds of the matmuls op reruns in one recomputed block: those whose outputs it does
    not keep (recompute.matmuls=alternate: every other one; under tp in eager blocks the
    row-parallel partial sums too), up to the last the backward needs (the block's last
    matmul, its output read by no backward, is not rerun)."""
    ctx, lay = step.ctx, step.lay
    m, tokens = ctx.model, step.mb_tokens
    partial_sums = lay.tp > 1 and not ctx.compiled
    if lay.recompute_matmuls == "all" and not partial_sums:
        return 0.0
    seconds = 0.0
    for mm in block_matmuls(m, lay.recompute_matmuls)[:-1]:
        if not mm.kept or (mm.row and partial_sums):
            split = 1 if mm.whole else lay.tp
            flops = 2 * mm.out * mm.inp * tokens / split
            width = min(mm.out, mm.inp / split) if mm.row else min(mm.out / split, mm.inp)
            seconds += linear_seconds(ctx, flops, width)
    return seconds


def recompute(step: Step) -> Term | None:
    ctx, lay = step.ctx, step.lay
    mode = lay.recompute
    dense, moe = step.costs
    core = dense.core / 3  # one attention forward
    rerun = host = 0.0
    core_rerun = mode == "selective" or (mode == "op" and not ctx.flash)
    if mode == "full":
        rerun = (step.rc_dense * dense.total + (step.rc_moe * moe.total if step.rc_moe else 0)) / 3
        host = (step.rc_dense * ctx.ops_dense + step.rc_moe * ctx.ops_moe) / 3 * ctx.op_overhead
        host *= kernels.DTENSOR_HOST if lay.tp > 1 else 1.0
    elif core_rerun:
        rerun = step.recomputed * core
    if mode == "op":  # it reruns the memory-bound forward operators between the matmuls it kept
        rerun += (
            step.rc_dense * dense.memory + (step.rc_moe * moe.memory if step.rc_moe else 0)
        ) / 3
    if ctx.document_rerun and lay.cp == 1:
        again = step.recomputed if mode == "full" or core_rerun else 0
        rerun += (step.layers - again) * core
    if mode == "op":
        rerun += step.recomputed * matmul_rerun(step)
    if not rerun and not host:
        return None  # nothing reruns
    mbs = step.microbatches
    seconds = mbs * (rerun + exposed_host(ctx, rerun, host))
    return Term("recompute", seconds, seconds)
