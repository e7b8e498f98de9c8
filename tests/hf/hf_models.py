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
RUN = {"llama": LLAMA_RUN, "mixtral": MIXTRAL_RUN}


def build(family: str, seed: int = 0, **changes):
    """A randomly initialised transformers model of the family (fp32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, **changes}))
    else:
        model = MixtralForCausalLM(MixtralConfig(**{**MIXTRAL, **changes}))
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
