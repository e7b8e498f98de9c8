"""One description per model family: where its model and args classes live, how tensor
parallelism shards it (as data), its shape for the planner, and its Hugging Face model types.

Pure Python (no torch): the planner and the Hugging Face config checks read it before any
process starts. A new family is one record here plus its model module; the engine's tensor
parallelism, the planner's parameter and activation counts, the config rules and the Hugging
Face mapping read what differs from the records, never the family's name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from launcher.models import shapes
from launcher.models.shapes import Shapes

# Its blocks' feed-forward (Family.feed_forward).
DENSE, ROUTED, DENSE_FIRST = "dense", "routed", "dense first"

# Tensor-parallel styles (Megatron's layout; launcher/parallel/tensor_parallel.py maps them
# onto torch's): output features split over tp ranks, or input features split with the output
# reduced into the residual stream's layout; or a module applied to each head of the rank's
# own (a per-head norm), its weight whole on every rank and its gradient summed over tp.
COLUMN, ROW, HEADS = "column", "row", "heads"


@dataclass(frozen=True)
class HFType:
    """One transformers model type a family maps to."""

    model_type: str
    architecture: str
    score_func: str | None = None  # the router's, where it tells two model types apart
    read_defaults: dict = field(default_factory=dict)  # absent keys, as transformers reads them
    written: dict = field(default_factory=dict)  # constant keys config.json gets beside shapes


@dataclass(frozen=True)
class Family:
    name: str
    model: str  # "module:Class", imported when a model is built
    args: str  # its args dataclass, "module:Class"
    # Its debug preset (conf/model/), which the tests of "every family" run: a family is
    # covered by every such test once it is registered here.
    debug: str
    # Tensor parallelism. `tp_embedding`: the vocab-parallel token table. `tp_embedding_sum`:
    # the module adding learned positions to it (its output is cut along the sequence under
    # SP), or "" where the table's output is the residual stream. `tp_block`: module inside a
    # block -> style; names a block does not have are skipped (MLA's wq_b without a q latent,
    # the dense MLP of an MoE layer).
    tp_embedding: str
    tp_block: dict[str, str]
    tp_embedding_sum: str = ""
    # `tp_shared`: modules in a block whose output every head reads while each rank holds only
    # its heads (MLA's rotated key): each rank's backward adds only its heads' share of the
    # gradient, so it is summed over tp (Megatron's "copy to tensor-parallel region").
    # `tp_local_input`: sublayers whose replicated layers take the sequence-parallel gathered
    # input as a plain local tensor (MLA's latent projections).
    tp_shared: tuple[str, ...] = ()
    tp_local_input: tuple[str, ...] = ()
    # Parameters as data (launcher/models/shapes.py), which the planner counts: a block is its
    # attention_norm, `attention`, its ffn_norm and `mlp` (`routed` in an MoE layer); the
    # model adds `embedding` and the head (the final norm and, untied, the output projection).
    attention: shapes.Attention = shapes.GQA
    mlp: shapes.MLP = shapes.SWIGLU
    routed: shapes.Routed = shapes.ROUTED
    norm: Callable[[str, int], Shapes] = shapes.rms_norm
    embedding: shapes.Embedding = shapes.TOKENS
    # Its blocks' feed-forward: DENSE (the MLP), ROUTED (routed experts in every block), or
    # DENSE_FIRST (the first model.n_dense_layers blocks dense, routed experts after).
    feed_forward: str = DENSE
    # Multi-token prediction (model.mtp_depth): a depth's own parameters beside its block
    # (mtp.{k}.block, numbered as layer n_layers + k), or None where the model has none.
    prediction_depth: Callable[..., Shapes] | None = None
    # torchtitan's model of this family, which the benchmarks run as a peer (launcher/bench/
    # titan.py, titan_moe.py): "llama3" (its Llama3Model), "deepseek_v3" (its DeepSeekV3Model),
    # "qwen3_moe_blocks" (its Qwen3Model of MoE blocks without q/k norms: Mixtral's shape),
    # or "" where it has none.
    titan: str = ""
    # The RoPE scalings its model implements: "llama3" (model.rope_scaling_factor, ...),
    # "yarn" (model.rope_yarn_factor, ...); none for learned positions. The config rules and
    # the Hugging Face config read it.
    rope: tuple[str, ...] = ("llama3",)
    # The planner's memory-bound traffic: elements the non-matmul operators of a block move per
    # token, (per dim, per MLP hidden unit); launcher/plan/kernels.py says how they were counted.
    elementwise: tuple[float, float] = (103.0, 16.0)  # RoPE and fp32 RMSNorm chains
    # Hugging Face: transformers' model types, config.json's keys for the family's own fields
    # beyond those every family shares (launcher/hf/config_json.py), keys written null for a
    # zero, the RoPE scalings the model has, checks of what the model lacks, and the attention's
    # and MoE layer's parameter names there (launcher/hf/names.py).
    hf: tuple[HFType, ...] = field(default=())
    hf_config: tuple[tuple[str, str], ...] = field(default=())
    hf_null_zero: tuple[str, ...] = field(default=())

    hf_unsupported: Callable[[dict], list[str]] | None = None
    hf_attention: dict[str, str] = field(default_factory=dict)
    # Parameters whose rows transformers holds per head in rotate-half order where ours rotate
    # interleaved pairs (permuted both ways by launcher/hf/weights.py) -> the config field
    # counting their heads, or 1 for one head's width (a per-head norm's gain).
    hf_rotate_half: dict[str, str | int] = field(default_factory=dict)
    hf_moe: dict[str, str] = field(default_factory=dict)
    # Multi-token prediction there: a depth's own parameters (ours -> theirs, under the layer
    # numbered after the model's), and the model's parameters it holds copies of.
    hf_depth: dict[str, str] = field(default_factory=dict)
    hf_depth_copies: dict[str, str] = field(default_factory=dict)

    def block(self, m, moe: bool) -> Shapes:
        """One block's parameters (under layers.{i}): a dense one, or one with routed experts."""
        return {
            **self.norm("attention_norm", m.dim),
            **{f"attention.{k}": v for k, v in self.attention.tensors(m).items()},
            **self.norm("ffn_norm", m.dim),
            **{
                f"feed_forward.{k}": v
                for k, v in (self.routed if moe else self.mlp).tensors(m).items()
            },
        }

    def head(self, m) -> Shapes:
        """The final norm and, unless tied to the tokens' table, the output projection."""
        out = {} if m.tie_embeddings else shapes.linear("output", m.vocab_size, m.dim)
        return {**self.norm("norm", m.dim), **out}

    def tensors(self, m) -> Shapes:
        """Every parameter of the model, named as the built model names them."""
        moe_from = shapes.dense_layers(m)
        blocks = {
            f"layers.{i}.{k}": v
            for i in range(m.n_layers)
            for k, v in self.block(m, moe=i >= moe_from).items()
        }
        return {**self.embedding.tensors(m), **blocks, **self.head(m), **self.ahead(m)}

    def ahead(self, m) -> Shapes:
        """The multi-token-prediction depths' parameters (none at mtp_depth 0)."""
        out = {}
        for k in range(m.mtp_depth if self.prediction_depth else 0):
            block = self.block(m, moe=m.n_layers + k >= shapes.dense_layers(m))
            out.update({f"mtp.{k}.{n}": v for n, v in self.prediction_depth(m).items()})
            out.update({f"mtp.{k}.block.{n}": v for n, v in block.items()})
        return out

    def problems(self, m) -> list[str]:
        """What a model config asks of this family that its model does not do: routed experts
        where it has none or none where it routes, dense first layers it lacks, a zero in a
        field its attention needs."""
        out, routes = [], self.feed_forward != DENSE
        if bool(m.n_routed_experts) != routes:
            out.append(
                f"model.n_routed_experts={m.n_routed_experts}: a {self.name} model "
                + ("needs routed experts (>= 1)" if routes else "has no routed experts")
                + f" (the MoE families: {_named(lambda f: f.feed_forward != DENSE)})"
            )
        if m.n_routed_experts and m.n_dense_layers and self.feed_forward != DENSE_FIRST:
            out.append(
                f"model.n_dense_layers={m.n_dense_layers}: every layer of a {self.name} model "
                f"is an MoE one (dense first layers: "
                f"{_named(lambda f: f.feed_forward == DENSE_FIRST)})"
            )
        if m.mtp_depth and self.prediction_depth is None:
            out.append(
                f"model.mtp_depth={m.mtp_depth}: a {self.name} model has no multi-token "
                f"prediction (the families with it: {_named(lambda f: f.prediction_depth)})"
            )
        missing = [f for f in self.attention.needs if not getattr(m, f)]
        if missing:
            out.append(
                f"{self.name} ({self.attention.name}) needs "
                + ", ".join(f"model.{f}" for f in missing)
                + " (>= 1)"
            )
        return out

    def classes(self) -> tuple[type, type]:
        """(model class, args class), imported now."""
        return tuple(_load(path) for path in (self.model, self.args))  # type: ignore[return-value]


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


# Attention heads split over tp (GQA's kv heads too; gpt's names are the same), and a SwiGLU
# MLP's hidden features.
_GQA = {
    "attention.wq": COLUMN,
    "attention.wk": COLUMN,
    "attention.wv": COLUMN,
    "attention.wo": ROW,
}
# Per-head q and k norms (Qwen3): each rank normalises its own heads.
_QK_NORMS = {"attention.q_norm": HEADS, "attention.k_norm": HEADS}
_SWIGLU = {"feed_forward.w1": COLUMN, "feed_forward.w3": COLUMN, "feed_forward.w2": ROW}

# An MoE layer under tp (launcher/parallel/tensor_parallel.moe_plan): its shared experts are a
# Megatron MLP; the router's gate stays whole, and the routed experts are split by expert
# parallelism, never by tp.
TP_ROUTED = {
    "feed_forward.shared.w1": COLUMN,
    "feed_forward.shared.w3": COLUMN,
    "feed_forward.shared.w2": ROW,
}

# Hugging Face parameter names: ours (under layers.{i}) -> theirs (under model.layers.{i});
# "{e}" numbers the experts. The names every family shares (embedding, norms, dense MLP) are in
# launcher/hf/names.py.
_QKV = (("wq", "q"), ("wk", "k"), ("wv", "v"))
_HF_ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
# Their gains, one head wide: permuted as one head's rows are.
_HF_QK_NORMS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
# Llama's q and k rows, rotated in interleaved pairs here and in halves in transformers.
_ROTATE_HALF = {"attention.wq.weight": "n_heads", "attention.wk.weight": "n_kv_heads"}
# Multi-head latent attention. DeepSeek's checkpoints keep the rope rows of q and of the
# shared key (the last qk_rope_head_dim rows of each q head and of kv_a_proj_with_mqa) in
# interleaved pairs, as ours: transformers' DeepseekV2 rotates them as complex pairs and its
# DeepseekV3 (rope_interleave=true) de-interleaves q and k alike. No permutation.
_HF_MLA = {
    "attention.wq.weight": "self_attn.q_proj.weight",  # q_lora_rank = 0
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_HF_MIXTRAL_MOE = {
    "feed_forward.router.gate.weight": "block_sparse_moe.gate.weight",
    "feed_forward.experts.w1": "block_sparse_moe.experts.{e}.w1.weight",
    "feed_forward.experts.w2": "block_sparse_moe.experts.{e}.w2.weight",
    "feed_forward.experts.w3": "block_sparse_moe.experts.{e}.w3.weight",
}
# transformers holds DeepSeek's experts fused (gate_up_proj, down_proj) but save_pretrained
# writes them one per expert, under these names, as DeepSeek's own checkpoints do.
_HF_DEEPSEEK_MOE = {
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",  # a buffer
    "feed_forward.experts.w1": "mlp.experts.{e}.gate_proj.weight",
    "feed_forward.experts.w2": "mlp.experts.{e}.down_proj.weight",
    "feed_forward.experts.w3": "mlp.experts.{e}.up_proj.weight",
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
}
# transformers holds Qwen3 MoE's experts fused (gate_up_proj, down_proj); save_pretrained
# writes them one per expert, as the released checkpoints are.
_HF_QWEN3_MOE = {
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.experts.w1": "mlp.experts.{e}.gate_proj.weight",
    "feed_forward.experts.w2": "mlp.experts.{e}.down_proj.weight",
    "feed_forward.experts.w3": "mlp.experts.{e}.up_proj.weight",
}
# DeepSeek-V3's multi-token prediction in its checkpoints: depth k is model.layers.{n_layers
# + k}, its block's tensors named as a layer's, its own ones below, and copies of the token
# table and the output head beside them (the report's MTP shares both with the model: they
# are written on export and the model's own are read).
_HF_DEPTH = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_HF_DEPTH_COPIES = {
    "tok_embeddings.weight": "embed_tokens.weight",
    "output.weight": "shared_head.head.weight",
}
# config.json keys of each family's own fields: (config.json key, model config field).
_HF_HEAD_DIM = (("head_dim", "head_dim"),)  # DeepSeek's config.json has one too: its rope width
_HF_DEEPSEEK_KEYS = (
    ("intermediate_size", "ffn_dim"),
    ("moe_intermediate_size", "moe_ffn_dim"),
    ("n_routed_experts", "n_routed_experts"),
    ("n_shared_experts", "n_shared_experts"),
    ("num_experts_per_tok", "top_k"),
    ("first_k_dense_replace", "n_dense_layers"),
    ("q_lora_rank", "q_lora_rank"),
    ("kv_lora_rank", "kv_lora_rank"),
    ("qk_nope_head_dim", "qk_nope_head_dim"),
    ("qk_rope_head_dim", "qk_rope_head_dim"),
    ("v_head_dim", "v_head_dim"),
    ("n_group", "n_group"),
    ("topk_group", "topk_group"),
    ("norm_topk_prob", "norm_topk_prob"),
    ("routed_scaling_factor", "routed_scaling_factor"),
    ("num_nextn_predict_layers", "mtp_depth"),
)


def _qwen3_moe_unsupported(hf: dict) -> list[str]:
    """Dense layers among Qwen3 MoE's: every block here routes."""
    out = []
    if (hf.get("decoder_sparse_step") or 1) != 1:
        out.append(f"decoder_sparse_step={hf['decoder_sparse_step']} (experts in every layer only)")
    if hf.get("mlp_only_layers"):
        out.append(f"mlp_only_layers={hf['mlp_only_layers']} (experts in every layer only)")
    return out


def _deepseek_unsupported(hf: dict) -> list[str]:
    """What DeepSeek's config.json may ask for that this model does not do."""
    out = []
    defaults = next(
        t.read_defaults for t in FAMILIES["deepseek"].hf if t.model_type == hf["model_type"]
    )
    missing = [k for k, _ in _HF_DEEPSEEK_KEYS if k not in hf and k not in defaults]
    if missing:
        out.append(f"no {', '.join(missing)} (their defaults are a full-size model's)")
    if hf["model_type"] == "deepseek_v3" and hf.get("rope_interleave") is False:
        # Rotate-half rows for the rope part of q and of the shared key: not permuted here.
        out.append("rope_interleave=false (DeepSeek's interleaved RoPE rows only)")
    if hf["model_type"] == "deepseek_v2":
        method = hf.get("topk_method") or "greedy"
        if method != "greedy" and (hf.get("n_group") or 1) > 1:
            out.append(f"topk_method={method} (greedy top-k only)")
        if hf.get("norm_topk_prob"):
            # transformers' DeepseekV2 router never renormalises; ours would.
            out.append("norm_topk_prob=true (transformers' DeepseekV2 ignores it)")
    return out


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llama",
            "launcher.models.llama:Transformer",
            "launcher.models.llama:LlamaArgs",
            debug="llama3_debug",
            titan="llama3",
            tp_embedding="tok_embeddings",
            tp_block={**_GQA, **_SWIGLU},
            hf=(
                HFType(
                    "llama", "LlamaForCausalLM", written=dict(attention_bias=False, mlp_bias=False)
                ),
            ),
            hf_config=(*_HF_HEAD_DIM, ("intermediate_size", "ffn_dim")),
            hf_attention=_HF_ATTENTION,
            hf_rotate_half=_ROTATE_HALF,
        ),
        Family(
            "qwen2",
            "launcher.models.qwen2:Qwen2",
            "launcher.models.qwen2:Qwen2Args",
            debug="qwen2_debug",
            attention=shapes.GQA_QKV_BIAS,
            tp_embedding="tok_embeddings",
            tp_block={**_GQA, **_SWIGLU},
            hf=(HFType("qwen2", "Qwen2ForCausalLM", written=dict(use_sliding_window=False)),),
            hf_config=(("intermediate_size", "ffn_dim"),),  # head_dim: hidden_size / heads
            hf_attention={
                **_HF_ATTENTION,
                **{f"attention.{w}.bias": f"self_attn.{p}_proj.bias" for w, p in _QKV},
            },
            # q's and k's biases permuted as their weights' rows
            hf_rotate_half={
                **_ROTATE_HALF,
                "attention.wq.bias": "n_heads",
                "attention.wk.bias": "n_kv_heads",
            },
        ),
        Family(
            "qwen3",
            "launcher.models.qwen3:Qwen3",
            "launcher.models.qwen3:Qwen3Args",
            debug="qwen3_debug",
            attention=shapes.GQA_QK_NORM,
            tp_embedding="tok_embeddings",
            tp_block={**_GQA, **_QK_NORMS, **_SWIGLU},
            hf=(HFType("qwen3", "Qwen3ForCausalLM", written=dict(attention_bias=False)),),
            hf_config=(*_HF_HEAD_DIM, ("intermediate_size", "ffn_dim")),
            hf_attention={**_HF_ATTENTION, **_HF_QK_NORMS},
            hf_rotate_half={**_ROTATE_HALF, **{k: 1 for k in _HF_QK_NORMS}},
        ),
        Family(
            "gpt",
            "launcher.models.gpt:GPT",
            "launcher.models.gpt:GPTArgs",
            debug="gpt_debug",
            attention=shapes.GQA_BIASED,
            mlp=shapes.GELU,
            norm=shapes.layer_norm,
            embedding=shapes.TOKENS_AND_POSITIONS,
            tp_embedding="embed.tok",
            tp_embedding_sum="embed",
            tp_block={**_GQA, "feed_forward.fc1": COLUMN, "feed_forward.fc2": ROW},
            rope=(),
            elementwise=(16.0, 16.0),  # LayerNorm and biases: fewer than the rotary families
        ),
        Family(
            "mixtral",
            "launcher.models.mixtral:Mixtral",
            "launcher.models.mixtral:MixtralArgs",
            debug="mixtral_debug",
            titan="qwen3_moe_blocks",
            tp_embedding="tok_embeddings",
            tp_block=_GQA,  # every layer is an MoE one (tensor_parallel.moe_plan)
            feed_forward=ROUTED,
            hf=(
                HFType(
                    "mixtral",
                    "MixtralForCausalLM",
                    written=dict(sliding_window=None, output_router_logits=False),
                ),
            ),
            hf_config=(
                *_HF_HEAD_DIM,
                ("intermediate_size", "moe_ffn_dim"),
                ("num_local_experts", "n_routed_experts"),
                ("num_experts_per_tok", "top_k"),
            ),
            hf_attention=_HF_ATTENTION,
            hf_rotate_half=_ROTATE_HALF,
            hf_moe=_HF_MIXTRAL_MOE,
        ),
        Family(
            "qwen3_moe",
            "launcher.models.qwen3_moe:Qwen3MoE",
            "launcher.models.qwen3_moe:Qwen3MoEArgs",
            debug="qwen3_moe_debug",
            attention=shapes.GQA_QK_NORM,
            feed_forward=ROUTED,
            tp_embedding="tok_embeddings",
            tp_block={**_GQA, **_QK_NORMS},  # every layer is an MoE one
            hf=(
                HFType(
                    "qwen3_moe",
                    "Qwen3MoeForCausalLM",
                    read_defaults=dict(norm_topk_prob=False),
                    written=dict(
                        attention_bias=False,
                        decoder_sparse_step=1,
                        mlp_only_layers=[],
                        output_router_logits=False,
                    ),
                ),
            ),
            # The released config.json files say num_experts, transformers 5 writes
            # num_local_experts: either is read. intermediate_size sizes the dense MLP of
            # mlp_only_layers, which every layer here is not: kept, unused.
            hf_config=(
                *_HF_HEAD_DIM,
                ("intermediate_size", "ffn_dim"),
                ("moe_intermediate_size", "moe_ffn_dim"),
                ("num_experts", "n_routed_experts"),
                ("num_local_experts", "n_routed_experts"),
                ("num_experts_per_tok", "top_k"),
                ("norm_topk_prob", "norm_topk_prob"),
            ),
            hf_unsupported=_qwen3_moe_unsupported,
            hf_attention={**_HF_ATTENTION, **_HF_QK_NORMS},
            hf_rotate_half={**_ROTATE_HALF, **{k: 1 for k in _HF_QK_NORMS}},
            hf_moe=_HF_QWEN3_MOE,
        ),
        Family(
            "deepseek",
            "launcher.models.deepseek:DeepSeek",
            "launcher.models.deepseek:DeepSeekArgs",
            debug="deepseek_debug",
            attention=shapes.MLA,
            titan="deepseek_v3",
            tp_embedding="tok_embeddings",
            # MLA: the latent down-projections and their norms stay replicated (every rank
            # computes the small latents); the up-projections into heads split by head.
            tp_block={
                "attention.wq": COLUMN,
                "attention.wq_b": COLUMN,
                "attention.wkv_b": COLUMN,
                "attention.wo": ROW,
                **_SWIGLU,  # the first n_dense_layers
            },
            tp_shared=("attention.shared_key",),
            tp_local_input=("attention",),
            feed_forward=DENSE_FIRST,
            prediction_depth=shapes.prediction_depth,
            # deepseek_v3: sigmoid router scores with a correction bias and group-limited
            # choice; deepseek_v2: softmax, greedy top-k. Absent routing keys take transformers'
            # defaults for the type. DeepSeek's checkpoints keep RoPE rows in interleaved pairs,
            # as ours; no MTP module.
            hf=(
                HFType(
                    "deepseek_v3",
                    "DeepseekV3ForCausalLM",
                    "sigmoid",
                    dict(
                        n_group=8,
                        topk_group=4,
                        norm_topk_prob=True,
                        routed_scaling_factor=2.5,
                        num_nextn_predict_layers=0,
                    ),
                    dict(attention_bias=False, rope_interleave=True),
                ),
                HFType(
                    "deepseek_v2",
                    "DeepseekV2ForCausalLM",
                    "softmax",
                    dict(
                        n_group=None,
                        topk_group=None,
                        norm_topk_prob=False,
                        routed_scaling_factor=1.0,
                        num_nextn_predict_layers=0,
                    ),
                    dict(attention_bias=False, topk_method="greedy", mlp_bias=False),
                ),
            ),
            hf_config=_HF_DEEPSEEK_KEYS,
            hf_null_zero=("q_lora_rank",),
            rope=("yarn",),
            hf_unsupported=_deepseek_unsupported,
            hf_attention=_HF_MLA,
            hf_moe=_HF_DEEPSEEK_MOE,
            hf_depth=_HF_DEPTH,
            hf_depth_copies=_HF_DEPTH_COPIES,
        ),
    )
}


# What an unknown family counts as until the config rules (launcher/plan/rules.py) refuse it
# (before any count is used), and what an unknown Hugging Face model type is checked as.
FALLBACK = "llama"


def of(model) -> Family:
    """The record of a model config's family (FALLBACK's for an unknown one)."""
    return FAMILIES.get(model.family, FAMILIES[FALLBACK])


def _named(which: Callable[[Family], bool]) -> str:
    """ "mixtral, deepseek": the families `which` holds for (for messages)."""
    return ", ".join(f.name for f in FAMILIES.values() if which(f))


def named_with_rope(kind: str) -> str:
    """ "deepseek": the families whose model implements that RoPE scaling (for messages)."""
    return _named(lambda f: kind in f.rope)


def family(name: str) -> Family:
    """The record of `name`; a KeyError names the families there are."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"model.family={name} is not one of {', '.join(FAMILIES)}") from None
