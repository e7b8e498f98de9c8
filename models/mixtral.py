"""Mixtral: Llama 3 attention with a sparse mixture of SwiGLU experts in place of the MLP.

Each token goes to its top_k experts by a softmax router; their outputs are summed with the
router weights renormalised over the chosen k. Experts are stacked weights (E, ...) so that
expert parallelism can shard them along E. Plain torch, no distributed import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.llama import LlamaArgs, Transformer, TransformerBlock


@dataclass
class MixtralArgs(LlamaArgs):
    n_routed_experts: int = 8
    top_k: int = 2
    moe_ffn_dim: int = 14336


class MoE(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (T, D), T = B x S tokens
        probs = self.router(flat).float().softmax(-1)  # (T, E)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (T, k)
        weights = (weights / weights.sum(-1, keepdim=True)).type_as(x)
        out = torch.zeros_like(flat)
        for e in range(self.w1.shape[0]):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            h = flat[token]  # (n, D): the tokens routed to expert e
            y = (F.silu(h @ self.w1[e].T) * (h @ self.w3[e].T)) @ self.w2[e].T
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.view(shape)


class Mixtral(Transformer):
    def make_block(self, args: MixtralArgs, index: int) -> nn.Module:
        moe = MoE(args.dim, args.moe_ffn_dim, args.n_routed_experts, args.top_k)
        return TransformerBlock(args, feed_forward=moe)
