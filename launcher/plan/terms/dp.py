"""dp: the data-parallel axis's gradient reductions and parameter gathers, and what of them
the compute hides.

DDP and ZeRO-1 all-reduce the gradients once per step in 25 MiB buckets, behind the last
micro-batch's backward; FSDP gathers each block's parameters for forward (and again for
backward at stage 3) and reduce-scatters its gradients every micro-batch, prefetched under that
micro-batch's compute (under a pipeline without reshard_each_microbatch: once per step, as
torch's stages keep them gathered); HSDP all-reduces the sharded gradients across replicas as
well. The first gather and the last reduction have nothing to hide behind. On a CPU nothing
hides: gloo's collectives run on the cores that compute.
"""

from __future__ import annotations

import math

from launcher.plan import comm
from launcher.plan.terms.base import Step, Term

BUCKET = 25 * 2**20  # DDP's default bucket, bytes


def rank_parameters(step: Step) -> float:
    """Parameters of the bottleneck rank before data-parallel sharding."""
    ctx, lay = step.ctx, step.lay
    s, m = ctx.shape, ctx.model
    dense = s.attn_params + s.dense_mlp_params
    moe = s.attn_params + s.moe_shared_params
    params = (step.dense * dense + step.moe * moe) / lay.tp + step.moe * s.expert_params / lay.ep
    params += (step.dense + step.moe) * s.attn_latent + step.moe * s.router_params  # whole
    params += (s.embedding if step.holds_embedding else 0) / lay.tp
    params += (s.head if step.holds_head else 0) / lay.tp
    # Multi-token prediction's own (whole on every tp rank) and, under a pipeline, the last
    # stage's copy of the token table (its blocks are layers: step.moe).
    if step.holds_head and s.ahead_layers:
        params += s.ahead_own + (m.vocab_size * m.dim / lay.tp if lay.pp > 1 else 0)
    return params


def dp(step: Step) -> Term | None:
    ctx, lay = step.ctx, step.lay
    if lay.dp_cp == 1:
        return None
    params = rank_parameters(step)
    units = max(1, step.layers)  # FSDP's units: one per block
    shard = lay.dp_shard * lay.cp
    compute = step.exposed("compute", "recompute")
    if lay.zero_stage <= 1 or shard == 1:
        group = comm.group(ctx.links, lay.dp_cp, lay.tp)
        nbytes = params * ctx.grad_b
        buckets = max(1, math.ceil(nbytes / BUCKET))
        t = buckets * comm.all_reduce(group, nbytes / buckets)
        window = compute * 2 / 3 / lay.microbatches  # the last backward hides it
    else:
        group = comm.group(ctx.links, shard, lay.tp)
        gather = comm.all_gather(group, params / units * ctx.param_b)
        scatter = comm.reduce_scatter(group, params / units * ctx.grad_b)
        if lay.pp > 1 and not lay.reshard_each_microbatch:
            t = units * (gather + scatter)  # once per step
            window = compute * 2 / 3 / lay.microbatches
        else:
            gathers = 2 if lay.zero_stage == 3 else 1
            t = lay.microbatches * units * (gathers * gather + scatter)
            window = compute
        if lay.dp_replicate > 1:
            replicas = comm.group(ctx.links, lay.dp_replicate, shard * lay.tp)
            t += units * comm.all_reduce(replicas, params / units / shard * ctx.grad_b)
    if ctx.host_serial:
        return Term("dp", t, t)  # gloo's collectives run on the cores that compute: no overlap
    first_and_last = t / units / lay.microbatches * 2  # cannot overlap anything
    exposed = min(t, max(0.0, t - window) + first_and_last)
    return Term("dp", exposed, t, "backward and the next block's forward")
