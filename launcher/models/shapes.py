"""The parts models are made of, as data: each part's parameters as {name: shape}, exactly as
launcher/models/ builds them, and what the planner prices the part by (an attention's per-token
widths and projections in order, an MLP's and an MoE layer's saved tensors).

Pure Python (no torch): the planner counts parameters, checkpoint tensors, FLOPs and saved
activations from these, and a family's record (launcher/models/families.py) names which of them its
blocks are made of, so that a family is one unit and shared code never decodes its flags.
Names are relative to the part (a block's attention is under `attention.`, its feed-forward
under `feed_forward.`); shapes are (out, in) for a projection, as torch's Linear holds them.
`m` is a model config (its fields: launcher/config.py's ModelConfig).

tests/models/test_families.py holds every family's list against the model it builds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

Shapes = dict[str, tuple[int, ...]]


def head_dim(m) -> int:
    """Per-head width: the config's, else dim / heads."""
    return m.head_dim if m.head_dim is not None else m.dim // max(1, m.n_heads)


def dense_layers(m) -> int:
    """Blocks with a dense MLP: all of them, or an MoE model's first n_dense_layers."""
    return min(m.n_dense_layers, m.n_layers) if m.n_routed_experts else m.n_layers


def muon_steps(name: str, ndim: int) -> bool:
    """Whether optimizer=muon steps a block's parameter (`name` under layers.{i}): a weight
    matrix or a stack of experts; not a norm, a bias or the router's gate (AdamW's)."""
    return ndim >= 2 and ".router." not in f".{name}"


def linear(name: str, out: int, inp: int, bias: bool = False) -> Shapes:
    return {f"{name}.weight": (out, inp), **({f"{name}.bias": (out,)} if bias else {})}


def rms_norm(name: str, width: int) -> Shapes:
    return {f"{name}.weight": (width,)}


def layer_norm(name: str, width: int) -> Shapes:
    return {f"{name}.weight": (width,), f"{name}.bias": (width,)}


def _gqa(m, qkv_bias: bool, out_bias: bool) -> Shapes:
    e = head_dim(m)
    q, kv = m.n_heads * e, m.n_kv_heads * e
    return {
        **linear("wq", q, m.dim, qkv_bias),
        **linear("wk", kv, m.dim, qkv_bias),
        **linear("wv", kv, m.dim, qkv_bias),
        **linear("wo", m.dim, q, out_bias),
    }


def gqa_tensors(m) -> Shapes:
    """Grouped-query attention without biases (Llama)."""
    return _gqa(m, False, False)


def gqa_qkv_bias_tensors(m) -> Shapes:
    """... with biases on q, k and v alone (Qwen2)."""
    return _gqa(m, True, False)


def gqa_biased_tensors(m) -> Shapes:
    """... with a bias on every projection (GPT)."""
    return _gqa(m, True, True)


def gqa_qk_norm_tensors(m) -> Shapes:
    """... without biases, with an RMSNorm gain on each head's q and on each head's k (Qwen3)."""
    e = head_dim(m)
    return {**_gqa(m, False, False), **rms_norm("q_norm", e), **rms_norm("k_norm", e)}


def gqa_qk_norm_widths(m) -> Widths:
    w = gqa_widths(m)
    return dataclasses.replace(w, normed=w.q + w.k)  # the norms keep their inputs


def mla_tensors(m) -> Shapes:
    """Multi-head latent attention (DeepSeek): q straight from the input or through a normed
    latent, one projection to the kv latent and the shared rotary key, the latent's norm, its
    up-projection to every head's key and value, the output projection."""
    h, rope, nope = m.n_heads, m.qk_rope_head_dim, m.qk_nope_head_dim
    q_out = h * (nope + rope)
    if m.q_lora_rank:
        q = {
            **linear("wq_a", m.q_lora_rank, m.dim),
            **rms_norm("q_norm", m.q_lora_rank),
            **linear("wq_b", q_out, m.q_lora_rank),
        }
    else:
        q = linear("wq", q_out, m.dim)
    return {
        **q,
        **linear("wkv_a", m.kv_lora_rank + rope, m.dim),
        **rms_norm("kv_norm", m.kv_lora_rank),
        **linear("wkv_b", h * (nope + m.v_head_dim), m.kv_lora_rank),
        **linear("wo", m.dim, h * m.v_head_dim),
    }


@dataclass(frozen=True)
class Widths:
    """A block's attention per token, in elements: what the planner prices its FLOPs and saved
    activations by (launcher/plan/memory.py applies the recompute modes to them)."""

    q: int  # the queries the attention core reads (heads x d_qk)
    k: int  # its keys (kv heads x d_qk; MLA: every head's, after the up-projection)
    v: int  # its values
    o: int  # its output, the output projection's input (heads x d_v)
    latent: int  # latents saved for backward, which tp leaves whole (MLA), else 0
    n_heads: int
    d_qk: int
    d_v: int
    normed: int = 0  # the inputs of per-head norms, kept for their backward (split by tp)


def gqa_widths(m) -> Widths:
    e = head_dim(m)
    q, kv = m.n_heads * e, m.n_kv_heads * e
    return Widths(q, kv, kv, q, 0, m.n_heads, e, e)


# One projection per token: (output width, input width, row-parallel under tp, whole on
# every tp rank).
Matmul = tuple[int, int, bool, bool]


def gqa_matmuls(m) -> list[Matmul]:
    """q, k, v and o."""
    w = gqa_widths(m)
    return [
        (w.q, m.dim, False, False),
        (w.k, m.dim, False, False),
        (w.v, m.dim, False, False),
        (m.dim, w.o, True, False),
    ]


def mla_widths(m) -> Widths:
    h, nope, rope = m.n_heads, m.qk_nope_head_dim, m.qk_rope_head_dim
    d_qk, d_v = nope + rope, m.v_head_dim
    return Widths(
        q=h * d_qk,
        k=h * d_qk,
        v=h * d_v,
        o=h * d_v,
        # Saved: the q latent and its norm, the kv latent with the shared rotated key (one
        # projection) and the kv latent's norm.
        latent=2 * m.q_lora_rank + 2 * m.kv_lora_rank + rope,
        n_heads=h,
        d_qk=d_qk,
        d_v=d_v,
    )


def mla_matmuls(m) -> list[Matmul]:
    """q (through its latent: wq_a whole, wq_b into heads; or wq), the kv latent with the
    shared rotary key (whole), its up-projection into every head's key and value, o."""
    h, nope, rope = m.n_heads, m.qk_nope_head_dim, m.qk_rope_head_dim
    q_out = h * (nope + rope)
    if m.q_lora_rank:
        q = [(m.q_lora_rank, m.dim, False, True), (q_out, m.q_lora_rank, False, False)]
    else:
        q = [(q_out, m.dim, False, False)]
    return [
        *q,
        (m.kv_lora_rank + rope, m.dim, False, True),
        (h * (nope + m.v_head_dim), m.kv_lora_rank, False, False),
        (m.dim, h * m.v_head_dim, True, False),
    ]


@dataclass(frozen=True)
class Attention:
    """A block's attention: its parameters, its per-token widths and projections, and the
    model fields it is sized by."""

    name: str  # for messages
    tensors: Callable[..., Shapes]
    widths: Callable[..., Widths]
    # Its projections in forward order (gqa_matmuls), which per-op recompute's reruns and
    # kept outputs are priced by.
    matmuls: Callable[..., list[Matmul]]
    # The model fields that size it; the config rules refuse a zero in those of `needs`.
    fields: tuple[str, ...]
    needs: tuple[str, ...] = ()
    # Whether QK-clip can bound its logits by scaling the query and key weights (not where
    # per-head q and k norms undo any such scale).
    qk_clip: bool = True


_GQA_FIELDS = ("dim", "n_heads", "n_kv_heads", "head_dim")
GQA = Attention("grouped-query attention", gqa_tensors, gqa_widths, gqa_matmuls, _GQA_FIELDS)
GQA_QKV_BIAS = Attention(
    "grouped-query attention", gqa_qkv_bias_tensors, gqa_widths, gqa_matmuls, _GQA_FIELDS
)
GQA_BIASED = Attention(
    "grouped-query attention", gqa_biased_tensors, gqa_widths, gqa_matmuls, _GQA_FIELDS
)
GQA_QK_NORM = Attention(
    "grouped-query attention with per-head q and k norms",
    gqa_qk_norm_tensors,
    gqa_qk_norm_widths,
    gqa_matmuls,
    _GQA_FIELDS,
    qk_clip=False,
)
MLA = Attention(
    "multi-head latent attention",
    mla_tensors,
    mla_widths,
    mla_matmuls,
    fields=(
        "dim",
        "n_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
    ),  # fmt: skip
    needs=("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"),
)


def swiglu(m, hidden: int | None = None, name: str = "") -> Shapes:
    """A SwiGLU MLP (w1 gate, w3 up, w2 down) of `hidden` units (model.ffn_dim)."""
    hidden = m.ffn_dim if hidden is None else hidden
    p = f"{name}." if name else ""
    return {
        **linear(f"{p}w1", hidden, m.dim),
        **linear(f"{p}w2", m.dim, hidden),
        **linear(f"{p}w3", hidden, m.dim),
    }


def gelu_mlp(m) -> Shapes:
    """A GELU MLP with biases (GPT): fc1 to model.ffn_dim, fc2 back."""
    return {**linear("fc1", m.ffn_dim, m.dim, True), **linear("fc2", m.dim, m.ffn_dim, True)}


@dataclass(frozen=True)
class MLP:
    """A dense block's MLP: its parameters, and what the planner prices it by."""

    tensors: Callable[..., Shapes]
    # Projections from the model width into the hidden width (SwiGLU's gate w1 and up w3,
    # GELU's fc1), run in that order before the one back (w2, fc2).
    gates: int
    # Hidden-width tensors it keeps for backward, per token (SwiGLU: w1's and w3's outputs and
    # the product into w2; GELU: fc1's output and the activation into fc2).
    saved: int


def routed_tensors(m) -> Shapes:
    """Routed experts in place of the MLP: the router's gate, the experts' SwiGLU weights
    stacked (one tensor per weight for all of them), and the shared experts as one SwiGLU of
    n_shared_experts x moe_ffn_dim units (none without them)."""
    e, f = m.n_routed_experts, m.moe_ffn_dim
    shared = swiglu(m, m.n_shared_experts * f, "shared") if m.n_shared_experts else {}
    return {
        **linear("router.gate", e, m.dim),
        "experts.w1": (e, f, m.dim),
        "experts.w2": (e, m.dim, f),
        "experts.w3": (e, f, m.dim),
        **shared,
    }


def token_table(m) -> Shapes:
    """The tokens' table (top-level names, as the embedding and the head are)."""
    return {"tok_embeddings.weight": (m.vocab_size, m.dim)}


def token_and_position_tables(m) -> Shapes:
    """GPT's tokens' table and its learned positions' table."""
    return {"embed.tok.weight": (m.vocab_size, m.dim), "embed.pos.weight": (m.max_seq_len, m.dim)}


@dataclass(frozen=True)
class Embedding:
    """The model's input tables (top-level names) and the model fields beyond vocab_size and
    dim that size them (a checkpoint resumes only into a model of the same sizes)."""

    tensors: Callable[..., Shapes]
    fields: tuple[str, ...] = ()


TOKENS = Embedding(token_table)
TOKENS_AND_POSITIONS = Embedding(token_and_position_tables, ("max_seq_len",))


def prediction_depth(m) -> Shapes:
    """A multi-token-prediction depth's own parameters beside its block (under `block.`): the
    norms of its two inputs, their projection back to dim, its norm before the shared head."""
    return {
        **rms_norm("enorm", m.dim),
        **rms_norm("hnorm", m.dim),
        **linear("eh_proj", m.dim, 2 * m.dim),
        **rms_norm("norm", m.dim),
    }


SWIGLU = MLP(swiglu, gates=2, saved=3)
GELU = MLP(gelu_mlp, gates=1, saved=2)


def routed_saved(m) -> int:
    """Each routed copy of a token keeps its input row, its expert's 3 SwiGLU tensors and its
    output row (kept for the routing weight's gradient)."""
    return m.top_k * (2 * m.dim + 3 * m.moe_ffn_dim)


def router_bytes(m) -> int:
    """The router's per token: its fp32 scores, the top-k weights (twice) and sums, the int64
    expert id, sort order and token of each copy, and with expert groups the groups' int64
    top-2 ids and mask."""
    groups = 17 * m.n_group if m.n_group > 1 else 0
    return 4 * (m.n_routed_experts + 2 * m.top_k + 2) + 24 * m.top_k + groups


def routed_kept(m) -> int:
    """What per-op recompute keeps per token: each copy's two up projections and output row,
    and the router's scores."""
    return m.top_k * (2 * m.moe_ffn_dim + m.dim) + m.n_routed_experts


@dataclass(frozen=True)
class Routed:
    """An MoE layer in a block's MLP's place (launcher/models/moe.py): its parameters, and what the
    planner prices its saved activations by, per token (the compute dtype's elements, the
    router's bytes), beside its shared experts' MLP of n_shared_experts x moe_ffn_dim units."""

    tensors: Callable[..., Shapes]
    saved: Callable[..., int]
    bytes: Callable[..., int]
    kept: Callable[..., int]
    shared: MLP = SWIGLU


ROUTED = Routed(routed_tensors, routed_saved, router_bytes, routed_kept)
