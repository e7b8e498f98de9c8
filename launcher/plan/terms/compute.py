"""compute: the forward and backward kernels of every micro-batch on the bottleneck rank,
priced by their shapes (launcher/plan/kernels.py), plus the host's time launching them where
the kernels do not hide it."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.layout import Layout
from launcher.plan import kernels
from launcher.plan.context import Context, loss_compiled
from launcher.plan.kernels import gemm_efficiency
from launcher.plan.terms.base import Step, Term


@dataclass(frozen=True)
class LayerCost:
    """Seconds of one layer's forward + backward for one micro-batch on one rank."""

    gemm: float  # its matmuls (an MoE layer's routed experts' apart)
    core: float  # the attention core (scores and weighted sum)
    memory: float  # the memory-bound operators between them
    experts: float = 0.0  # an MoE layer's router and routed experts (see `experts_seconds`)
    casts: float = 0.0  # precision.fp8: the float8 linears' casts (`fp8_cast_seconds`)

    @property
    def total(self) -> float:
        return self.gemm + self.core + self.memory + self.experts + self.casts


def gemm_seconds(ctx: Context, flops: float, width: float) -> float:
    """Seconds of `flops` of GEMMs whose narrowest dimension is `width`."""
    if flops <= 0:
        return 0.0
    eff = ctx.measured or gemm_efficiency(width, ctx.scale)
    return flops / (ctx.peak * eff)


def linear_seconds(ctx: Context, flops: float, width: float) -> float:
    """Seconds of a block's linear layers' GEMMs: float8 ones under precision.fp8, at the
    part's FP8 peak and its own share of the curve (an explicit hardware.efficiency, measured
    as configured, already holds it)."""
    if not ctx.fp8 or ctx.measured or flops <= 0:
        return gemm_seconds(ctx, flops, width)
    return flops / (ctx.fp8_peak * gemm_efficiency(width, ctx.fp8_scale))


def fp8_cast_seconds(ctx: Context, lay: Layout, tokens: float, hidden: int) -> float:
    """A layer's float8 casts (kernels.FP8_CAST_BYTES) for a micro-batch of `tokens`: every
    side of every block linear per token, its weights once per micro-batch; `hidden` is the
    MLP's width (the shared experts' in an MoE layer)."""
    s, m, tp = ctx.shape, ctx.model, lay.tp
    per_side, per_weight = kernels.FP8_CAST_BYTES
    mlp = ctx.fp8_mlp_sides if hidden else 0
    whole = (4 + mlp) * m.dim
    split = (s.q_width + s.k_width + s.v_width + s.o_width + mlp * hidden) / tp
    weights = (s.attn_params + mlp * m.dim * hidden) / tp + s.attn_latent
    return ctx.fused * (tokens * (whole + split) * per_side + weights * per_weight) / ctx.memory_bw


def layer_cost(ctx: Context, lay: Layout, moe: bool, tokens: float) -> LayerCost:
    """One dense (or MoE) layer on a rank of `lay`, for a micro-batch of `tokens` tokens."""
    s, m, tp = ctx.shape, ctx.model, lay.tp
    # GEMMs: 6 FLOPs per weight and token (forward, input and weight gradients); a tp shard
    # runs 1/tp of the weights on every token of the micro-batch (and MLA's latent
    # down-projections whole).
    attention = linear_seconds(
        ctx, 6 * (s.attn_params / tp + s.attn_latent) * tokens, min(m.dim, s.o_width / tp, tokens)
    )
    if not moe:
        mlp = linear_seconds(
            ctx, 6 * s.dense_mlp_params / tp * tokens, min(m.dim, m.ffn_dim / tp, tokens)
        )
        hidden = m.ffn_dim
    else:
        shared = linear_seconds(
            ctx,
            6 * s.moe_shared_params / tp * tokens,
            min(m.dim, m.moe_ffn_dim, tokens),
        )
        mlp = shared
        hidden = m.n_shared_experts * m.moe_ffn_dim
    core = tokens * ctx.attn_core_flops / tp / ctx.attention_rate
    if lay.cp >= kernels.CP_SLOW_FROM:  # the core split over many CP ranks (kernels.py)
        core *= kernels.CP_ATTENTION_SLOWDOWN
    width = m.dim / (tp if lay.sequence_parallel else 1)
    elements = (
        ctx.elementwise_dim * width
        + ctx.elementwise_mlp * hidden / tp
        + ctx.elementwise_scores * ctx.seq / tp
    )
    memory = tokens * elements * ctx.act_b / ctx.memory_bw
    return LayerCost(
        attention + mlp,
        core,
        memory,
        experts_seconds(ctx, lay, tokens) if moe else 0,
        fp8_cast_seconds(ctx, lay, tokens, hidden) if ctx.fp8 else 0,
    )


def experts_seconds(ctx: Context, lay: Layout, tokens: float) -> float:
    """An MoE layer's routed part for a micro-batch of `tokens` (split over tp ranks), forward
    and backward, as launcher/models/moe.py runs it: the router's GEMM and scores, the token copies'
    permutation to their experts and back (kernels.MOE_BYTES), the grouped GEMMs at the rows
    each expert receives under balanced routing (narrow ones run slowly), the SwiGLU between
    them, and under autocast the weight stacks' cast to the compute dtype and their gradients'
    back. Where no grouped kernel runs, the same GEMMs one expert at a time, whose launches
    the host pays (`Context.ops_moe`)."""
    m = ctx.model
    own = tokens / lay.tp
    copies = own * m.top_k
    per_expert = copies * lay.ep / m.n_routed_experts
    router = gemm_seconds(
        ctx, 6 * m.dim * m.n_routed_experts * own, min(m.dim, m.n_routed_experts, own)
    )
    routed = gemm_seconds(
        ctx,
        6 * 3 * m.dim * m.moe_ffn_dim * copies,
        min(m.dim, m.moe_ffn_dim, max(1.0, per_expert)),
    )
    per_copy, per_score = kernels.MOE_BYTES
    traffic = (
        ctx.fused * (copies * per_copy * m.dim + own * per_score * m.n_routed_experts)
        + copies * ctx.elementwise_mlp * m.moe_ffn_dim * ctx.act_b
    )
    if ctx.master_b and not (lay.dp_cp > 1 and lay.fsdp_enabled):  # autocast's casts
        stacks = 3 * m.n_routed_experts / lay.ep * m.dim * m.moe_ffn_dim
        traffic += stacks * 2 * (ctx.master_b + ctx.act_b)
    return router + routed + traffic / ctx.memory_bw


def head_seconds(ctx: Context, lay: Layout, tokens: float) -> float:
    """The output projection and the loss over its logits (the bytes it moves per logit,
    kernels.loss_traffic_bytes, eager or compiled as the trainer runs it), for one
    micro-batch: once for the next token and once per multi-token-prediction depth, each
    depth with its projection of the two joined inputs (its block is a layer's)."""
    m, depths = ctx.model, ctx.shape.ahead_layers
    vocab = m.vocab_size / lay.tp
    gemm = gemm_seconds(ctx, 6 * vocab * m.dim * tokens, min(m.dim, vocab, tokens))
    traffic = kernels.loss_traffic_bytes(ctx.act_b, loss_compiled(ctx.cfg, lay))
    head = gemm + tokens * vocab * traffic / ctx.memory_bw
    if not depths:
        return head
    joined = gemm_seconds(ctx, 6 * 2 * m.dim * m.dim * tokens, min(m.dim, tokens))
    return head + depths * (head + joined)


def layer_costs(ctx: Context, lay: Layout) -> tuple[LayerCost, LayerCost | None]:
    """(a dense layer's, an MoE layer's or None) cost for one micro-batch on a rank of `lay`:
    the same on every pipeline rank."""
    tokens = lay.micro_batch_size * ctx.seq / lay.cp
    moe = layer_cost(ctx, lay, True, tokens) if ctx.moe else None
    return layer_cost(ctx, lay, False, tokens), moe


def rank_micro(ctx: Context, lay: Layout, costs, layers: int, dense: int, ends: bool, head: bool):
    """(device, host) seconds of one micro-batch's forward + backward on a pipeline rank that
    holds `layers` layers, `dense` of them dense, at the per-layer `costs` (layer_costs)."""
    dense_cost, moe_cost = costs
    device = dense * dense_cost.total
    if layers > dense:
        device += (layers - dense) * moe_cost.total
    if head:
        device += head_seconds(ctx, lay, lay.micro_batch_size * ctx.seq / lay.cp)
    ops = dense * ctx.ops_dense + (layers - dense) * ctx.ops_moe
    if ctx.expert_loop:
        ops += (layers - dense) * kernels.OPS_PER_EXPERT * ctx.model.n_routed_experts / lay.ep
    ops *= kernels.DTENSOR_HOST if lay.tp > 1 else 1.0
    ops += ctx.ops_outside if ends else 0
    return device, ops * ctx.op_overhead


def exposed_host(ctx: Context, device: float, host: float) -> float:
    """Host time the step waits for: all of it on a CPU (the same cores run the kernels),
    on a GPU what the kernels queued meanwhile do not cover."""
    return host if ctx.host_serial else max(0.0, host - device)


def compute(step: Step) -> Term:
    """Every kernel of the step's micro-batches but the routed experts' (`experts`), the
    host's launches where they show, and the part's time per micro-batch between them."""
    mbs = step.microbatches
    host = exposed_host(step.ctx, step.device, step.host)
    between = step.ctx.microbatch_overhead
    seconds = mbs * (step.device - routed_device(step) + host + between)
    return Term("compute", seconds, seconds)


def routed_device(step: Step) -> float:
    """Seconds of one micro-batch's router and routed experts on the bottleneck rank."""
    moe = step.costs[1]
    return step.moe * moe.experts if moe is not None else 0.0


def experts(step: Step) -> Term | None:
    """The MoE layers' routers and routed experts (experts_seconds), apart from compute so a
    plan shows what the experts cost."""
    if not step.moe:
        return None
    seconds = step.microbatches * routed_device(step)
    return Term("experts", seconds, seconds)
