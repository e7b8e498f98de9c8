"""What a run's cost depends on apart from its layout (`Context`, computed once per model,
hardware, batch and precision), and where a layout puts layers and parameters: the layers
each pipeline rank holds, which of them recompute, and the parameters it keeps."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from launcher.config import Config
from launcher.data.sources import document_attention
from launcher.layout import (
    Layout,
    last_stage_rank,
    rank_stages,
    recomputed,
    split_layers,
    stage_starts,
)
from launcher.models import families
from launcher.models.expert_kernel import loop_reason
from launcher.plan import bands, kernels
from launcher.plan.comm import Links
from launcher.plan.memory import BYTES, GIB, reserve_gib
from launcher.plan.model_size import Shape, active_matmul_params_per_token, flops_per_token, shape


class Context:
    """Everything about a run that does not depend on its layout."""

    def __init__(self, cfg: Config):
        m, hw, t, p = cfg.model, cfg.hardware, cfg.train, cfg.precision
        self.cfg, self.model = cfg, m
        self.shape: Shape = shape(m)
        self.seq, self.global_batch = t.seq_len, t.global_batch_size
        self.document_mask = document_attention(cfg)
        self.devices_per_node, self.nodes = hw.devices_per_node, hw.nodes
        self.world = hw.nodes * hw.devices_per_node
        self.capacity = hw.memory_gib * GIB
        self.reserve = reserve_gib(hw.device_type.value, hw.memory_gib) * GIB
        # The spread of measured over predicted speed and memory of the run's class.
        self.ratios = bands.ratios(cfg)
        self.peak = hw.peak_tflops * 1e12
        # An explicit hardware.efficiency is what a run measured as configured (compile and the
        # generation's scale already in it): every kernel runs at it.
        self.measured = hw.efficiency
        self.scale = hw.efficiency_scale * (hw.compile_factor if t.compile else 1.0)
        self.efficiency = hw.efficiency or kernels.model_efficiency(m.dim, self.scale)
        self.attention_rate = self.peak * (
            hw.efficiency or hw.attention_efficiency or kernels.EFFICIENCY_MAX * self.scale
        )
        self.intra, self.inter = hw.intra_node_gbps * 1e9, hw.inter_node_gbps * 1e9
        self.links = Links(
            devices_per_node=hw.devices_per_node,
            intra_bandwidth=self.intra,
            inter_bandwidth=self.inter,
            base_latency=hw.collective_latency_us * 1e-6,
            intra_hop=hw.intra_node_hop_us * 1e-6,
            inter_hop=hw.inter_node_hop_us * 1e-6,
        )
        self.memory_bw = hw.memory_gbps * 1e9
        # A CPU runs the host's work and the kernels on the same cores, one after the other; a
        # GPU's kernels run while the host launches the next ones.
        self.host_serial = hw.device_type.value == "cpu"
        self.op_overhead = hw.op_overhead_us * 1e-6
        self.microbatch_overhead = hw.microbatch_overhead_us * 1e-6
        self.param_b, self.grad_b = BYTES[p.param_dtype], BYTES[p.grad_dtype]
        self.master_b = BYTES[p.master_dtype] if p.master_dtype != p.param_dtype else 0
        self.optim_b = 2 * BYTES[p.optimizer_dtype]
        # optimizer=muon: the blocks' matrices keep one momentum, in the master weights' dtype
        # (launcher/training/muon.py), in place of AdamW's two moments; 0 under AdamW.
        self.muon_b = BYTES[p.master_dtype] if cfg.optimizer.name.value == "muon" else 0
        self.act_b = BYTES[p.compute_dtype]
        self.dropout = m.dropout > 0
        # Fused attention as the device runs it: torch's CPU kernel needs equal q/k and v head
        # widths and no dropout, and falls back to the unfused math (MLA, GPT's dropout).
        s = self.shape
        cpu_fuses = s.d_qk == s.d_v and not self.dropout
        self.flash = m.flash_attention and (hw.device_type.value == "cuda" or cpu_fuses)
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
        # What a block's feed-forward keeps per token (its family's parts,
        # launcher/models/shapes.py): the dense MLP's, or the MoE layer's shared experts' and routed
        # copies' (and the router's bytes), and what per-op recompute keeps of the routed ones.
        fam = families.of(m)
        self.dense_mlp_saved = fam.mlp.saved * m.ffn_dim
        self.shared_mlp_saved = fam.routed.shared.saved * m.n_shared_experts * m.moe_ffn_dim
        self.routed_saved = fam.routed.saved(m) if self.moe else 0
        self.routed_bytes = fam.routed.bytes(m) if self.moe else 0
        self.routed_out = fam.routed.kept(m) if self.moe else 0
        self.compiled = t.compile
        per_dim, per_mlp = fam.elementwise
        fused = kernels.ELEMENTWISE_COMPILED if t.compile else 1.0
        self.elementwise_dim = per_dim * fused  # elements per token per layer, per dim
        self.elementwise_mlp = per_mlp * fused  # per MLP hidden unit
        # Unfused attention's score traffic per token per layer (per kv position).
        self.elementwise_scores = 0.0 if self.flash else kernels.ELEMENTWISE_SCORES * s.n_heads
        self.fused = fused  # the share of memory-bound traffic left where blocks compile
        ops = kernels.OPS_COMPILED if t.compile else 1.0
        self.ops_dense, self.ops_moe = kernels.OPS_DENSE * ops, kernels.OPS_MOE * ops
        # Where no grouped kernel runs the experts (launcher/models/expert_kernel.py), the engine
        # runs them one at a time: the reason, which the plan shows, and the launches it prices.
        self.expert_loop = (
            loop_reason(hw.device_type.value, p.compute_dtype.value) if self.moe else None
        )
        self.ops_outside = kernels.OPS_OUTSIDE
        # precision.fp8 (launcher/parallel/float8.py): the blocks' linears run as float8 GEMMs
        # at the part's FP8 peak and its own share of the GEMM curve (rowwise scales slower);
        # on a part without FP8 units (CPU) emulated: the usual GEMM, the casts still paid.
        self.fp8 = p.fp8.value != "none"
        fp8_units = hw.device_type.value == "cuda" and hw.peak_tflops_fp8 > 0
        self.fp8_peak = hw.peak_tflops_fp8 * 1e12 if fp8_units else self.peak
        rowwise = kernels.FP8_ROWWISE if p.fp8.value == "rowwise" and fp8_units else 1.0
        self.fp8_scale = (
            hw.efficiency_scale_fp8 * rowwise if fp8_units else hw.efficiency_scale
        ) * (hw.compile_factor if t.compile else 1.0)
        # The casts' sides per token and layer: the model-width ones, which tp leaves whole
        # (q, k and v's inputs, o's output, the MLP's inputs and output), and per unit of MLP
        # width; the heads' sides, which tp splits, are the Shape's widths.
        self.fp8_mlp_sides = fam.mlp.gates + 1


def loss_compiled(cfg: Config, lay: Layout) -> bool:
    """Whether the trainer compiles the loss for `lay` (launcher/training/trainer.py asks this too):
    with compiled blocks unless train.compile_loss=false, and never under loss parallelism
    (DTensor logits, reduced inside loss_parallel())."""
    return cfg.train.compile and cfg.train.compile_loss and not lay.loss_parallel


@lru_cache(maxsize=4096)
def rank_layers(
    n_layers: int,
    n_dense: int,
    pp: int,
    v: int,
    schedule: str,
    split: tuple[int, ...] = (),
    ahead: int = 0,
    ahead_dense: bool = False,
):
    """Per pipeline rank: (layers, dense layers among them); `ahead`: multi-token prediction's
    blocks, after the last layer on the last stage (dense ones or not)."""
    counts = list(split) or split_layers(n_layers, pp * v)
    starts = stage_starts(counts)
    out = []
    for r in range(pp):
        stages = rank_stages(r, pp, v, schedule)
        layers = sum(counts[i] for i in stages)
        dense = sum(max(0, min(starts[i] + counts[i], n_dense) - starts[i]) for i in stages)
        if pp * v - 1 in stages:
            layers, dense = layers + ahead, dense + (ahead if ahead_dense else 0)
        out.append((layers, dense))
    return tuple(out)


@lru_cache(maxsize=4096)
def recomputed_layers(stage_shape: tuple, every: int):
    """Per pipeline rank: (recomputed dense layers, recomputed MoE layers): the layers whose
    index in the model is a multiple of `every` (launcher.layout.recomputed), multi-token
    prediction's blocks numbered after the last layer. `stage_shape`: _stage_shape's."""
    n_layers, n_dense, pp, v, schedule, split, ahead, ahead_dense = stage_shape
    counts = list(split) or split_layers(n_layers, pp * v)
    starts = stage_starts(counts)
    out = []
    for r in range(pp):
        stages = rank_stages(r, pp, v, schedule)
        indices = [
            i
            for stage in stages
            for i in range(starts[stage], starts[stage] + counts[stage])
            if recomputed(i, every)
        ]
        total, dense = len(indices), sum(1 for i in indices if i < n_dense)
        if pp * v - 1 in stages:
            more = sum(1 for i in range(n_layers, n_layers + ahead) if recomputed(i, every))
            total, dense = total + more, dense + (more if ahead_dense else 0)
        out.append((dense, total - dense))
    return tuple(out)


def layout_recomputed(ctx: Context, lay: Layout):
    """Per pipeline rank of this layout: (recomputed dense layers, recomputed MoE layers);
    none without recompute."""
    if lay.recompute == "none":
        return ((0, 0),) * lay.pp
    return recomputed_layers(_stage_shape(ctx, lay), lay.recompute_every)


def layout_ranks(ctx: Context, lay: Layout):
    """Per pipeline rank of this layout: (layers, dense layers among them)."""
    return rank_layers(*_stage_shape(ctx, lay))


def _stage_shape(ctx: Context, lay: Layout) -> tuple:
    """What places layers on pipeline ranks: layers, dense layers, pp, stages per rank,
    schedule, layers per stage, multi-token prediction's blocks (dense or not)."""
    s = ctx.shape
    return (
        s.n_layers,
        s.n_dense_layers,
        lay.pp,
        lay.stages_per_rank,
        lay.schedule,
        lay.stage_layers,
        s.ahead_layers,
        not s.ahead_moe,
    )


@dataclass(frozen=True)
class RankParams:
    """The parameters a pipeline rank holds before any data-parallel sharding, and the ranks
    each kind is sharded over (FSDP, or ZeRO's optimizer side)."""

    dense: float  # tp-sharded where TP shards them
    experts: float  # its ep share of the routed experts
    dense_ranks: int
    expert_ranks: int
    matrices: float = 0  # of `dense`, the blocks' weight matrices (optimizer=muon steps them)

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
    replicated = layers * (s.attn_replicated + s.attn_latent + s.norm_params)
    replicated += dense * s.mlp_replicated + moe_layers * s.router_params
    # A tied embedding under a pipeline: the last stage holds its own copy of the token
    # embedding as its output projection (on rank 0 too under the V schedules); so it does
    # for multi-token prediction, which embeds the tokens ahead there.
    copied = m.tie_embeddings or s.ahead_layers
    tied_copy = m.vocab_size * m.dim if last and copied and lay.pp > 1 else 0
    emb = (s.embedding - s.positions if first else 0) + tied_copy
    replicated += s.positions if first else 0
    head = s.head if last else 0
    replicated += s.ahead_own if last else 0  # the depths' norms and projection, whole
    return RankParams(
        dense=(tp_sharded + emb + head) / lay.tp + replicated,
        experts=moe_layers * s.expert_params / lay.ep,
        matrices=tp_sharded / lay.tp + layers * s.attn_latent,
        dense_ranks=lay.dp_shard * lay.cp,
        # The experts' states are sharded (by their own FSDP unit, or ZeRO-1's) over the
        # ranks of one replica holding the same experts.
        # Without data-parallel sharding (dp_shard x cp of 1) no rank shards them.
        expert_ranks=max(1, lay.dp_shard * lay.cp * lay.tp // lay.ep) if lay.dp_shard_cp > 1 else 1,
    )
