"""Evaluate one layout: its rules, the memory of its most loaded rank and its step time.

`Context` holds what depends only on model, hardware, batch and precision (computed once);
`Layout` is one point of the search space; `evaluate(ctx, layout)` is the hot path of the
search, a few hundred arithmetic operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from launcher.config import Config
from launcher.layout import (
    Layout,
    last_stage_rank,
    rank_stages,
    recomputed,
    split_layers,
    stage_starts,
)
from launcher.plan import pipeline as pl
from launcher.plan.memory import (
    BYTES,
    GIB,
    cp_transient_bytes,
    layer_activation_bytes,
    op_layer_activation_bytes,
    reserve_gib,
    state_bytes,
)
from launcher.plan.model_size import Shape, active_matmul_params_per_token, flops_per_token, shape
from models import families

# Fraction of peak a transformer's matmuls sustain on A100: EFFICIENCY_MAX x dim / (dim +
# EFFICIENCY_DIM), wider layers running closer to the peak. Both fitted to the Megatron-LM table
# in docs/sources.md by `python -m launcher.plan.calibrate` (residuals in docs/planner.md).
EFFICIENCY_MAX = 0.586
EFFICIENCY_DIM = 440.0
# Compiled blocks (train.compile: torch.compile per block, inductor) run this much faster than
# eager ones: torchtitan's Llama 3.1 8B on H100, FSDP, bf16, 6,667 / 5,762 tokens/s on 8 GPUs
# and 6,514 / 5,605 on 128 (benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3). An
# assumption for other models and hardware, to refit with `calibrate --from`.
EFFICIENCY_COMPILED = 1.16


def compute_efficiency(dim: int, scale: float = 1.0, compiled: bool = False) -> float:
    """Fraction of peak the compute sustains: the A100 fit at this width, times the hardware
    generation's `scale` (hardware.efficiency_scale), times the compile speed-up."""
    fit = EFFICIENCY_MAX * dim / (dim + EFFICIENCY_DIM)
    return fit * scale * (EFFICIENCY_COMPILED if compiled else 1.0)


@dataclass
class Memory:
    """Bytes on the most loaded rank."""

    params: float
    grads: float
    master: float  # master weights (when their dtype differs from the parameters')
    optimizer: float  # Adam moments
    activations: float
    other: float  # transient unsharded parameters and gradients, logits, reserve
    rank: int  # pipeline rank it belongs to

    @property
    def total(self) -> float:
        return (
            self.params + self.grads + self.master + self.optimizer + self.activations + self.other
        )


@dataclass
class Time:
    compute: float
    tp: float  # exposed communication, seconds per step
    cp: float
    ep: float
    bubble: float
    dp: float
    bubble_fraction: float

    @property
    def step(self) -> float:
        return self.compute + self.tp + self.cp + self.ep + self.bubble + self.dp


@dataclass
class Estimate:
    layout: Layout
    memory: Memory | None = None
    time: Time | None = None
    tokens_per_s_per_device: float = 0.0
    mfu: float = 0.0


class Context:
    """Everything about a run that does not depend on its layout."""

    def __init__(self, cfg: Config):
        m, hw, t, p = cfg.model, cfg.hardware, cfg.train, cfg.precision
        self.cfg, self.model = cfg, m
        self.shape: Shape = shape(m)
        self.seq, self.global_batch = t.seq_len, t.global_batch_size
        self.document_mask = cfg.data.attention.value == "document"
        self.devices_per_node, self.nodes = hw.devices_per_node, hw.nodes
        self.world = hw.nodes * hw.devices_per_node
        self.capacity = hw.memory_gib * GIB
        self.reserve = reserve_gib(hw.device_type.value, hw.memory_gib) * GIB
        self.peak = hw.peak_tflops * 1e12
        # An explicit hardware.efficiency is what a run measured as configured: compile and the
        # generation's scale are already in it.
        self.efficiency = hw.efficiency or compute_efficiency(m.dim, hw.efficiency_scale, t.compile)
        self.sustained = self.efficiency * self.peak
        self.intra, self.inter = hw.intra_node_gbps * 1e9, hw.inter_node_gbps * 1e9
        self.param_b, self.grad_b = BYTES[p.param_dtype], BYTES[p.grad_dtype]
        self.master_b = BYTES[p.master_dtype] if p.master_dtype != p.param_dtype else 0
        self.optim_b = 2 * BYTES[p.optimizer_dtype]
        self.act_b = BYTES[p.compute_dtype]
        self.dropout = m.dropout > 0
        # Fused attention as the device runs it: torch's CPU kernel needs equal q/k and v head
        # widths and no dropout, and falls back to the unfused math (MLA, GPT's dropout).
        s = self.shape
        cpu_fuses = s.d_qk == s.d_v and not self.dropout
        self.flash = m.flash_attention and (hw.device_type.value == "cuda" or cpu_fuses)
        self.cp_method = cfg.context.method.value
        # Document masking keeps no mask for backward: the CPU fused kernel takes it rebuilt,
        # everything else reruns the attention forward (models.layers.document_attention).
        self.document_rerun = self.document_mask and not (
            m.flash_attention and hw.device_type.value == "cpu" and cpu_fuses
        )
        self.moe = m.n_routed_experts > 0
        self.model_flops_per_token = flops_per_token(m, self.seq)  # MFU's numerator
        self.active_params = active_matmul_params_per_token(self.shape, m)
        # Hardware FLOPs per token of one layer, split so recompute can scale the parts.
        self.attn_core_flops = (
            3 * self.seq * s.n_heads * (s.d_qk + s.d_v) * (1 if self.flash else 2)
        )
        self.dense_layer_flops = 6 * (s.attn_params + s.dense_mlp_params)
        routed = m.top_k * 3 * m.dim * m.moe_ffn_dim if self.moe else 0
        self.moe_layer_flops = 6 * (s.attn_params + routed + s.moe_shared_params)
        self.head_flops = 6 * m.vocab_size * m.dim
        self.dense_mlp_saved = (3 if families.of(m).gated_mlp else 2) * m.ffn_dim
        self.shared_mlp_saved = 3 * m.n_shared_experts * m.moe_ffn_dim
        # Each routed copy: its input row, its expert's 3 SwiGLU tensors and output row (kept for
        # the routing weight's gradient). Per token, in bytes: the router's fp32 scores, top-k
        # weights (twice) and sums, the int64 expert ids, sort order and token of each copy,
        # and with expert groups the groups' int64 top-2 ids and mask.
        self.routed_saved = m.top_k * (2 * m.dim + 3 * m.moe_ffn_dim) if self.moe else 0
        groups = 17 * m.n_group if m.n_group > 1 else 0
        self.routed_bytes = (
            4 * (m.n_routed_experts + 2 * m.top_k + 2) + 24 * m.top_k + groups if self.moe else 0
        )
        self.routed_out = (
            m.top_k * (2 * m.moe_ffn_dim + m.dim) + m.n_routed_experts if self.moe else 0
        )
        self.compiled = t.compile


@lru_cache(maxsize=4096)
def rank_layers(
    n_layers: int, n_dense: int, pp: int, v: int, schedule: str, split: tuple[int, ...] = ()
):
    """Per pipeline rank: (layers, dense layers among them)."""
    counts = list(split) or split_layers(n_layers, pp * v)
    starts = stage_starts(counts)
    out = []
    for r in range(pp):
        stages = rank_stages(r, pp, v, schedule)
        layers = sum(counts[i] for i in stages)
        dense = sum(max(0, min(starts[i] + counts[i], n_dense) - starts[i]) for i in stages)
        out.append((layers, dense))
    return tuple(out)


@lru_cache(maxsize=4096)
def recomputed_layers(
    n_layers: int,
    n_dense: int,
    pp: int,
    v: int,
    schedule: str,
    split: tuple[int, ...],
    every: int,
):
    """Per pipeline rank: (recomputed dense layers, recomputed MoE layers): the layers whose
    index in the model is a multiple of `every` (launcher.layout.recomputed)."""
    counts = list(split) or split_layers(n_layers, pp * v)
    starts = stage_starts(counts)
    out = []
    for r in range(pp):
        indices = [
            i
            for stage in rank_stages(r, pp, v, schedule)
            for i in range(starts[stage], starts[stage] + counts[stage])
            if recomputed(i, every)
        ]
        dense = sum(1 for i in indices if i < n_dense)
        out.append((dense, len(indices) - dense))
    return tuple(out)


def layout_recomputed(ctx: Context, lay: Layout):
    """Per pipeline rank of this layout: (recomputed dense layers, recomputed MoE layers);
    none without recompute."""
    if lay.recompute == "none":
        return ((0, 0),) * lay.pp
    return recomputed_layers(*_stage_shape(ctx, lay), lay.recompute_every)


def layout_ranks(ctx: Context, lay: Layout):
    """Per pipeline rank of this layout: (layers, dense layers among them)."""
    return rank_layers(*_stage_shape(ctx, lay))


def _stage_shape(ctx: Context, lay: Layout) -> tuple:
    """What places layers on pipeline ranks: layers, dense layers, pp, stages per rank,
    schedule, layers per stage."""
    s = ctx.shape
    return s.n_layers, s.n_dense_layers, lay.pp, lay.stages_per_rank, lay.schedule, lay.stage_layers


def group_bandwidth(ctx: Context, size: int, inner: int) -> float:
    """Per-device bandwidth of a group of `size` ranks whose members are `inner` ranks apart."""
    return ctx.intra if size * inner <= ctx.devices_per_node else ctx.inter


def layer_activation(ctx: Context, lay: Layout, dense: bool, recompute: str) -> float:
    s, m = ctx.shape, ctx.model
    if recompute == "op":
        shared = m.n_shared_experts * m.moe_ffn_dim
        return op_layer_activation_bytes(
            dim=m.dim,
            heads_out=s.heads_out_width,
            o=s.o_width,
            latent_out=s.latent_out_width,
            mlp_out=(2 if families.of(m).gated_mlp else 1) * m.ffn_dim if dense else 2 * shared,
            row_parallel=2 if dense or shared else 1,
            routed_out=0 if dense else ctx.routed_out,
            tp=lay.tp,
            sp=lay.sequence_parallel,
            flash=ctx.flash,
            act_b=ctx.act_b,
            compiled=ctx.compiled,
        )
    return layer_activation_bytes(
        dim=m.dim,
        q=s.q_width,
        k=s.k_width,
        v=s.v_width,
        o=s.o_width,
        latent=s.latent_width,
        mlp=ctx.dense_mlp_saved if dense else ctx.shared_mlp_saved,
        routed=0 if dense else ctx.routed_saved,
        routed_bytes=0 if dense else ctx.routed_bytes,
        n_heads=s.n_heads,
        seq=ctx.seq // lay.cp,
        tp=lay.tp,
        sp=lay.sequence_parallel,
        recompute=recompute,
        flash=ctx.flash,
        dropout=ctx.dropout,
        act_b=ctx.act_b,
        cp=lay.cp,
        cp_method=ctx.cp_method,
        sp_keeps_gathered=ctx.compiled,
        whole_mlp=dense or m.n_shared_experts > 0,
    )


@dataclass(frozen=True)
class RankParams:
    """The parameters a pipeline rank holds before any data-parallel sharding, and the ranks
    each kind is sharded over (FSDP, or ZeRO's optimizer side)."""

    dense: float  # tp-sharded where TP shards them
    experts: float  # its ep share of the routed experts
    dense_ranks: int
    expert_ranks: int

    def at_rest(self, lay: Layout) -> float:
        """What the rank keeps between steps: FSDP (and ZeRO-2, which reshards after
        backward) keeps shards, the rest keeps whole tensors."""
        if not lay.fsdp_enabled:
            return self.dense + self.experts
        return self.dense / self.dense_ranks + self.experts / self.expert_ranks


def rank_params(ctx: Context, lay: Layout, rank: int, layers: int, dense: int) -> RankParams:
    s, m = ctx.shape, ctx.model
    moe_layers = layers - dense
    first = rank == 0
    last = rank == last_stage_rank(lay.pp, lay.schedule)
    tp_sharded = (
        layers * s.attn_params + dense * s.dense_mlp_params + moe_layers * s.moe_shared_params
    )
    replicated = layers * (s.attn_replicated + s.norm_params) + dense * s.mlp_replicated
    # A tied embedding under a pipeline: the last stage holds its own copy of the token
    # embedding as its output projection (on rank 0 too under the V schedules).
    tied_copy = m.vocab_size * m.dim if last and m.tie_embeddings and lay.pp > 1 else 0
    emb = (s.embedding - s.positions if first else 0) + tied_copy
    replicated += s.positions if first else 0
    head = s.head if last else 0
    return RankParams(
        dense=(tp_sharded + emb + head) / lay.tp + replicated,
        experts=moe_layers * s.expert_params / lay.ep,
        dense_ranks=lay.dp_shard * lay.cp,
        # The experts' states are sharded (by their own FSDP unit, or ZeRO-1's) over the
        # ranks of one replica holding the same experts.
        expert_ranks=max(1, lay.dp_shard * lay.cp * lay.tp // lay.ep),
    )


def rank_memory(ctx: Context, lay: Layout, rank: int, layers: int, dense: int) -> Memory:
    s, m = ctx.shape, ctx.model
    moe_layers = layers - dense
    last = rank == last_stage_rank(lay.pp, lay.schedule)
    held = rank_params(ctx, lay, rank, layers, dense)
    stage, grad_b = lay.zero_stage, ctx.grad_b
    if lay.pp > 1 and stage >= 2 and not lay.reshard_each_microbatch:
        # torch's pipeline stages keep FSDP parameters gathered and gradients unreduced (in
        # param dtype) from the first micro-batch to the last, then reduce-scatter once.
        stage, grad_b = 1, ctx.param_b
    sizes = (ctx.param_b, grad_b, ctx.master_b, ctx.optim_b)
    dense_states = state_bytes(held.dense, held.dense_ranks, stage, *sizes)
    expert_states = state_bytes(held.experts, held.expert_ranks, stage, *sizes)
    params, grads, master, optim = (a + b for a, b in zip(dense_states, expert_states, strict=True))

    tokens = lay.micro_batch_size * ctx.seq / lay.cp  # per micro-batch on this rank
    inflight = pl.inflight_microbatches(
        lay.schedule, lay.pp, lay.stages_per_rank, lay.microbatches, rank
    )
    # Recomputed layers keep what their mode keeps; under recompute.every > 1 the others keep
    # everything.
    rc_dense, rc_moe = layout_recomputed(ctx, lay)[rank]
    mode = lay.recompute
    per_mb = rc_dense * layer_activation(ctx, lay, True, mode)
    per_mb += rc_moe * layer_activation(ctx, lay, False, mode)
    per_mb += (dense - rc_dense) * layer_activation(ctx, lay, True, "none")
    per_mb += (moe_layers - rc_moe) * layer_activation(ctx, lay, False, "none")
    activations = inflight * tokens * per_mb
    if mode in ("full", "op") and rc_dense + rc_moe:
        # The block being recomputed holds its full activations meanwhile.
        activations += tokens * layer_activation(ctx, lay, rc_dense > 0, "none")
    other = ctx.reserve
    if ctx.document_mask and lay.cp == 1:
        # Document masking: the layer being computed holds its (B, 1, S, S) mask, additive in
        # the compute dtype for the fused kernel, else bool; none is kept for backward, which
        # rebuilds it from the (B, S) ids (models.layers.document_attention). Under CP each
        # block's mask is a block's worth (cp_transient_bytes' scale).
        other += lay.micro_batch_size * ctx.seq**2 * (ctx.act_b if ctx.flash else 1)
    if lay.cp > 1:  # one layer at a time holds them
        other += tokens * cp_transient_bytes(
            k=s.k_width,
            v=s.v_width,
            cp=lay.cp,
            tp=lay.tp,
            method=ctx.cp_method,
            recompute=lay.recompute,
            act_b=ctx.act_b,
        )
    if last:  # logits in compute dtype plus their fp32 log-softmax, vocab-parallel over tp
        other += tokens * m.vocab_size / lay.tp * (ctx.act_b + 4)
    # The largest FSDP unit (one block) as this rank holds it.
    unit = (s.attn_params + s.dense_mlp_params) / lay.tp
    if ctx.moe:
        unit = max(unit, (s.attn_params + s.moe_shared_params) / lay.tp + s.expert_params / lay.ep)
    # Two gathered units (prefetch) and one unreduced gradient.
    if stage == 3 and held.dense_ranks > 1:
        other += unit * (2 * ctx.param_b + ctx.grad_b)
    elif stage == 2 and held.dense_ranks > 1:
        other += unit * ctx.grad_b
    return Memory(params, grads, master, optim, activations, other, rank)


def step_time(ctx: Context, lay: Layout, ranks) -> Time:
    """Predicted seconds per step on the bottleneck pipeline rank, split by cause."""
    m = ctx.model
    recompute = lay.recompute
    # Recompute reruns, in backward, a third of the recomputed layers' FLOPs (full), or their
    # attention core (selective; op when the core is unfused: op keeps fused attention's output).
    # op under tp also reruns the attention output projection, whose partial sum it does not
    # keep (checkpointing.py; the MLP's, last in the block, the recompute stops before).
    core_rerun = recompute == "selective" or (recompute == "op" and not ctx.flash)
    # Document masking reruns the attention forward in backward (models.layers
    # document_attention) except in the CPU fused kernel, which takes the rebuilt mask itself;
    # CP's blocks rebuild theirs in their own backward.
    document_rerun = ctx.document_rerun and lay.cp == 1
    partial_rerun = 0
    if recompute == "op" and lay.tp > 1 and not ctx.compiled:
        partial_rerun = 2 * ctx.shape.o_width * m.dim
    recomputed = layout_recomputed(ctx, lay)
    head_rank = last_stage_rank(lay.pp, lay.schedule)
    worst, worst_rank = 0.0, 0
    for r, (layers, dense) in enumerate(ranks):
        moe = layers - dense
        rc_dense, rc_moe = recomputed[r]
        flops = dense * ctx.dense_layer_flops + moe * ctx.moe_layer_flops
        flops += layers * ctx.attn_core_flops
        if recompute == "full":
            rerun = rc_dense * ctx.dense_layer_flops + rc_moe * ctx.moe_layer_flops
            flops += (rerun + (rc_dense + rc_moe) * ctx.attn_core_flops) / 3
        elif core_rerun:
            flops += (rc_dense + rc_moe) * ctx.attn_core_flops / 3
        if document_rerun:  # the layers that no recompute above reran already
            again = rc_dense + rc_moe if recompute == "full" or core_rerun else 0
            flops += (layers - again) * ctx.attn_core_flops / 3
        flops += (rc_dense + rc_moe) * partial_rerun
        flops += ctx.head_flops if r == head_rank else 0
        if flops > worst:
            worst, worst_rank = flops, r
    worst_layers, worst_dense = ranks[worst_rank]
    worst_moe = worst_layers - worst_dense
    worst_rc = sum(recomputed[worst_rank])
    tokens = ctx.global_batch * ctx.seq / lay.dp  # per pipeline replica and step
    compute = worst * tokens / (lay.tp * lay.cp) / ctx.sustained
    mbs = lay.microbatches
    mb_tokens = lay.micro_batch_size * ctx.seq / lay.cp

    # Tensor parallelism: 4 all-reduces of (b, s, h) per layer; with sequence parallelism each
    # is a reduce-scatter + all-gather of the same volume, and backward gathers the two saved
    # norm-output shards again (one all-reduce's worth) where the hooks keep shards (eager
    # blocks not checkpointed) or per-op recompute reruns the gathers; full recompute reruns
    # the forward's 2. All of it is exposed: the engine's DTensor TP
    # (launcher/parallel/tensor_parallel.py) runs each collective between the matmuls that
    # need it, with no async TP to overlap them.
    t_tp = 0.0
    if lay.tp > 1:
        volume = 2 * mb_tokens * m.dim * ctx.act_b * (lay.tp - 1) / lay.tp
        units = 4 * worst_layers
        if recompute == "full":
            units += 2 * worst_rc
        sp = lay.sequence_parallel
        if sp and recompute == "op":
            units += worst_rc
        if sp and not ctx.compiled:
            units += worst_layers - (worst_rc if recompute in ("full", "op") else 0)
        t_tp = mbs * units * volume / group_bandwidth(ctx, lay.tp, 1)
    # Context parallelism: the K/V exchanges of each layer's attention (`cp_layer_time`).
    t_cp = 0.0
    if lay.cp > 1:
        plain = worst_layers - worst_rc
        t_cp = mbs * (worst_rc * cp_layer_time(ctx, lay) + plain * cp_layer_time(ctx, lay, False))
    # Expert parallelism: dispatch and combine all-to-alls forward and backward.
    t_ep = 0.0
    if lay.ep > 1 and worst_moe:
        rc_moe = recomputed[worst_rank][1]
        sent = rc_moe * ep_layer_bytes(ctx, lay) + (worst_moe - rc_moe) * ep_layer_bytes(
            ctx, lay, False
        )
        t_ep = sent / group_bandwidth(ctx, lay.ep, 1)
        # DualPipe hides these all-to-alls behind the other chunk's compute; torch 2.13's
        # DualPipeV runs its overlapped forward and backward one after the other unless a
        # custom function is registered for them, and this engine registers none.
    bubble_fraction = pl.bubble_fraction(lay.schedule, lay.pp, lay.stages_per_rank, mbs)
    bubble = bubble_fraction * (compute + t_tp + t_cp + t_ep)
    t_dp = data_parallel_time(ctx, lay, ranks, compute)
    return Time(compute, t_tp, t_cp, t_ep, bubble, t_dp, bubble_fraction)


def ep_layer_bytes(ctx: Context, lay: Layout, recomputed: bool | None = None) -> float:
    """Bytes one rank sends to other ranks per MoE layer and step in the expert-parallel
    all-to-alls, with balanced routing: each micro-batch's routed copies (its tokens split
    over cp and tp, top_k copies of dim values each) go out in the dispatch and come back in
    the combine, forward and backward (and once more forward when the layer is recomputed,
    full or op: `recomputed`, by default whether the layout recomputes); with E / ep experts per
    rank, (ep - 1) / ep of them leave the rank."""
    m = ctx.model
    if recomputed is None:
        recomputed = lay.recompute in ("full", "op")
    routed = lay.micro_batch_size * ctx.seq / (lay.cp * lay.tp) * m.top_k * m.dim
    passes = 6 if recomputed else 4
    return lay.microbatches * passes * routed * ctx.act_b * (lay.ep - 1) / lay.ep


def cp_bytes_sent(ctx: Context, lay: Layout, recomputed: bool | None = None) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends for context parallelism, per layer and
    micro-batch; backward includes the forward's rerun under recompute (selective recomputes
    the attention core, full the block, both the core's communication). What a rank holds of
    K and V is its S / cp tokens of its 1 / tp of the kv heads (GQA: kv heads only); an
    all-gather sends it to cp - 1 ranks and the reduce-scatter of the gradients as much back;
    the ring sends it cp - 1 hops forward and again backward, plus cp hops of the fp32 dK/dV
    accumulators. Left out: the ranks' key positions (8 bytes per position, shared by the
    micro-batch; for one 128-wide kv head in bf16, 1.6% of its K/V)."""
    s, cp = ctx.shape, lay.cp
    kv = lay.micro_batch_size * ctx.seq / cp * (s.k_width + s.v_width) / lay.tp  # elements
    forward = (cp - 1) * kv * ctx.act_b
    backward = forward + (cp * kv * 4 if ctx.cp_method == "ring" else 0.0)
    if lay.recompute != "none" if recomputed is None else recomputed:
        backward += forward
    return forward, backward


def cp_layer_time(ctx: Context, lay: Layout, recomputed: bool | None = None) -> float:
    """Exposed context-parallel communication, seconds per layer and micro-batch.

    allgather: all of it: attention needs the gathered K/V before it starts, and dK/dV only
    exist once it is done. ring: each hop's transfer overlaps the attention of the block the
    rank holds meanwhile (under load balancing each of the cp blocks is 1/cp of the rank's
    attention work; backward's is twice forward's), so per hop only max(0, transfer - block)
    is exposed. Backward: step 0 hides the first K/V hop, steps 1 to cp - 2 a K/V hop and the
    previous step's accumulator hop (the same link), the last step the accumulator before it,
    and the accumulator's last hop home has nothing left to hide behind.
    """
    bandwidth = group_bandwidth(ctx, lay.cp, lay.tp)
    forward, backward = cp_bytes_sent(ctx, lay, recomputed)
    if ctx.cp_method != "ring":
        return (forward + backward) / bandwidth
    cp = lay.cp
    hop = forward / (cp - 1) / bandwidth  # one K/V block
    acc = hop * 4 / ctx.act_b  # one block's fp32 dK/dV
    tokens = lay.micro_batch_size * ctx.seq / cp
    block = tokens * ctx.attn_core_flops / 3 / (lay.tp * cp) / ctx.sustained  # forward
    t_forward = (cp - 1) * max(0.0, hop - block)
    t_backward = (
        max(0.0, hop - 2 * block)
        + (cp - 2) * max(0.0, hop + acc - 2 * block)
        + max(0.0, acc - 2 * block)
        + acc
    )
    rerun = lay.recompute != "none" if recomputed is None else recomputed
    return t_forward * (2 if rerun else 1) + t_backward


def data_parallel_time(ctx: Context, lay: Layout, ranks, compute: float) -> float:
    """Exposed gradient reduction and parameter gathering of the data-parallel axis."""
    if lay.dp == 1:
        return 0.0
    s = ctx.shape
    layers, dense = max(ranks)
    moe_layers = layers - dense
    params = (
        layers * s.attn_params
        + dense * s.dense_mlp_params
        + moe_layers * s.moe_shared_params
        + s.embedding
        + s.head
    ) / lay.tp
    params += moe_layers * s.expert_params / lay.ep
    shard = lay.dp_shard * lay.cp
    n = lay.dp if lay.zero_stage <= 1 or shard == 1 else shard
    frac = (n - 1) / n if n > 1 else 0.0
    if lay.zero_stage <= 1 or shard == 1 or (lay.pp > 1 and not lay.reshard_each_microbatch):
        # Once per step: all-reduce (DDP, ZeRO-1), or gather + reduce-scatter under a pipeline.
        volume = params * (2 * ctx.grad_b if lay.zero_stage <= 1 else ctx.param_b + ctx.grad_b)
        window = compute * 2 / 3 / lay.microbatches  # the last backward hides it
    else:
        # FSDP every micro-batch: gather for forward (and again for backward at stage 3) and
        # reduce-scatter the gradients, prefetched under that micro-batch's compute.
        gathers = 2 if lay.zero_stage == 3 else 1
        volume = lay.microbatches * params * (gathers * ctx.param_b + ctx.grad_b)
        window = compute
    t = volume * frac / group_bandwidth(ctx, lay.dp_shard, lay.cp * lay.tp)
    if lay.dp_replicate > 1 and shard > 1 and lay.zero_stage >= 2:
        # HSDP: the sharded gradients are all-reduced across replicas as well.
        t += (
            2
            * params
            / shard
            * ctx.grad_b
            * (lay.dp_replicate - 1)
            / lay.dp_replicate
            / (group_bandwidth(ctx, lay.dp_replicate, lay.dp_shard * lay.cp * lay.tp))
        )
    first_and_last = t / max(1, layers) / lay.microbatches * 2  # cannot overlap anything
    return max(0.0, t - window) + first_and_last


def evaluate(ctx: Context, lay: Layout) -> Estimate:
    """Memory and time of a layout that passed the rules."""
    est = Estimate(lay)
    ranks = layout_ranks(ctx, lay)
    # Ranks holding the same layers differ only by their in-flight micro-batches, which every
    # schedule makes monotone in the rank: the first and last rank of each such group, plus the
    # embedding's and the head's ranks, include the most loaded one.
    candidates = {0, last_stage_rank(lay.pp, lay.schedule)}
    for held in set(ranks):
        group = [r for r, h in enumerate(ranks) if h == held]
        candidates |= {group[0], group[-1]}
    est.memory = max(
        (rank_memory(ctx, lay, r, *ranks[r]) for r in candidates), key=lambda mem: mem.total
    )
    est.time = step_time(ctx, lay, ranks)
    step = est.time.step
    est.tokens_per_s_per_device = ctx.global_batch * ctx.seq / step / lay.world
    est.mfu = ctx.model_flops_per_token * est.tokens_per_s_per_device / ctx.peak
    return est
