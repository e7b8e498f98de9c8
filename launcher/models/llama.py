"""Llama 3 family: GQA attention, RoPE with "llama3" frequency scaling, SwiGLU MLP, RMSNorm.

Plain torch, no distributed import. Layers live in an nn.ModuleDict keyed by index and
tok_embeddings / norm / output may be None, so a pipeline stage can own a slice of the model.
Shapes: B batch, S sequence, D dim, H heads, K kv heads, E head dim, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from launcher.models.init import ONES, Rule, init_whole, normal
from launcher.models.layers import (
    AttentionCore,
    BlockStack,
    FeedForward,
    RMSNorm,
    apply_rope,
    dropout,
    query_key_rows,
    rope_table,
    token_positions,
)


@dataclass(kw_only=True)
class LlamaArgs:
    """The model config fields this family reads (their defaults: launcher/models/config.py)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int | None
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float
    rope_scaling_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max_seq_len: int
    norm_eps: float
    dropout: float
    flash_attention: bool
    tie_embeddings: bool  # output projection shares the embedding (Llama 3.2 1B, 3B)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads


def rope_frequencies(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies (E/2,), with Llama 3's smooth scaling of the low frequencies."""
    e = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, e, 2, dtype=torch.float64) / e))
    if args.rope_scaling_factor == 1.0:
        return inv_freq.float()
    factor, lo, hi = args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    old_len = args.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are divided by `factor`, short ones kept, and the
    # band between low_freq_wavelen and high_freq_wavelen interpolates smoothly.
    smooth = (old_len / wavelen - lo) / (hi - lo)
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(mid, blended, scaled).float()


def rope_cache(args: LlamaArgs, seq_len: int) -> torch.Tensor:
    """(S, 2, E) for positions 0..seq_len-1 (see rope_table)."""
    return rope_table(rope_frequencies(args), seq_len)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, qkv_bias: bool = False):
        """qkv_bias: biases on the query, key and value projections (Qwen2's)."""
        super().__init__()
        self.head_dim = args.head_dim
        self.core = AttentionCore(args.dropout, args.flash_attention)
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, S, H, E), k and v (B, S, K, E) of x (B, S, D), before RoPE; families that
        change them there (Qwen3's norms) override this."""
        b, s, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        return q, k, v

    def qk_clip_rows(self, gamma: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """QK-clip: (parameter, a factor per row) that scale each head's logits by gamma (H,)."""
        return query_key_rows(self.wq, self.wk, self.head_dim, gamma)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, S, D). Without positions or documents, rope is the whole table and the tokens
        sit at 0..S-1; else rope holds exactly their angles (S or B, S, 2, E)."""
        b, s, _ = x.shape
        q, k, v = self.heads(x)
        angles = rope[:s] if positions is None and documents is None else rope
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.core(q, k, v, positions, documents)  # (B, H, S, E)
        # SDPA lays its output out as (B, S, H, E): the reshape is a view, not a copy.
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # (B, S, D)


class TransformerBlock(nn.Module):
    def __init__(
        self,
        args: LlamaArgs,
        feed_forward: nn.Module | None = None,
        attention: nn.Module | None = None,
    ):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = attention or Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward or FeedForward(args.dim, args.ffn_dim)
        self.dropout = args.dropout

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        drop = self.dropout if self.training else 0.0
        h = self.attention(self.attention_norm(x), rope, positions, documents)
        x = x + dropout(h, drop)
        return x + dropout(self.feed_forward(self.ffn_norm(x)), drop)


class Transformer(BlockStack, nn.Module):
    """Token ids (B, S) -> logits (B, S, V), or hidden states on a stage without the head."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): self.make_block(args, i) for i in range(args.n_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Not persistent: derived from args, rebuilt after meta-device init by init_buffers().
        self.register_buffer("rope", self.make_rope(), persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the output projection with the token embedding (when both live here)."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def make_block(self, args: LlamaArgs, index: int) -> nn.Module:
        """Block `index`; families that differ only in their blocks override this."""
        return TransformerBlock(args)

    def make_rope(self) -> torch.Tensor:
        """The RoPE table of positions 0..max_seq_len-1 that attention looks angles up in;
        families with another RoPE (width, frequencies) override this."""
        return rope_cache(self.args, self.args.max_seq_len)

    def init_rule(self, name: str) -> Rule:
        """How parameter `name` starts: normal(0.02), the output projections of each residual
        branch (wo, w2, stacked experts' w2) at GPT-2's depth-scaled std, norm gains at 1."""
        if name.endswith("norm.weight"):
            return ONES
        out = name.removesuffix(".weight").endswith(("wo", "w2"))
        return normal(0.02 / math.sqrt(2 * self.args.n_layers) if out else 0.02)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The buffers, where they live (also after building on the meta device): the RoPE
        table rebuilt from args, and each layer's own (MoE routers unbiased, no load)."""
        self.rope = self.make_rope().to(self.rope.device, self.rope.dtype)
        for module in self.modules():
            if module is not self and hasattr(module, "init_buffers"):
                module.init_buffers()

    def init_weights(self, seed: int = 0) -> None:
        """Initialise this whole model in place (launcher/models/init.py: the values any layout's
        shards of it get from the same seed)."""
        init_whole(self, seed, self.init_rule)
        self.init_buffers()

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, S) ids, or hidden states (B, S, D) on a later pipeline stage. positions
        (S,) or (B, S): each token's position in its sequence (a context-parallel rank holds
        tokens from several places); None means 0..S-1. documents (B, S) of the whole
        sequence: document masking (models.layers)."""
        h, _ = self.features(tokens, positions, documents)
        return self.output(h) if self.output is not None else h

    def features(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden states the output head reads, normed where this stage holds the final
        norm; the RoPE angles the blocks used), as forward takes its arguments."""
        embeds = self.tok_embeddings is not None and not tokens.is_floating_point()
        h = self.tok_embeddings(tokens) if embeds else tokens
        # Without positions the whole table: under sequence parallelism h holds a slice of the
        # sequence here, and attention, which sees all of it, takes the first S rows itself.
        # With them, their angles, looked up once for every layer.
        if documents is not None:
            rope = self.rope[token_positions(positions, documents)]
        else:
            rope = self.rope if positions is None else self.rope[positions]
        for layer in self.layers.values():
            h = layer(h, rope, positions, documents)
        return (self.norm(h) if self.norm is not None else h), rope
