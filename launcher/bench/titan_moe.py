"""torchtitan's own mixture-of-experts models as contenders of the speed benchmark:
`torchtitan(w)` for deepseek- and mixtral-family workloads (Llama: launcher/bench/titan.py).

DeepSeek (V2-Lite, V3, Kimi K2 shapes): torchtitan 0.3.0's `DeepSeekV3Model`, its layers from
its own `build_mla_moe_layers` with DeepSeek-V3's init tables, as its registry builds a flavor
(its `16B` is DeepSeek-V2-Lite): MLA with YaRN RoPE (its complex, adjacent-pair rotation, as
ours), a dense SwiGLU in the first n_dense_layers, then its MoE: `TokenChoiceTopKRouter`
(softmax or sigmoid scores, group-limited choice on biased scores, renormalised and scaled
weights), the experts as torch's grouped matmul behind the local token dispatcher (no expert
parallelism), and the shared experts. Mixtral: 0.3.0 has no Mixtral model, but its Qwen3 MoE
block is one once Qwen3's q/k norms are left out: pre-norm, Llama's GQA attention (the same
config the Llama peer builds: fused wqkv, complex RoPE) and an MoE of softmax top-k weights
renormalised over the chosen, no shared experts; in a `Qwen3Model` (a plain decoder).

As for Llama: built on the meta device, each block compiled by its `apply_compile` under
w.compile, materialised and initialised by its `init_weights`; attention is its
`ScaledDotProductAttention` (causal; its registry's default is flex attention).

A fair peer: same shape, parameter count and, with the same weights, logits as this project's
model (tests/bench/test_titan_moe.py; experts in bf16 on both sides there, see below), and the
step is the shared `plain_loop`. What a reader of the table should know differs:

- its experts compute in bf16 whatever the model's dtype (`GroupedExperts` casts tokens and
  weights); ours in the compute dtype, bf16 under the benchmark's bf16 autocast too;
- its router's gate runs in fp32 under autocast; ours in the compute dtype, scored in fp32:
  near-ties can route differently in bf16 (not in fp32, where the choice is the same);
- no balance losses: 0.3.0's MoE has neither the Switch loss (aux_loss_coef) nor the
  sequence-wise one (seq_aux_loss_coef), so the peer trains without them, as the transformers
  peer does; the engine adds them (small: statistics of the router's scores);
- its SDPA tries cuDNN, flash, then the math kernel, in that order; MLA's queries and keys
  (qk_nope_head_dim + qk_rope_head_dim: 192 in V2-Lite) are wider than its values (128),
  which torch's flash kernel does not take, so it runs cuDNN's kernel where that takes the
  shapes, else math (the (S, S) scores in memory); ours leaves the choice to torch,
  memory-efficient attention included;
- its auxiliary-loss-free bias update (bias_update_speed: its load_balance_coeff) is an
  optimizer hook its trainer registers, so in the plain loop the bias stays at zero; the engine
  moves ours after every step; each forward of its MoE still counts the tokens per expert.

Fields its model cannot express raise ValueError naming them: dropout, a sequence longer than
max_seq_len, softmax routing with expert groups (ours refuses it too), and YaRN magnitudes that
are not one softmax factor (it folds mscale into the softmax scale only: ours must then scale
the rotated parts by 1, i.e. rope_yarn_mscale == rope_yarn_mscale_all_dim, both set).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from launcher.bench import titan
from launcher.bench.peers import Step, Workload, plain_loop
from launcher.models import families
from launcher.models.deepseek import LATENT_NORM_EPS


def _titan() -> SimpleNamespace:
    """torchtitan's modules the MoE models need, or an ImportError saying what to install."""
    common, llama3, config_utils = titan._titan()
    try:
        import torchtitan.models.deepseek_v3 as deepseek_v3
        from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
    except ModuleNotFoundError as e:
        raise ImportError(
            f"the torchtitan contender cannot import {e.name!r}: install "
            f"`pip install --no-deps --target DIR {titan.WHEELS}`, put DIR on PYTHONPATH"
        ) from e
    return SimpleNamespace(
        common=common,
        llama3=llama3,
        config_utils=config_utils,
        deepseek_v3=deepseek_v3,
        Qwen3Model=Qwen3Model,
        Qwen3TransformerBlock=Qwen3TransformerBlock,
    )


def _yarn_mscale(m: dict) -> float:
    """Its Attention's `mscale` for ours' YaRN fields: the softmax is scaled by
    (0.1 mscale ln factor + 1)^2, ours by the same of rope_yarn_mscale_all_dim; ours scales the
    rotated parts by 1 only where both magnitudes are set and equal
    (launcher/models/deepseek.py)."""
    factor, m_rot, m_all = (
        m["rope_yarn_factor"],
        m["rope_yarn_mscale"],
        m["rope_yarn_mscale_all_dim"],
    )
    if factor <= 1:
        return 1.0  # unused: no YaRN
    if not (m_rot and m_all and math.isclose(m_rot, m_all)):
        raise ValueError(
            f"torchtitan's DeepSeek cannot express rope_yarn_mscale={m_rot!r} with "
            f"rope_yarn_mscale_all_dim={m_all!r}: it scales the softmax only, never the "
            "rotated parts (ours does unless both are set and equal)"
        )
    return m_all


def _check(m: dict, seq_len: int) -> None:
    if families.family(m["family"]).titan not in MAKE:
        raise ValueError(f"torchtitan's MoE peer cannot express family={m['family']!r}")
    if m["dropout"]:
        raise ValueError(f"torchtitan's MoE models cannot express dropout={m['dropout']!r}")
    if seq_len > m["max_seq_len"]:
        raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={m['max_seq_len']}")
    if m["score_func"] == "softmax" and m["n_group"] > 1:
        raise ValueError(
            f"n_group={m['n_group']} with score_func=softmax: torchtitan limits softmax routing "
            "to groups, ours picks from all experts (and its rules refuse it)"
        )


def _mixtral_moe(t: SimpleNamespace, m: dict, i: int):
    """Its MoE.Config of Mixtral's layer i: softmax top-k weights renormalised over the chosen
    (launcher/models/mixtral.py's Router), no shared experts, no expert bias; DeepSeek-V3's init."""
    d3, cu, e, k = t.deepseek_v3, t.config_utils, m["n_routed_experts"], m["top_k"]
    return cu.make_moe_config(
        num_experts=e,
        router=cu.make_router_config(
            dim=m["dim"],
            num_experts=e,
            gate_param_init=d3._depth_init(i),
            top_k=k,
            score_func="softmax",
            route_norm=True,
        ),
        routed_experts=cu.make_routed_experts_config(
            dim=m["dim"],
            hidden_dim=m["moe_ffn_dim"],
            num_experts=e,
            top_k=k,
            param_init=d3._depth_experts_init(i),
            comm_backend="standard",  # the local dispatcher: no expert parallelism
        ),
        load_balance_coeff=None,
    )


def _deepseek_config(m: dict, seq_len: int, t: SimpleNamespace):
    """DeepSeekV3Model.Config of exactly the shape in `m`."""

    common, d3, factor = t.common, t.deepseek_v3, m["rope_yarn_factor"]
    sigmoid = m["score_func"] == "sigmoid"
    groups = m["n_group"] if sigmoid and m["n_group"] > 1 else None
    layers = d3._build_dsv3_layers(
        n_layers=m["n_layers"],
        n_dense_layers=m["n_dense_layers"],
        dim=m["dim"],
        n_heads=m["n_heads"],
        q_lora_rank=m["q_lora_rank"],
        kv_lora_rank=m["kv_lora_rank"],
        qk_nope_head_dim=m["qk_nope_head_dim"],
        qk_rope_head_dim=m["qk_rope_head_dim"],
        v_head_dim=m["v_head_dim"],
        mscale=_yarn_mscale(m),
        dense_hidden_dim=m["ffn_dim"],
        moe_hidden_dim=m["moe_ffn_dim"],
        num_experts=m["n_routed_experts"],
        num_shared_experts=m["n_shared_experts"],
        router_top_k=m["top_k"],
        router_score_func=m["score_func"],
        router_num_expert_groups=groups,
        router_num_limited_groups=m["topk_group"] if groups else None,
        router_route_scale=m["routed_scaling_factor"],
        router_route_norm=m["norm_topk_prob"],
        attn_backend="flex",  # replaced below: its config helper refuses "sdpa" for LMs
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=common.ComplexRoPE.Config(
            dim=m["qk_rope_head_dim"],
            max_seq_len=seq_len,  # cut to the trained length, as its update_from_config does
            theta=m["rope_theta"],
            scaling="yarn" if factor > 1 else "none",
            rope_factor=max(factor, 1.0),
            beta_fast=m["rope_yarn_beta_fast"],
            beta_slow=m["rope_yarn_beta_slow"],
            original_seq_len=m["rope_yarn_original_max_seq_len"],
        ),
    )
    # Its expert bias only where ours moves one (sigmoid scores, bias_update_speed > 0).
    bias = (m["bias_update_speed"] if sigmoid else 0.0) or None
    for layer in layers:
        # Its norms all take RMSNorm's default eps (1e-5); ours: norm_eps in the blocks, the
        # reference's 1e-6 in the latents.
        layer.attention_norm.eps = layer.ffn_norm.eps = m["norm_eps"]
        layer.attention.q_norm.eps = layer.attention.kv_norm.eps = LATENT_NORM_EPS
        layer.attention.inner_attention = common.ScaledDotProductAttention.Config()
        if layer.moe is not None:
            layer.moe.load_balance_coeff = bias
            if not m["n_shared_experts"]:  # it always builds them, of width 0 here
                layer.moe.shared_experts = None
    dim, vocab = m["dim"], m["vocab_size"]
    return d3.DeepSeekV3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=common.Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=d3._EMBEDDING_INIT
        ),
        norm=common.RMSNorm.Config(
            normalized_shape=dim, eps=m["norm_eps"], param_init=d3._NORM_INIT
        ),
        lm_head=common.Linear.Config(
            in_features=dim, out_features=vocab, param_init=d3._output_linear_init(dim)
        ),
        layers=layers,
    )


def _mixtral_config(m: dict, seq_len: int, t: SimpleNamespace):
    """Qwen3Model.Config of Mixtral blocks of exactly the shape in `m`: the Llama peer's
    config of the same shape, each block's feed-forward replaced by an MoE."""
    llama = titan._config(m, seq_len, t.common, t.llama3, t.config_utils, experts=True)
    layers = [
        t.Qwen3TransformerBlock.Config(
            attention=block.attention,  # Llama's GQA: no q/k norms
            attention_norm=block.attention_norm,
            ffn_norm=block.ffn_norm,
            moe=_mixtral_moe(t, m, i),
        )
        for i, block in enumerate(llama.layers)
    ]
    fields = ("dim", "vocab_size", "tok_embeddings", "norm", "lm_head", "enable_weight_tying")
    return t.Qwen3Model.Config(**{f: getattr(llama, f) for f in fields}, layers=layers)


def config(m: dict, seq_len: int):
    """torchtitan's model config of exactly the shape in `m` (ModelConfig fields) for
    sequences of `seq_len`."""
    t = _titan()
    _check(m, seq_len)
    return MAKE[families.family(m["family"]).titan](m, seq_len, t)


# The family's torchtitan model (its record's `titan`): DeepSeekV3Model for multi-head latent
# attention; Llama's attention in Qwen3's MoE blocks for Mixtral's shape.
MAKE = {"deepseek_v3": _deepseek_config, "qwen3_moe_blocks": _mixtral_config}


def build(w: Workload) -> torch.nn.Module:
    """torchtitan's DeepSeekV3Model (deepseek) or Qwen3Model of Mixtral blocks (mixtral) for
    `w`, initialised on w.device (compiled blocks with w.compile), in training mode."""
    return titan.materialise(config(w.model, w.micro[0][0].shape[1]), w)


def torchtitan(w: Workload) -> Step:
    """torchtitan's MoE model of the workload's shape in the plain loop."""
    model = build(w)
    return plain_loop(model, w, lambda x: model(x))  # maskless: causal rows at 0..S-1
