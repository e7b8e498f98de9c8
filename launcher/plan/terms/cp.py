"""cp: context parallelism's K/V exchanges in each layer's attention.

allgather: all of it is exposed: attention needs the gathered K/V before it starts, and dK/dV
only exist once it is done. ring: each hop's transfer overlaps the attention of the block the
rank holds meanwhile (under load balancing each of the cp blocks is 1/cp of the rank's
attention work; backward's is twice forward's), so per hop only max(0, transfer - block) is
exposed. Backward: step 0 hides the first K/V hop, steps 1 to cp - 2 a K/V hop and the previous
step's accumulator hop (the same link), the last step the accumulator before it, and the
accumulator's last hop home has nothing left to hide behind.
"""

from __future__ import annotations

from launcher.layout import Layout
from launcher.plan import comm
from launcher.plan.context import Context
from launcher.plan.terms.base import Step, Term


def kv_bytes(ctx: Context, lay: Layout) -> float:
    """K and V this rank holds for one micro-batch: its S / cp tokens of its 1 / tp of the kv
    heads (GQA: kv heads only)."""
    s = ctx.shape
    return lay.micro_batch_size * ctx.seq / lay.cp * (s.k_width + s.v_width) / lay.tp * ctx.act_b


def cp_bytes_sent(ctx: Context, lay: Layout, recomputed: bool | None = None) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends for context parallelism, per layer and
    micro-batch; backward includes the forward's rerun under recompute (selective recomputes
    the attention core, full the block, both the core's communication). An all-gather sends
    the rank's K/V to cp - 1 ranks and the reduce-scatter of the gradients as much back; the
    ring sends it cp - 1 hops forward and again backward, plus cp hops of the fp32 dK/dV
    accumulators. Left out: the ranks' key positions (8 bytes per position, shared by the
    micro-batch; for one 128-wide kv head in bf16, 1.6% of its K/V)."""
    kv = kv_bytes(ctx, lay)
    forward = (lay.cp - 1) * kv
    backward = forward + (lay.cp * kv * 4 / ctx.act_b if lay.context_method == "ring" else 0.0)
    if lay.recompute != "none" if recomputed is None else recomputed:
        backward += forward
    return forward, backward


def cp_layer_time(ctx: Context, lay: Layout, recomputed: bool | None = None) -> float:
    """Exposed context-parallel communication, seconds per layer and micro-batch."""
    group = comm.group(ctx.links, lay.cp, lay.tp)
    rerun = lay.recompute != "none" if recomputed is None else recomputed
    kv = kv_bytes(ctx, lay)
    if lay.context_method != "ring":
        gather = comm.all_gather(group, lay.cp * kv)  # the whole gathered K/V
        return gather * (3 if rerun else 2)  # + the gradients' reduce-scatter (+ the rerun)
    cp = lay.cp
    hop = comm.send(group, kv)  # one K/V block
    acc = comm.send(group, kv * 4 / ctx.act_b)  # one block's fp32 dK/dV
    tokens = lay.micro_batch_size * ctx.seq / cp
    block = tokens * ctx.attn_core_flops / 3 / (lay.tp * cp) / ctx.attention_rate  # forward
    if ctx.host_serial:
        block = 0.0  # gloo's transfers run on the cores that compute: nothing hides them
    t_forward = (cp - 1) * max(0.0, hop - block)
    t_backward = (
        max(0.0, hop - 2 * block)
        + (cp - 2) * max(0.0, hop + acc - 2 * block)
        + max(0.0, acc - 2 * block)
        + acc
    )
    return t_forward * (2 if rerun else 1) + t_backward


def cp(step: Step) -> Term | None:
    ctx, lay = step.ctx, step.lay
    if lay.cp == 1:
        return None
    plain = step.layers - step.recomputed
    per_mb = step.recomputed * cp_layer_time(ctx, lay) + plain * cp_layer_time(ctx, lay, False)
    exposed = step.microbatches * per_mb
    forward, backward = cp_bytes_sent(ctx, lay)
    group = comm.group(ctx.links, lay.cp, lay.tp)
    work = step.microbatches * step.layers * (forward + backward) / group.bandwidth
    if lay.context_method != "ring":  # all of it exposed (the module's docstring)
        return Term("cp", exposed, exposed)
    return Term("cp", exposed, max(work, exposed), "each hop behind a block's attention")
