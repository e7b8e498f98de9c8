"""Evaluate one layout: the memory of its most loaded rank and its step time.

`Context` (launcher/plan/context.py) holds what depends only on model, hardware, batch and
precision (computed once); `Layout` is one point of the search space; `evaluate(ctx, layout)`
is the hot path of the search, a few hundred arithmetic operations. The step time is the list
of cost terms of launcher/plan/terms/.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from launcher.layout import Layout, last_stage_rank
from launcher.models import families
from launcher.models.tiles import band_bytes
from launcher.plan import bubble as pl
from launcher.plan.bands import Band, band, memory_band
from launcher.plan.context import (
    Context,
    layout_ranks,
    layout_recomputed,
    loss_compiled,
    rank_params,
)
from launcher.plan.memory import (
    OpSaved,
    Saved,
    Split,
    cp_transient_bytes,
    layer_activation_bytes,
    op_layer_activation_bytes,
    state_bytes,
)
from launcher.plan.model_size import block_matmuls
from launcher.plan.terms import Time, step_time

# The loss's peak per logit element (launcher.training.trainer.loss_fn: cross-entropy of the logits
# cast to fp32), in its backward: eager, the fp32 log-softmax it saved, the gradient nll_loss writes
# and log-softmax's gradient, 4 bytes each (the compute-dtype logits are freed after the forward,
# which peaks lower, at 2 + 4 + 4 in bf16). Measured: CPU allocator events of loss_fn
# (tests/plan/test_loss_memory.py); on an H200, 11.5 bytes, and the planner counting 6 was 6.6 GiB
# (15%) low on Llama 3.2 1B at 8,192 tokens (docs/speed.md). Compiled (the trainer compiles the loss
# with the blocks, except under loss parallelism), the cast and log-softmax fuse and it keeps the
# logits and their gradient in the compute dtype only.
LOSS_BYTES_PER_LOGIT = 12


def loss_bytes_per_logit(ctx: Context, lay: Layout) -> float:
    """Bytes per logit element at the loss's peak, as the trainer runs the loss for `lay`."""
    return 2 * ctx.act_b if loss_compiled(ctx.cfg, lay) else LOSS_BYTES_PER_LOGIT


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
    # Before the first step: the parameters as built (the rank's share, in the master dtype;
    # launcher.parallel.build), initialisation's band of tiles and the reserve.
    start: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.params + self.grads + self.master + self.optimizer + self.activations + self.other
        )


@dataclass
class Estimate:
    layout: Layout
    memory: Memory | None = None
    time: Time | None = None
    tokens_per_s_per_device: float = 0.0
    mfu: float = 0.0
    # The memory's low and high figures (bytes; launcher/plan/bands.py), and with the time,
    # every figure's band.
    memory_band: tuple[float, float] = (0.0, 0.0)
    band: Band | None = None

    @property
    def memory_high(self) -> float:
        """What the fit verdict reads: the high memory figure, or the start's if higher."""
        return max(self.memory_band[1], self.memory.start)


@lru_cache(maxsize=16)  # the same four for every rank of a layout (evaluate's candidates)
def layer_activation(ctx: Context, lay: Layout, dense: bool, recompute: str) -> float:
    s, m = ctx.shape, ctx.model
    split = Split(lay.tp, lay.sequence_parallel, lay.cp, lay.context_method, ctx.compiled)
    if recompute == "op":
        shared = m.n_shared_experts * m.moe_ffn_dim
        heads_out = s.heads_out_width
        fam = families.of(m)
        mlp_out = fam.mlp.gates * m.ffn_dim if dense else fam.routed.shared.gates * shared
        row_parallel = row_kept = 2 if dense or shared else 1
        latent_out = s.latent_out_width
        if lay.recompute_matmuls == "alternate" and dense:  # refused with experts (rules.py)
            mms = [mm for mm in block_matmuls(m, "alternate") if mm.kept]
            heads_out = sum(mm.out for mm in mms if not (mm.row or mm.whole or mm.mlp))
            latent_out = sum(mm.out for mm in mms if mm.whole)
            mlp_out = sum(mm.out for mm in mms if mm.mlp and not mm.row)
            row_kept = sum(mm.row for mm in mms)
        kept = OpSaved(
            m.dim,
            heads_out=heads_out,
            o=s.o_width,
            latent_out=latent_out,
            mlp_out=mlp_out,
            row_parallel=row_parallel,
            row_parallel_kept=row_kept,
            routed_out=0 if dense else ctx.routed_out,
        )
        return op_layer_activation_bytes(
            kept, split, flash=ctx.flash, act_b=ctx.act_b, compiled=ctx.compiled
        )
    saved = Saved(
        m.dim,
        q=s.q_width,
        k=s.k_width,
        v=s.v_width,
        o=s.o_width,
        latent=s.latent_width,
        normed=s.normed_width,
        mlp=ctx.dense_mlp_saved if dense else ctx.shared_mlp_saved,
        routed=0 if dense else ctx.routed_saved,
        routed_bytes=0 if dense else ctx.routed_bytes,
        n_heads=s.n_heads,
        whole_mlp=dense or m.n_shared_experts > 0,
    )
    return layer_activation_bytes(
        saved,
        split,
        seq=ctx.seq // lay.cp,
        recompute=recompute,
        flash=ctx.flash,
        dropout=ctx.dropout,
        act_b=ctx.act_b,
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
    # optimizer=muon: the matrices' (and every expert's) one momentum in place of two moments.
    muon = (ctx.param_b, grad_b, ctx.master_b, ctx.muon_b)
    matrices = held.matrices if ctx.muon_b else 0
    parts = [
        state_bytes(held.dense - matrices, held.dense_ranks, stage, *sizes),
        state_bytes(matrices, held.dense_ranks, stage, *muon),
        state_bytes(held.experts, held.expert_ranks, stage, *(muon if ctx.muon_b else sizes)),
    ]
    params, grads, master, optim = (sum(kind) for kind in zip(*parts, strict=True))

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
    if (mode == "full" or (mode == "op" and not ctx.compiled)) and rc_dense + rc_moe:
        # The block being recomputed holds its full activations meanwhile. Compiled, per-op
        # recompute is part of the backward graph, which reruns each op just before its
        # gradient reads it: no whole block is held (torchtitan's compiled Llama 3 8B runs with
        # the per-op policy peak 5.0-5.4 GiB below its eager ones, published.py).
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
            method=lay.context_method,
            recompute=lay.recompute,
            act_b=ctx.act_b,
        )
    if last:  # the loss's peak, vocab-parallel over tp
        # Multi-token prediction's depths computed theirs in forward and keep what their
        # backward needs until it: one more peak each.
        losses = 1 + s.ahead_layers
        other += losses * tokens * m.vocab_size / lay.tp * loss_bytes_per_logit(ctx, lay)
        # Each depth's inputs kept for backward: the token embedding and the hidden state
        # (their norms'), the two joined (the projection's), and its norm before the head.
        activations += inflight * tokens * s.ahead_layers * 5 * m.dim * ctx.act_b
    # The largest FSDP unit (one block) as this rank holds it.
    unit = (s.attn_params + s.dense_mlp_params) / lay.tp + s.attn_latent
    if ctx.moe:
        moe_unit = (s.attn_params + s.moe_shared_params) / lay.tp + s.attn_latent + s.router_params
        unit = max(unit, moe_unit + s.expert_params / lay.ep)
    # Two gathered units (prefetch) and one unreduced gradient.
    if stage == 3 and held.dense_ranks > 1:
        other += unit * (2 * ctx.param_b + ctx.grad_b)
    elif stage == 2 and held.dense_ranks > 1:
        other += unit * ctx.grad_b
    start = held.at_rest(lay) * (ctx.master_b or ctx.param_b) + build_transient(m) + ctx.reserve
    return Memory(params, grads, master, optim, activations, other, rank, start)


def build_transient(m) -> float:
    """What initialising a rank's share holds beside it at most: one band of tiles across the
    widest parameter (launcher/models/tiles.py; each parameter's last dimension is the width of its
    input: the model's dim, an MLP's hidden size, the attention heads' concatenation)."""
    heads = m.n_heads * max(m.v_head_dim or 0, m.head_dim or m.dim // max(1, m.n_heads))
    return band_bytes(max(m.dim, m.ffn_dim, m.moe_ffn_dim or 0, heads))


def evaluate(ctx: Context, lay: Layout, fitting_only: bool = False) -> Estimate:
    """Memory and time of a layout that passed the rules, with their bands (`fitting_only`: the
    time only when the high memory figure fits ctx.capacity, as the search wants it)."""
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
    est.memory_band = memory_band(ctx.ratios, est.memory.total, ctx.reserve)
    if fitting_only and est.memory_high > ctx.capacity:
        return est
    est.time = step_time(ctx, lay, ranks)
    step = est.time.step
    est.tokens_per_s_per_device = ctx.global_batch * ctx.seq / step / lay.world
    est.mfu = ctx.model_flops_per_token * est.tokens_per_s_per_device / ctx.peak
    est.band = band(ctx.ratios, step, est.tokens_per_s_per_device, est.memory.total, ctx.reserve)
    return est
