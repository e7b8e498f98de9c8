"""Model arithmetic from the config alone (no torch): parameters, FLOPs and activations per token.

One `Shape` per model holds what the planner needs per layer, so that evaluating a layout is a
handful of multiplications. Families: llama (GQA, SwiGLU, RMSNorm), gpt (Megatron: learned
positions, LayerNorm with biases, GeLU 4h MLP, tied embeddings), mixtral (llama attention,
top-k routed SwiGLU experts), deepseek (MLA attention, fine-grained routed + shared experts,
first layers dense).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.config import ModelConfig
from launcher.models import families, shapes


def count(tensors: dict[str, tuple[int, ...]]) -> int:
    """Elements of a {name: shape} list (launcher/models/shapes.py)."""
    return sum(math.prod(shape) for shape in tensors.values())


def tp_sharded(fam: families.Family, name: str) -> bool:
    """Whether tensor parallelism splits this block parameter (the record's TP plan): a
    column-parallel module's weight and bias, a row-parallel one's weight; a row-parallel
    bias is added after the reduction, and what the plan does not name stays whole."""
    module, _, kind = name.rpartition(".")
    style = fam.tp_block.get(module) or families.TP_ROUTED.get(module)
    return style == families.COLUMN or (style == families.ROW and kind == "weight")


@dataclass(frozen=True)
class Shape:
    """Per-layer parameter counts and per-token attention dimensions of one model."""

    n_layers: int
    n_dense_layers: int  # layers with a dense MLP (all of them for dense families)
    attn_params: int  # attention weights and biases split by tp
    attn_replicated: int  # latent norms, the output projection's bias (replicated over tp)
    dense_mlp_params: int
    expert_params: int  # all routed experts of one MoE layer (sharded by ep)
    moe_shared_params: int  # shared experts of one MoE layer (split by tp, replicated over ep)
    norm_params: int  # the two block norms (replicated over tp)
    embedding: int  # token embedding (sharded by tp) + learned positions
    head: int  # final norm + output projection (0 for the projection when tied)
    # Per-token widths (elements) used by FLOPs and activation counts.
    q_width: int  # H x d_qk
    k_width: int  # kv heads x d_qk (MLA: H x d_qk after up-projection)
    v_width: int  # kv heads x d_v
    o_width: int  # H x d_v: attention output, input to the output projection
    latent_width: int  # MLA latents saved for backward (q and kv compressions), else 0
    normed_width: int  # inputs of per-head norms saved for backward (Qwen3's q and k), else 0
    # Matmul outputs per token (what per-op recompute keeps): the projections into heads
    # (sharded by tp) and MLA's latent projections (replicated).
    heads_out_width: int
    latent_out_width: int
    n_heads: int
    d_qk: int
    d_v: int
    mlp_replicated: int = 0  # the dense MLP's second bias (gpt; replicated over tp)
    positions: int = 0  # learned position embeddings (gpt; replicated over tp)
    # Attention matmul weights every tp rank holds whole and runs on every token: MLA's latent
    # down-projections (wq_a, wkv_a), which tensor parallelism leaves replicated.
    attn_latent: int = 0
    router_params: int = 0  # an MoE layer's router gate (whole on every tp and ep rank)
    # The matrices alone (no biases, norms): what a token is multiplied by, in the attention
    # and in a dense block's MLP.
    attn_matmul: int = 0
    dense_mlp_matmul: int = 0
    # Multi-token prediction (model.mtp_depth): its blocks (MoE ones where the family routes
    # after its dense first layers) and each depth's own norms and projection, on the last
    # pipeline stage beside the head.
    ahead_layers: int = 0
    ahead_moe: bool = False
    ahead_own: int = 0  # every depth's own parameters (norms, eh_proj), summed

    @property
    def ahead(self) -> int:
        """Every prediction depth's parameters."""
        block = self.moe_layer if self.ahead_moe else self.dense_layer
        return self.ahead_layers * block + self.ahead_own

    @property
    def dense_layer(self) -> int:
        return (
            self.attn_params
            + self.attn_replicated
            + self.attn_latent
            + self.dense_mlp_params
            + self.mlp_replicated
            + self.norm_params
        )

    @property
    def moe_layer(self) -> int:
        return (
            self.attn_params
            + self.attn_replicated
            + self.attn_latent
            + self.expert_params
            + self.moe_shared_params
            + self.router_params
            + self.norm_params
        )

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.head
            + self.n_dense_layers * self.dense_layer
            + self.n_moe_layers * self.moe_layer
            + self.ahead
        )


def shape(m: ModelConfig) -> Shape:
    """Parameter counts and widths of a model config (any family), counted from its family's
    parameters (launcher/models/shapes.py) split as tensor and expert parallelism split them."""
    fam = families.of(m)
    moe = m.n_routed_experts > 0
    n_dense = shapes.dense_layers(m)
    dense = fam.block(m, moe=False) if n_dense else {}
    routed = fam.block(m, moe=True) if moe else {}
    block = dense or routed  # attention and norms: the same in both

    def part(block: dict, prefix: str, sharded: bool | None = None, matrix: bool | None = None):
        """Elements of the block's parameters under `prefix`, those tp splits (or not), the
        matrices (or the rest)."""
        return count(
            {
                k: v
                for k, v in block.items()
                if k.startswith(prefix)
                and (sharded is None or tp_sharded(fam, k) == sharded)
                and (matrix is None or (len(v) >= 2) == matrix)
            }
        )

    tokens = f"{fam.tp_embedding}.weight"
    embedding = fam.embedding.tensors(m)
    ahead = fam.ahead(m)
    ahead_own = {k: v for k, v in ahead.items() if ".block." not in k}
    w, mms = fam.attention.widths(m), fam.attention.matmuls(m)
    return Shape(
        n_layers=m.n_layers,
        n_dense_layers=n_dense,
        attn_params=part(block, "attention.", sharded=True),
        attn_latent=part(block, "attention.", sharded=False, matrix=True),
        attn_replicated=part(block, "attention.", sharded=False, matrix=False),
        dense_mlp_params=part(dense, "feed_forward.", sharded=True),
        mlp_replicated=part(dense, "feed_forward.", sharded=False),
        expert_params=part(routed, "feed_forward.experts."),
        moe_shared_params=part(routed, "feed_forward.", sharded=True),
        router_params=part(routed, "feed_forward.router."),
        attn_matmul=part(block, "attention.", matrix=True),
        dense_mlp_matmul=part(dense, "feed_forward.", matrix=True),
        norm_params=part(block, "attention_norm.") + part(block, "ffn_norm."),
        embedding=count(embedding),
        positions=count(embedding) - math.prod(embedding[tokens]),
        head=count(fam.head(m)),
        q_width=w.q,
        k_width=w.k,
        v_width=w.v,
        o_width=w.o,
        latent_width=w.latent,
        normed_width=w.normed,
        # What per-op recompute keeps of the attention's matmuls: the outputs of the
        # projections into heads (split by tp) and of the latent ones (whole).
        heads_out_width=sum(out for out, _, row, whole in mms if not row and not whole),
        latent_out_width=sum(out for out, _, _, whole in mms if whole),
        n_heads=w.n_heads,
        d_qk=w.d_qk,
        d_v=w.d_v,
        ahead_layers=m.mtp_depth if ahead else 0,
        ahead_moe=moe,
        ahead_own=count(ahead_own),
    )


@dataclass(frozen=True)
class Matmul:
    """One projection of a block, per token: its output and input widths (elements), whether it
    is row-parallel under tp (its output a partial sum), whether every tp rank runs it whole
    (MLA's latent projections), whether it is the MLP's, and whether per-op recompute keeps its
    output."""

    out: int
    inp: int
    row: bool
    whole: bool
    mlp: bool
    kept: bool


def alternate_unpriced(m: ModelConfig) -> str:
    """Why recompute.matmuls=alternate is not priced for this model ("" where it is): the
    planner counts a block's matmuls one by one where the feed-forward is a dense MLP."""
    return "routed experts" if m.n_routed_experts else ""


def block_matmuls(m: ModelConfig, matmuls: str = "all") -> list[Matmul]:
    """A dense block's projections in forward order (its attention's, launcher/models/shapes.py,
    then the MLP's: w1, w3, w2 or fc1, fc2), with the outputs recompute=op keeps: all, or under
    matmuls="alternate" the 1st, 3rd, 5th, ... (launcher/parallel/recompute.py)."""
    fam, ffn = families.of(m), m.ffn_dim
    attention = [(*mm, False) for mm in fam.attention.matmuls(m)]
    mlp = [(ffn, m.dim, False, False, True)] * fam.mlp.gates + [(m.dim, ffn, True, False, True)]
    return [
        Matmul(*mm, kept=matmuls == "all" or i % 2 == 0) for i, mm in enumerate([*attention, *mlp])
    ]


def active_matmul_params_per_token(s: Shape, m: ModelConfig) -> float:
    """Weights each token multiplies by (forward), averaged over layers; output head included,
    and each multi-token-prediction depth's block, projection and head."""
    moe_layers = s.n_moe_layers + (s.ahead_layers if s.ahead_moe else 0)
    dense_layers = s.n_dense_layers + (0 if s.ahead_moe else s.ahead_layers)
    moe_active = 0.0
    if moe_layers:
        routed = m.top_k * 3 * m.dim * m.moe_ffn_dim
        moe_active = moe_layers * (routed + s.moe_shared_params + s.router_params)
    ahead = s.ahead_layers * (2 * m.dim * m.dim + m.vocab_size * m.dim)  # eh_proj, the head
    return (
        (s.n_layers + s.ahead_layers) * s.attn_matmul
        + dense_layers * s.dense_mlp_matmul
        + moe_active
        + m.vocab_size * m.dim
        + ahead
    )


def flops_per_token(m: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs (forward + backward) per token: 6 x active matmul weights + attention.

    Scores and the weighted sum cost 2 s H (d_qk + d_v) per token per layer forward over the
    full sequence; causal masking halves it and backward doubles it: 3 s H (d_qk + d_v) per
    layer (6 L s H E for standard heads), or 6 s H (d_qk + d_v) counted without the mask.
    """
    s = shape(m)
    attention = 3 * (m.n_layers + s.ahead_layers) * seq_len * s.n_heads * (s.d_qk + s.d_v)
    return 6.0 * active_matmul_params_per_token(s, m) + attention * (1 if causal else 2)
