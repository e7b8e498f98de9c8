"""Megatron-style GPT: learned positions, pre-LayerNorm blocks, GeLU MLP of ffn_dim (4h), dropout,
biases on every projection, output projection optionally tied to the token embedding.

Plain torch, no distributed import; layers in an nn.ModuleDict, and embed / norm / output may be
None on a pipeline stage that does not own them. Shapes: B batch, S sequence, D dim, H heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from launcher.models.init import ONES, ZEROS, Rule, init_whole, normal
from launcher.models.layers import (
    AttentionCore,
    BlockStack,
    dropout,
    query_key_rows,
    token_positions,
)


@dataclass(kw_only=True)
class GPTArgs:
    """The model config fields this family reads (their defaults: launcher/models/config.py)."""

    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    norm_eps: float
    dropout: float
    flash_attention: bool
    tie_embeddings: bool


class Embedding(nn.Module):
    """Token plus learned position embeddings, then dropout: (B, S) -> (B, S, D)."""

    def __init__(self, args: GPTArgs):
        super().__init__()
        self.tok = nn.Embedding(args.vocab_size, args.dim)
        self.pos = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = args.dropout

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """positions (S,) or (B, S); None means 0..S-1. documents (B, S): positions count from
        each document's first token."""
        if documents is not None:
            positions = token_positions(positions, documents)
        elif positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok(tokens) + self.pos(positions)
        return dropout(h, self.dropout if self.training else 0.0)


class Attention(nn.Module):
    def __init__(self, args: GPTArgs):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim)
        self.wk = nn.Linear(args.dim, args.dim)
        self.wv = nn.Linear(args.dim, args.dim)
        self.wo = nn.Linear(args.dim, args.dim)
        self.core = AttentionCore(args.dropout, args.flash_attention)

    def qk_clip_rows(self, gamma: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """QK-clip: (parameter, a factor per row) that scale each head's logits by gamma (H,)."""
        return query_key_rows(self.wq, self.wk, self.head_dim, gamma)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of them.
        q, k, v = (
            w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )  # (B, H, S, E)
        out = self.core(q, k, v, positions, documents)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # (B, S, D)


class MLP(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, args: GPTArgs):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = MLP(args.dim, args.ffn_dim)
        self.dropout = args.dropout

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        drop = self.dropout if self.training else 0.0
        x = x + dropout(self.attention(self.attention_norm(x), positions, documents), drop)
        return x + dropout(self.feed_forward(self.ffn_norm(x)), drop)


class GPT(BlockStack, nn.Module):
    """Token ids (B, S) -> logits (B, S, V), or hidden states on a stage without the head."""

    INPUT = "embed"

    def __init__(self, args: GPTArgs):
        super().__init__()
        self.args = args
        self.embed: Embedding | None = Embedding(args)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the output projection with the token embedding (when both live here)."""
        if self.args.tie_embeddings and self.embed is not None and self.output is not None:
            self.output.weight = self.embed.tok.weight

    def init_rule(self, name: str) -> Rule:
        """Normal(0.02) weights, zero biases, unit LayerNorm gains; the residual branches'
        output projections (wo, fc2) at GPT-2's depth-scaled std."""
        if "norm" in name:
            return ONES if name.endswith("weight") else ZEROS
        if name.endswith("bias"):
            return ZEROS
        out = name.endswith(("wo.weight", "fc2.weight"))
        return normal(0.02 / math.sqrt(2 * self.args.n_layers) if out else 0.02)

    def init_buffers(self) -> None:
        """No buffers to derive."""

    def init_weights(self, seed: int = 0) -> None:
        """Initialise this whole model in place (launcher/models/init.py)."""
        init_whole(self, seed, self.init_rule)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, S) ids, or hidden states (B, S, D) on a later pipeline stage; positions
        (S,) or (B, S) of the tokens in their sequence, None meaning 0..S-1; documents (B, S)
        of the whole sequence: document masking (models.layers)."""
        h = self.embed(tokens, positions, documents) if self.embed is not None else tokens
        for layer in self.layers.values():
            h = layer(h, positions, documents)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
