"""Tiny transformers models shaped like our debug presets, built from config objects and saved
with save_pretrained (nothing is downloaded), and the overrides that describe them to a run."""

from __future__ import annotations

from pathlib import Path

import torch

# The shape both debug presets share.
SHARED = dict(
    vocab_size=320,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
# llama3_debug, with Llama 3 RoPE scaling switched on (so that it is checked too).
LLAMA = dict(
    SHARED,
    intermediate_size=384,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
)
LLAMA_RUN = [
    "model=llama3_debug",
    "model.rope_scaling_factor=8.0",
    "model.rope_original_max_seq_len=16",
]
MIXTRAL = dict(SHARED, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2)
MIXTRAL_RUN = ["model=mixtral_debug"]
QWEN2 = dict(SHARED, intermediate_size=384)  # qwen2_debug: biases on q, k and v
QWEN2_RUN = ["model=qwen2_debug"]
# qwen3_debug: a norm on each head's q and k (their gains random in `build`), heads 32 wide.
QWEN3 = dict(
    {k: v for k, v in SHARED.items() if k != "rope_theta"},
    intermediate_size=384,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
QWEN3_RUN = ["model=qwen3_debug"]
# qwen3_moe_debug: qwen3_debug's attention, 8 experts top-2 renormalised, as released.
QWEN3_MOE = dict(
    QWEN3, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
)
QWEN3_MOE_RUN = ["model=qwen3_moe_debug"]
# deepseek_debug: MLA with a q latent, first layer dense, 8 experts (sigmoid + bias, best 2 of
# 4 groups, weights renormalised x 2.5) + 1 shared, YaRN 128 -> 512.
DEEPSEEK_V3 = dict(
    {k: v for k, v in SHARED.items() if k != "rope_theta"},  # in rope_parameters
    num_key_value_heads=8,
    rms_norm_eps=1e-6,
    intermediate_size=256,
    moe_intermediate_size=64,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
DEEPSEEK_V3_RUN = ["model=deepseek_debug"]
# DeepSeek-V2-Lite's kind on the same shape: queries straight from dim, softmax greedy top-2
# of 8 experts (weights not renormalised, x 2.0), 2 shared; mscale != mscale_all_dim, so
# YaRN also scales the rotated parts.
DEEPSEEK_V2 = dict(
    {k: v for k, v in DEEPSEEK_V3.items() if k not in ("n_group", "topk_group")},
    q_lora_rank=None,
    n_shared_experts=2,
    norm_topk_prob=False,
    routed_scaling_factor=2.0,
    topk_method="greedy",
    rope_parameters={**DEEPSEEK_V3["rope_parameters"], "mscale_all_dim": 0.707},
)
DEEPSEEK_V2_RUN = [
    "model=deepseek_debug",
    "model.q_lora_rank=0",
    "model.n_shared_experts=2",
    "model.score_func=softmax",
    "model.n_group=1",
    "model.topk_group=1",
    "model.norm_topk_prob=false",
    "model.routed_scaling_factor=2.0",
    "model.rope_yarn_mscale_all_dim=0.707",
]
RUN = {
    "llama": LLAMA_RUN,
    "mixtral": MIXTRAL_RUN,
    "qwen2": QWEN2_RUN,
    "qwen3": QWEN3_RUN,
    "qwen3_moe": QWEN3_MOE_RUN,
    "deepseek_v3": DEEPSEEK_V3_RUN,
    "deepseek_v2": DEEPSEEK_V2_RUN,
}


def build(kind: str, seed: int = 0, **changes):
    """A randomly initialised transformers model (fp32, eval mode) of a kind: a family, or
    deepseek_v3 / deepseek_v2. DeepSeek-V3's expert correction biases are random too (they
    start at zero), so that they take part in the choice of experts, and mostly below -0.5:
    biased scores (sigmoid + bias) below zero must still beat the groups left out. Qwen3's
    per-head q and k norm gains are random too (they start at one), so that their order
    within a head (rotate-half there, interleaved here) counts."""
    import transformers

    torch.manual_seed(seed)
    names = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", MIXTRAL),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", QWEN2),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_MOE),
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_V3),
        "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", DEEPSEEK_V2),
    }
    config_cls, model_cls, fields = names[kind]
    config = getattr(transformers, config_cls)(**{**fields, **changes})
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.3 - 0.6)
        for name, w in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                w.copy_(1 + torch.randn(w.shape) * 0.5)
    return model.eval()


def save(model, out: Path, shard: str = "150KB") -> Path:
    """save_pretrained in several safetensors files with an index."""
    model.save_pretrained(out, max_shard_size=shard)
    return out


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


def assert_close(ours: torch.Tensor, ref: torch.Tensor, label: str, rtol: float = 1e-4) -> None:
    """Within rtol of the reference's largest logit (fp32: only summation order differs)."""
    assert ours.shape == ref.shape, f"{label}: shape {list(ours.shape)} vs {list(ref.shape)}"
    err = float((ours - ref).abs().max())
    scale = float(ref.abs().max())
    assert err <= rtol * scale, f"{label}: max |diff| {err:.3e} > {rtol:g} x {scale:.3e}"
