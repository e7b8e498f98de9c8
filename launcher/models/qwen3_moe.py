"""Qwen3 MoE: Qwen3's attention (a norm on each head's q and k) with routed SwiGLU experts in
every block, as transformers' Qwen3MoeForCausalLM: a softmax router's top_k experts, their
weights renormalised over the chosen ones where norm_topk_prob (the released models do), no
shared expert."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from launcher.models.llama import LlamaArgs, Transformer, TransformerBlock
from launcher.models.mixtral import softmax_experts
from launcher.models.qwen3 import QKNormAttention


@dataclass(kw_only=True)
class Qwen3MoEArgs(LlamaArgs):
    """The model config fields this family reads (their defaults: launcher/models/config.py)."""

    n_routed_experts: int
    top_k: int
    moe_ffn_dim: int
    norm_topk_prob: bool
    aux_loss_coef: float  # the Switch balance loss per forward (transformers' default 0.001)


class Qwen3MoE(Transformer):
    def make_block(self, args: Qwen3MoEArgs, index: int) -> nn.Module:
        experts = softmax_experts(args, normalize=args.norm_topk_prob)
        return TransformerBlock(args, feed_forward=experts, attention=QKNormAttention(args))
