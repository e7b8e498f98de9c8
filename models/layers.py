"""Layers shared by the model families: RoPE tables and rotation, the causal attention core,
RMSNorm and SwiGLU with their memory-lean autograd functions, dropout with a 1-byte mask.

Plain torch, no distributed import. Shapes: B batch, S sequence, D dim, H heads, K kv heads,
E head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rope_table(inv_freq: torch.Tensor, seq_len: int, scale: float = 1.0) -> torch.Tensor:
    """(S, 2, E) for positions 0..seq_len-1 and inverse frequencies (E/2,): row 0 the cosine
    of each pair's angle at both of its places, row 1 its sine with the sign of the rotation,
    (-sin, sin) per pair; both times `scale` (YaRN's attention factor, else 1)."""
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos() * scale, angles.sin() * scale  # (S, E/2)
    signed = torch.stack([-sin, sin], dim=-1).flatten(-2)  # (S, E)
    return torch.stack([cos.repeat_interleave(2, dim=-1), signed], dim=-2)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (B, S, H, E) by the angles in rope: (S, 2, E), shared
    by the batch, or (B, S, 2, E), one row of positions per sequence.

    (re, im) -> (re cos - im sin, im cos + re sin), written as x cos + swap(x) sin with the
    pairs swapped and the sine signed: two contiguous products instead of four on strided
    halves, bitwise the same result and about half the time on CPU, forward and backward.
    """
    x32 = x.float()
    cos, sin = rope.unsqueeze(-3).unbind(-2)  # (S, 1, E) or (B, S, 1, E): broadcast over heads
    swapped = x32.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (im, re) per pair
    return (x32 * cos + swapped * sin).type_as(x)


def causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """Query i sees key j iff position i >= position j: (S, S) from (S,) positions, or
    (B, 1, S, S) from (B, S), broadcast over heads."""
    mask = positions[..., :, None] >= positions[..., None, :]
    return mask if positions.dim() == 1 else mask[:, None]


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Training dropout keeping a 1-byte mask for backward on every device (F.dropout keeps a
    mask in x's dtype on CPU: 4 bytes per element in fp32, as much as the activation)."""
    return torch.native_dropout(x, p, True)[0] if p > 0 else x


def _at_least_fp32(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


class _RMSNormFunction(torch.autograd.Function):
    """x / rms(x) * weight, keeping only x and 1/rms(x) for backward.

    Written as one autograd function so that backward recomputes x / rms(x) instead of keeping
    it: the element-wise version keeps a third (B, S, D) tensor per norm.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(_at_least_fp32(x))
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, r)
        return (x32 * r).type_as(x) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        n = x.to(r.dtype) * r  # x / rms(x)
        g = grad.to(r.dtype)
        grad_weight = (g * n).sum(dim=tuple(range(g.ndim - 1)))
        gn = g * weight.to(r.dtype)
        grad_x = r * (gn - n * (gn * n).mean(-1, keepdim=True))
        return grad_x.type_as(x), grad_weight.type_as(weight), None


class _SwiGLUFunction(torch.autograd.Function):
    """silu(a) * b, keeping only a and b (the gate and up projections' outputs) for backward.

    Element-wise, autograd would also keep silu(a), a third ffn-wide tensor; backward recomputes
    it instead (as Megatron's fused SwiGLU does). Gradients as autograd's, bitwise.
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * b, a), grad * F.silu(a)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b, saving a and b only (see _SwiGLUFunction)."""
    return _SwiGLUFunction.apply(a, b)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class AttentionCore(nn.Module):
    """Causal softmax(q k^T / sqrt(E)) v over (B, H, S, E), k and v with K <= H heads (GQA).

    `positions` (S,) or (B, S) are the tokens' positions in their sequence; None means
    0..S-1 (the causal triangle). A module of its own so that selective activation
    checkpointing can wrap exactly this (the work between the projections, whose internals,
    score matrices when not fused, are cheap to recompute from q, k and v) and so that context
    parallelism can put its own in its place.
    """

    def __init__(self, dropout: float, fused: bool):
        super().__init__()
        self.dropout, self.fused = dropout, fused

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        mask = None if positions is None else causal_mask(positions)
        if self.fused:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None, enable_gqa=True
            )
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        s = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, S, S)
        if mask is None:
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return dropout(probs, p) @ v


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))
