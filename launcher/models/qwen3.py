"""Qwen3 (dense): Llama 3's block with an RMSNorm on each head's query and key before RoPE, as
transformers' Qwen3ForCausalLM. Its heads are head_dim wide, not dim / n_heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from launcher.models.layers import RMSNorm
from launcher.models.llama import Attention, LlamaArgs, Transformer, TransformerBlock


@dataclass(kw_only=True)
class Qwen3Args(LlamaArgs):
    """The model config fields this family reads (their defaults: launcher/models/config.py)."""


class QKNormAttention(Attention):
    """Grouped-query attention whose q and k heads are each RMS-normalised (one gain of
    head_dim for all the query heads, one for the key heads)."""

    def __init__(self, args: LlamaArgs):
        super().__init__(args)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().heads(x)
        return self.q_norm(q), self.k_norm(k), v

    def qk_clip_rows(self, gamma: torch.Tensor) -> list:
        # The norms undo any scale of wq and wk (the config rules refuse optimizer.qk_clip).
        raise ValueError("QK-clip cannot scale logits that per-head q and k norms set")


class Qwen3(Transformer):
    def make_block(self, args: Qwen3Args, index: int) -> TransformerBlock:
        return TransformerBlock(args, attention=QKNormAttention(args))
