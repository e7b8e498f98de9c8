"""Layers shared by the model families: RoPE tables and rotation, the causal attention core,
RMSNorm and SwiGLU with their memory-lean autograd functions, dropout with a 1-byte mask.

Plain torch, no distributed import. Shapes: B batch, S sequence, D dim, H heads, K kv heads,
E head dim.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

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


# Document masking (data.attention=document): `documents` (B, S) holds the document of every
# token of the whole sequence, counted from the sequence's start; an EOS ends its document, so
# the token after it starts the next. A token attends to the earlier tokens of its own document
# only, and its position (RoPE, learned positions) counts from its document's first token, as
# if each document ran alone. Under context parallelism every rank holds the whole (B, S) ids
# and indexes them by the global positions of its tokens.


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, S) ids -> the document of each token, 0 for the first; an EOS ends its own."""
    eos = tokens == eos_id
    return (eos.cumsum(1) - eos.long()).to(torch.int64)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(B, S): each token's distance from the first token of its document."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(first, index, torch.zeros_like(index)).cummax(1).values


def _at(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """values (B, S) at positions (S',) or (B, S'): (B, S')."""
    if positions.dim() == 1:
        return values[:, positions]
    return values.gather(1, positions)


def token_positions(positions: torch.Tensor | None, documents: torch.Tensor) -> torch.Tensor:
    """The rows of the position table the tokens at `positions` (None: the whole sequence) take
    under document masking: (B, S') positions within their documents."""
    within = document_positions(documents)
    return within if positions is None else _at(within, positions)


def attention_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """Query at position i sees key at position j iff i >= j and, with documents, both lie in
    one document: (Sq, Sk) bool from (Sq,), (Sk,) positions without documents, else
    (B, 1, Sq, Sk), broadcast over heads."""
    order = q_pos[..., :, None] >= k_pos[..., None, :]
    if documents is None:
        return order if order.dim() == 2 else order[:, None]
    same = _at(documents, q_pos)[:, :, None] == _at(documents, k_pos)[:, None, :]
    return (order & same)[:, None]


def additive_mask(positions: torch.Tensor, documents: torch.Tensor, dtype) -> torch.Tensor:
    """attention_mask(positions, positions, documents) as bool, or as the additive 0 / -inf
    float mask in `dtype` that the fused kernels take."""
    mask = attention_mask(positions, positions, documents)
    if dtype == torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


def masked_attention(q, k, v, mask, p: float, fused: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(E) + mask) v, the fused kernel or plain matmuls; mask None: causal."""
    if fused:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None, enable_gqa=True
        )
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, S, S)
    if mask is None:
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if torch.compiler.is_compiling():  # as measured: Inductor fuses it (58.95 GiB, planned 58.15)
        return dropout(scores.softmax(-1), p) @ v
    return dropout(Softmax.apply(scores), p) @ v


class Softmax(torch.autograd.Function):
    """softmax over the last dimension, its probabilities returned and saved in the input's
    dtype (the kernels accumulate in fp32), as Megatron's fused softmax keeps them: 2 bytes a
    score in bf16, where CUDA's autocast runs a plain softmax in fp32 and saves its 4-byte
    output. On an H200, Megatron GPT 1.7B eager (unfused attention) peaked at 70.68 GiB with
    the plain softmax and 62.78 with this function's first form (the planner: 59.71)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        probs = torch._softmax(x, -1, False)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (probs,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, probs, -1, probs.dtype)


def document_attention(q, k, v, positions, documents, p: float, fused: bool) -> torch.Tensor:
    """Attention under document masking that never keeps the (B, 1, S, S) mask for backward
    (at 8K tokens it is 128 MiB per micro-batch in bf16, one per layer as SDPA saves it): the
    mask is rebuilt from the (B, S) ids there. On CPU the fused kernel's own backward takes
    it (_FlashDocuments); elsewhere, with dropout, or with values narrower than keys (MLA),
    backward reruns the attention forward (_RerunDocuments)."""
    if fused and p == 0 and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]:
        return _FlashDocuments.apply(q, k, v, positions, documents)
    return _RerunDocuments.apply(q, k, v, positions, documents, p, fused)


class _FlashDocuments(torch.autograd.Function):
    """torch's fused flash attention for CPU with the document mask; saves what the kernel's
    backward needs (q, k, v, output, log-sum-exp) and the ids, not the mask."""

    @staticmethod
    def forward(ctx, q, k, v, positions, documents):
        mask = additive_mask(positions, documents, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask
        )
        ctx.save_for_backward(q, k, v, out, lse, positions, documents)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, positions, documents = ctx.saved_tensors
        mask = additive_mask(positions, documents, q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=mask
        )
        return dq, dk, dv, None, None


class _RerunDocuments(torch.autograd.Function):
    """Document-masked attention whose backward reruns its forward (under the same random
    state, for dropout) from q, k, v and the ids: one attention forward more per layer."""

    @staticmethod
    def forward(ctx, q, k, v, positions, documents, p, fused):
        ctx.p, ctx.fused = p, fused
        ctx.rng = (torch.get_rng_state(), _device_rng(q.device)) if p > 0 else None
        ctx.save_for_backward(q, k, v, positions, documents)
        mask = additive_mask(positions, documents, q.dtype if fused else torch.bool)
        return masked_attention(q, k, v, mask, p, fused)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, positions, documents = ctx.saved_tensors
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        devices = [q.device] if q.device.type == "cuda" else []
        with torch.enable_grad(), torch.random.fork_rng(devices=devices):
            if ctx.rng is not None:
                torch.set_rng_state(ctx.rng[0])
                if ctx.rng[1] is not None:
                    torch.cuda.set_rng_state(ctx.rng[1], q.device)
            mask = additive_mask(positions, documents, q.dtype if ctx.fused else torch.bool)
            out = masked_attention(*leaves, mask, ctx.p, ctx.fused)
            grads = torch.autograd.grad(out, leaves, grad)
        return (*grads, None, None, None, None)


def _device_rng(device: torch.device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None


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


# Scores of one chunk of query rows at a time when the largest logits are taken: at most this
# many (fp32) in flight, whatever the sequence.
MAX_LOGIT_CHUNK = 1 << 24


@torch.no_grad()
def max_logits(q, k, q_pos, k_pos, documents=None) -> torch.Tensor:
    """(H,): each query head's largest q k^T / sqrt(E) over the pairs attention lets meet
    (query position >= key position, one document with `documents`), in fp32. q (B, H, Sq, E),
    k (B, K, Sk, E) with K <= H (query head h reads key head h // (H / K), as the cores
    do); positions (Sq,), (Sk,) or (B, S). QK-clip's S_max (Kimi K2), which the fused cores
    never form."""
    b, h, sq, e = q.shape
    kh, sk = k.shape[1], k.shape[2]
    grouped = q.reshape(b, kh, h // kh, sq, e)
    keys = k.float().unsqueeze(2).transpose(-2, -1) / math.sqrt(e)  # (B, K, 1, E, Sk)
    out = torch.full((kh, h // kh), float("-inf"), device=q.device)
    rows = max(1, MAX_LOGIT_CHUNK // max(1, b * h * sk))
    for start in range(0, sq, rows):
        scores = grouped[..., start : start + rows, :].float() @ keys  # (B, K, G, rows, Sk)
        mask = attention_mask(q_pos[..., start : start + rows], k_pos, documents)
        scores.masked_fill_(~(mask if mask.dim() == 2 else mask.unsqueeze(1)), float("-inf"))
        out = torch.maximum(out, scores.amax(dim=(0, 3, 4)))
    return out.reshape(h)


class LogitRecord:
    """QK-clip's record of a core's largest logits per head over a step's training forwards
    (the optimizer step reads and resets it: launcher/training/qk_clip.py); off (None) unless
    the run clips."""

    max_logit: torch.Tensor | None = None
    track_logits: bool = False
    # True while a core computes its record (class-wide: one forward runs at a time): per-op
    # recompute keeps none of that pass's tensors (its score chunks) and reruns it in backward,
    # as selective does (launcher/parallel/recompute.py).
    computing = False

    @property
    def recording(self) -> bool:
        """Whether this forward counts: a training one (not evaluation, not generation)."""
        return self.track_logits and self.training and torch.is_grad_enabled()

    @contextmanager
    def recorder(self):
        """The span of a record: its inputs' gathering (context parallelism) and the pass."""
        LogitRecord.computing = True
        try:
            yield self.record_logits
        finally:
            LogitRecord.computing = False

    def record_logits(self, q, k, q_pos, k_pos, documents) -> None:
        m = max_logits(q, k, q_pos, k_pos, documents)
        # torch.maximum on the first record too: a per-op recompute's replay runs the operators
        # of the forward it replays, one by one, and the record is set by then.
        before = m if self.max_logit is None else self.max_logit
        self.max_logit = torch.maximum(before, m)


def query_key_rows(wq: nn.Linear, wk: nn.Linear, head_dim: int, gamma: torch.Tensor) -> list:
    """QK-clip of grouped-query attention: the rows of wq and wk (and their biases) scaled so
    that each query head h's logits are scaled by gamma[h] (Kimi K2's per-head clip). Key head
    g is shared by its group's query heads: it takes sqrt(min of their gammas), and each query
    head gamma[h] / that; with one key head per query head (MHA) both take sqrt(gamma[h]), as
    the report writes it."""
    heads, kv = gamma.numel(), wk.weight.shape[0] // head_dim
    group = gamma.reshape(kv, heads // kv)
    key = group.amin(1).sqrt()
    query = (group / key[:, None]).reshape(heads)
    rows = []
    for linear, factor in ((wq, query), (wk, key)):
        per_row = factor.repeat_interleave(head_dim)
        rows += [(p, per_row) for p in (linear.weight, linear.bias) if p is not None]
    return rows


class AttentionCore(LogitRecord, nn.Module):
    """Causal softmax(q k^T / sqrt(E)) v over (B, H, S, E), k and v with K <= H heads (GQA).

    `positions` (S,) or (B, S) are the tokens' positions in their sequence; None means
    0..S-1 (the causal triangle). `documents` (B, S) of the whole sequence: document masking.
    A module of its own so that selective activation checkpointing can wrap exactly this (the
    work between the projections, whose internals, score matrices when not fused, are cheap to
    recompute from q, k and v) and so that context parallelism can put its own in its place.
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
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        pos = positions
        if pos is None and (self.recording or documents is not None):
            pos = torch.arange(q.shape[2], device=q.device)
        if self.recording:
            with self.recorder() as record:
                record(q, k, pos, pos, documents)
        if documents is not None:  # (B, S) of the whole sequence: document masking
            return document_attention(q, k, v, pos, documents, p, self.fused)
        mask = None if positions is None else causal_mask(positions)
        return masked_attention(q, k, v, mask, p, self.fused)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))


# A target the loss skips (cross-entropy's ignore_index); data.batches.IGNORE, the same value,
# marks a chat set's prompts and padding.
IGNORE = -100


def future_tokens(targets: torch.Tensor, depth: int) -> torch.Tensor:
    """(B, S, depth + 1) of targets (B, S): column k holds the token k + 1 ahead of each
    position (column 0 is `targets`, the next token), IGNORE where the sequence has none:
    what multi-token prediction's depths embed and predict."""
    s = targets.shape[1]
    out = targets.new_full((*targets.shape, depth + 1), IGNORE)
    for k in range(depth + 1):
        out[:, : s - k, k] = targets[:, k:]
    return out


class BlockStack:
    """What the engine asks of a model whose blocks are `layers` (an nn.ModuleDict by index)
    between its input (the attribute INPUT) and its head (`norm`, `output`), any of which a
    pipeline stage may hold as None."""

    INPUT = "tok_embeddings"

    def blocks(self) -> list[tuple[int, nn.Module]]:
        """(index, block) of every block this model (or stage) holds, those after the output
        head's too (deepseek's prediction depths, numbered after the layers)."""
        return [(int(i), block) for i, block in self.layers.items()]

    def set_block(self, index: int, block: nn.Module) -> None:
        """Put `block` in place of block `index` (an engine's wrapper of it)."""
        self.layers[str(index)] = block

    def as_stage(self, first: bool, last: bool) -> None:
        """Keep, besides its layers, what a pipeline stage holds: the input on the first stage,
        the final norm and the output head on the last."""
        if not first:
            setattr(self, self.INPUT, None)
        if not last:
            self.norm, self.output = None, None

    def pipeline_tied(self) -> tuple[str, str] | None:
        """(its name on the first stage, on the last) of a matrix both ends of a pipeline hold,
        or None: the token table and a tied output projection."""
        output = getattr(self, "output", None)
        if output is None:
            return None
        named = self.named_parameters(remove_duplicate=False)
        names = [n for n, p in named if p is output.weight]
        return (names[0], names[-1]) if len(names) > 1 else None
