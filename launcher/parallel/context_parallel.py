"""Context parallelism: causal attention over a sequence split across the `cp` ranks of a group.

Every rank holds S_local = S / cp tokens of each sequence, at explicit global positions
(`chunk_positions`), and computes attention for its own queries against the keys of every rank,
by one of two methods (`context_attention`):

- allgather (Llama 3's): all-gather K and V once, attend the local queries to every rank's
  block (the same per-block kernels and log-sum-exp merge as the ring, no mask tensor, masked
  blocks skipped); the backward pass reduce-scatters dK and dV.
- ring: K/V blocks travel around the ring (rank r sends to r+1, receives from r-1) while each rank
  attends its queries to the block it holds; the partial outputs are merged by their
  log-sum-exp, and the backward pass runs the ring again. At most two remote blocks are held
  (the one computed, the next arriving), and blocks (or parts of blocks) that causality masks
  out entirely are not computed.

Attention dropout drops each computed block's probabilities with a keep-mask drawn from a
generator of its own, seeded by one number the call draws from the global generator (so that a
recomputed forward, which restores that generator, draws the same) and by the block's (query
rank, key rank); backward draws the same masks again instead of keeping them. The log-sum-exp
the blocks merge by is the undropped one, as in flash attention.

Both run on any backend with P2P and all-gather / reduce-scatter (gloo on CPU, NCCL on GPU);
torch's own experimental context_parallel supports only the CUDA attention kernels.
Shapes: B batch, H query heads, K kv heads (K divides H; G = H / K), S_local tokens, E the
query and key head dim, V the value head dim (E under GQA and MHA; MLA's values are narrower).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from launcher.models.layers import LogitRecord, attention_mask

METHODS = ("allgather", "ring")


def chunk_positions(seq_len: int, cp: int, rank: int, load_balance: bool) -> torch.Tensor:
    """The global token positions (ascending, LongTensor (seq_len / cp,)) that `rank` holds.

    load_balance: the sequence is cut into 2*cp equal chunks and rank r holds chunks r and
    2cp-1-r. Under a causal mask the tokens late in the sequence attend to more keys; pairing an
    early chunk with a late one gives every rank the same attention work. Otherwise rank r
    holds the r-th contiguous 1/cp of the sequence (rank cp-1 then does ~2x the average work).
    """
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} must be in [0, cp={cp})")
    if load_balance:
        if seq_len % (2 * cp):
            raise ValueError(
                f"seq_len={seq_len} must be divisible by 2*cp={2 * cp} under load balancing "
                f"(rank r holds chunks r and 2cp-1-r of 2cp equal chunks)"
            )
        c = seq_len // (2 * cp)
        late = 2 * cp - 1 - rank
        return torch.cat(
            [torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)]
        )
    if seq_len % cp:
        raise ValueError(
            f"seq_len={seq_len} must be divisible by cp={cp} (each rank holds a contiguous 1/cp)"
        )
    n = seq_len // cp
    return torch.arange(rank * n, (rank + 1) * n)


def shard_sequence(
    x: torch.Tensor, cp: int, rank: int, load_balance: bool, dim: int = 1
) -> torch.Tensor:
    """The part of `x` that `rank` holds: its `chunk_positions` along `dim` (a copy)."""
    pos = chunk_positions(x.shape[dim], cp, rank, load_balance)
    return x.index_select(dim, pos.to(x.device))


class ContextAttention(LogitRecord, nn.Module):
    """The attention core of a block under context parallelism: the same (q, k, v, positions)
    call as the model's own core (models.layers.AttentionCore), attending over every cp rank.

    q, k, v belong to this rank's tokens, so the query and key positions are the same;
    `positions` (S_local,) or (B, S_local), every row the same (chunk_positions of this rank).
    """

    def __init__(self, group: dist.ProcessGroup, method: str, dropout: float = 0.0):
        super().__init__()
        self.group, self.method, self.dropout = group, method, dropout

    def forward(self, q, k, v, positions: torch.Tensor | None = None, documents=None):
        if positions is None:
            raise ValueError(
                "context-parallel attention needs the positions of this rank's tokens "
                "(the model's forward(tokens, positions))"
            )
        pos = positions if positions.dim() == 1 else positions[0]
        p = self.dropout if self.training else 0.0
        if self.recording:
            with self.recorder() as record:
                keys, k_pos = gather_keys(k, pos, self.group)
                record(q, keys, pos, k_pos, documents)
        return context_attention(
            q, k, v, pos, self.group, self.method, dropout=p, documents=documents
        )

    def extra_repr(self) -> str:
        return f"method={self.method}, cp={dist.get_world_size(self.group)}, dropout={self.dropout}"


@torch.no_grad()
def gather_keys(k: torch.Tensor, pos: torch.Tensor, group) -> tuple:
    """(every rank's keys (B, K, S, E), their positions (S,)): what QK-clip's largest logits
    of this rank's queries are taken over."""
    keys = _all_gather(k, group)  # (cp, B, K, S_local, E)
    b, kh, e = k.shape[0], k.shape[1], k.shape[-1]
    return keys.permute(1, 2, 0, 3, 4).reshape(b, kh, -1, e), _gather_positions(pos, group).reshape(
        -1
    )


def apply_cp(model: nn.Module, group: dist.ProcessGroup, method: str) -> None:
    """Put the context-parallel core in every block's attention, in place.

    Everything else in a block is token-wise (projections, RoPE at each token's own position,
    norms, MLP, experts) and runs unchanged on this rank's tokens; attention is the one place
    where tokens meet (MLA's too: its latent projections and RoPE are per token). The core
    keeps the model's attention dropout.
    """
    for _, block in model.blocks():
        block.attention.core = ContextAttention(group, method, block.attention.core.dropout)


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    group: dist.ProcessGroup,
    method: str,
    dropout: float = 0.0,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(E)) v over the keys of every rank in `group`.

    q (B, H, S_local, E); k (B, K, S_local, E), v (B, K, S_local, V) with K dividing H (GQA:
    query head h reads kv head h // (H / K), as repeat_interleave does); positions (S_local,)
    the global positions of this rank's tokens (its queries and keys), ascending, on q's
    device. Query i sees key j iff its position >= position of j. Returns (B, H, S_local, V) in q's
    dtype (fp32 or bf16: blocks in the fused kernel compute in it, the matmul form in fp32; the
    partial outputs merge in fp32).
    Every rank of `group` must call it with the same shapes. `dropout`: the probability of
    dropping each attention probability (training), in [0, 1). `documents` (B, S) of the whole
    sequence, the same on every rank: document masking (models.layers.attention_mask); a
    block no query of which sees a key of is skipped, like one causality skips.
    """
    problems = []
    if method not in METHODS:
        problems.append(f"context method={method!r} must be one of {', '.join(METHODS)}")
    if not 0 <= dropout < 1:
        problems.append(f"attention dropout={dropout} must be in [0, 1)")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:-1] != v.shape[:-1]:
        problems.append(
            f"q {tuple(q.shape)} must be (B, H, S, E), k {tuple(k.shape)} (B, K, S, E) and "
            f"v {tuple(v.shape)} (B, K, S, V)"
        )
    elif q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        problems.append(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must share B and E, and kv heads "
            f"K={k.shape[1]} must divide query heads H={q.shape[1]}"
        )
    elif positions.shape != (q.shape[2],) or k.shape[2] != q.shape[2]:
        problems.append(
            f"positions {tuple(positions.shape)} must hold one position per token: queries "
            f"({q.shape[2]}) and keys ({k.shape[2]}) alike"
        )
    if problems:
        raise ValueError("; ".join(problems))
    # One draw from the global generator per call (none without dropout).
    drop = (dropout, int(torch.randint(2**62, ()))) if dropout else None
    fn = _AllGatherAttention if method == "allgather" else _RingAttention
    return fn.apply(q, k, v, positions, positions, group, drop, documents)


# --- blocks: one rank's queries against one rank's keys, shared by both methods -------------


def _block_bounds(q_pos: torch.Tensor, k_pos_all: torch.Tensor) -> list[tuple[int, int, bool]]:
    """For the key block of each rank j: (first query row that sees any of its keys, number of
    leading keys that some query sees, whether that sub-block still needs a mask).

    Positions ascend, so the queries that see a block form a suffix of the rows and the keys
    that are seen a prefix of the columns: the ring computes only that sub-block. An empty one
    (no row, or no key) is a block skipped entirely; under load balancing every off-diagonal
    block shrinks to exactly half, unmasked. One host transfer per call (a sync on GPU).
    """
    cp, s_q = k_pos_all.shape[0], q_pos.numel()
    first_row = torch.searchsorted(q_pos, k_pos_all[:, :1].contiguous()).flatten()  # (cp,)
    last_query = q_pos[-1:].expand(cp, 1).contiguous()
    n_keys = torch.searchsorted(k_pos_all, last_query, right=True).flatten()
    last_key = k_pos_all.gather(1, (n_keys - 1).clamp(min=0)[:, None]).flatten()
    needs_mask = last_key > q_pos[first_row.clamp(max=s_q - 1)]
    ascending = (q_pos[1:] > q_pos[:-1]).all() & (k_pos_all[:, 1:] > k_pos_all[:, :-1]).all()
    rows, keys, masks, ok = torch.stack(
        [first_row, n_keys, needs_mask.long(), ascending.long().expand(cp)]
    ).tolist()
    if not ok[0]:
        raise ValueError(
            "ring attention needs ascending q_pos and k_pos (chunk_positions gives them)"
        )
    return list(zip(rows, keys, map(bool, masks), strict=True))


def dropout_scale(drop, shape, device, block: int) -> torch.Tensor | None:
    """The keep-mask of one computed block under attention dropout `drop` = (p, seed), scaled
    by 1 / (1 - p): fp32 of `shape` (B, H, Sq, Sk), from a generator seeded by the call's seed
    and `block` (query rank x cp + key rank), so that backward draws the same; None without
    dropout."""
    if drop is None:
        return None
    p, seed = drop
    gen = torch.Generator(device=device).manual_seed((seed + 7919 * (block + 1)) % 2**63)
    keep = torch.rand(shape, generator=gen, device=device) >= p
    return keep.float() / (1 - p)


def _attend_block(q, k, v, mask, scale=None):
    """One block by plain matmuls, fp32. q (B, K, G, Sq, E) already scaled by 1/sqrt(E);
    k (B, K, 1, Sk, E), v (B, K, 1, Sk, V); mask (Sq, Sk) bool or None; scale (B, K, G, Sq,
    Sk) the dropout's scaled keep-mask or None. Returns the block's normalised output (B, K,
    G, Sq, V) and its undropped log-sum-exp (B, K, G, Sq). Every row sees at least the block's
    first key (see _block_bounds), so the log-sum-exp is finite, except under document masking.
    Holds the (Sq, Sk) scores."""
    s = q @ k.transpose(-2, -1)  # (B, K, G, Sq, Sk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = s.logsumexp(-1)
    # A row that sees no key here (a later document's query, document masking) has lse -inf:
    # its probabilities are 0, and _merge gives the block no weight for it.
    p = (s - lse.clamp(min=torch.finfo(s.dtype).min)[..., None]).exp()
    return (p if scale is None else p * scale) @ v, lse


def _attend_block_backward(q, k, v, mask, do, lse, delta, scale=None):
    """Gradients of one block from recomputed probabilities (flash attention's backward):
    P = exp(q k^T - lse), dS = P * (dO v^T * Z - delta), with Z the dropout's scaled keep-mask
    (1 without). delta = rowsum(dO * O) of the (dropped) output holds with dropout too. q
    (B, K, G, Sq, E), do (B, K, G, Sq, V); lse, delta (B, K, G, Sq). Returns dq w.r.t. the
    scaled q (B, K, G, Sq, E), dk (B, K, Sk, E) and dv (B, K, Sk, V), summed over the G query
    heads that share each kv head."""
    p = (q @ k.transpose(-2, -1) - lse[..., None]).exp()  # (B, K, G, Sq, Sk)
    if mask is not None:
        p = p.masked_fill(~mask, 0.0)
    dp = do @ v.transpose(-2, -1)
    dropped = p
    if scale is not None:
        dp, dropped = dp * scale, p * scale
    ds = p * (dp - delta[..., None])
    # The G heads and Sq rows fold into one contraction: (B, K, Sk, G*Sq) @ (B, K, G*Sq, V).
    dv = dropped.flatten(2, 3).transpose(-2, -1) @ do.flatten(2, 3)
    dk = ds.flatten(2, 3).transpose(-2, -1) @ q.flatten(2, 3)
    return ds @ k, dk, dv


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, S, ...) -> (B, K, G, S, ...) in fp32: query head h shares kv head h // G."""
    return x.float().unflatten(1, (kv_heads, -1))


def _fused(q: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, own: bool) -> bool:
    """Whether a block runs in torch's fused flash kernel (CPU's, or CUDA's in bf16 / fp16 with
    a head size that kernel takes): both return the log-sum-exp the merge needs, but take no
    mask, only the top-left causal one, which is exactly this rank's own block (same ascending
    positions on both sides), and one head size for q, k and v (not MLA's). With positions
    from chunk_positions every other block is unmasked. Elsewhere the matmul form runs."""
    if q.shape[-1] != v.shape[-1] or not (mask is None or (own and mask.dim() == 2)):
        return False
    if q.device.type == "cuda":
        e = q.shape[-1]
        return q.dtype in (torch.bfloat16, torch.float16) and e % 8 == 0 and e <= 256
    return q.device.type == "cpu"


def _kv_per_head(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """k or v (B, K, S, E) repeated to q's H heads (query head h reads kv head h // G), for
    CUDA's flash kernel, given GQA as separate heads (their gradients are summed back)."""
    return t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) if t.shape[1] != q.shape[1] else t


def _kv_grad(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A per-query-head gradient (B, H, S, E) summed over each kv head's G query heads, fp32."""
    return grad.float().unflatten(1, (kv_heads, -1)).sum(2)


class Masking(NamedTuple):
    """How one block is masked: the causal or document mask ((Sq, Sk), (B, 1, 1, Sq, Sk) under
    document masking, or None), whether the block holds this rank's own keys, and
    dropout_scale's mask (B, H, Sq, Sk) or None."""

    mask: torch.Tensor | None
    own: bool
    scale: torch.Tensor | None = None


class Pair(NamedTuple):
    """This rank's queries against one rank's block of keys: their positions (the queries' and
    the block's), the part of the pair to compute (_block_bounds), whether the keys are this
    rank's own, attention dropout ((p, seed) or None), the pair's index (query rank x cp + key
    rank: its dropout stream) and the documents (or None)."""

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    bound: tuple
    own: bool
    drop: tuple | None
    index: int
    docs: torch.Tensor | None


def _block_forward(q, k, v, masking: Masking):
    """Attention of queries q (B, H, Sq, E) to one block k (B, K, Sk, E), v (B, K, Sk, V) under
    `masking`. Returns the block's output (B, H, Sq, V) and log-sum-exp (B, H, Sq), both fp32."""
    mask, own, scale = masking
    if scale is None and _fused(q, v, mask, own):
        if q.device.type == "cuda":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                q, _kv_per_head(q, k), _kv_per_head(q, v), 0.0, mask is not None
            )[:2]
            return out.float(), lse
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, mask is not None
        )
        return out.float(), lse
    kv_heads, e = k.shape[1], q.shape[-1]
    out, lse = _attend_block(
        _grouped(q, kv_heads) / math.sqrt(e),
        k.float()[:, :, None],
        v.float()[:, :, None],
        mask,
        None if scale is None else scale.unflatten(1, (kv_heads, -1)),
    )
    return out.flatten(1, 2), lse.flatten(1, 2)


def _block_backward(q, k, v, do, out, lse, masking: Masking):
    """Gradients of one block, from the upstream gradient `do` (like q) and the merged output
    `out` (q's dtype) and log-sum-exp `lse` (B, H, Sq) of the whole attention: P = exp(q k^T /
    sqrt(E) - lse) is then the block's part of the global softmax. Returns fp32 dq (B, H, Sq,
    E), dk (B, K, Sk, E), dv (B, K, Sk, V)."""
    mask, own, scale = masking
    if scale is None and _fused(q, v, mask, own):
        if q.device.type == "cuda":
            # Dense inputs: no cumulative sequence lengths; no dropout, so no generator state.
            seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
            offset = torch.zeros((), dtype=torch.uint64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                do.contiguous(), q, _kv_per_head(q, k), _kv_per_head(q, v), out.contiguous(),
                lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, mask is not None,
                seed, offset,
            )  # fmt: skip
            return dq.float(), _kv_grad(dk, k.shape[1]), _kv_grad(dv, k.shape[1])
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, mask is not None
        )
        return tuple(g.float() for g in grads)
    kv_heads, e = k.shape[1], q.shape[-1]
    do_g = _grouped(do, kv_heads)
    delta = (do_g * _grouped(out, kv_heads)).sum(-1)  # (B, K, G, Sq): rowsum(dO * O)
    dq, dk, dv = _attend_block_backward(
        _grouped(q, kv_heads) / math.sqrt(e),
        k.float()[:, :, None],
        v.float()[:, :, None],
        mask,
        do_g,
        _grouped(lse, kv_heads),
        delta,
        None if scale is None else scale.unflatten(1, (kv_heads, -1)),
    )
    return dq.flatten(1, 2) / math.sqrt(e), dk, dv  # d/dq of q / sqrt(E)


def _merge(out, lse, blk_out, blk_lse, rows: int) -> None:
    """Fold a block's (output, lse) into the running ones for query rows `rows:`, in place:
    out = (out e^lse + blk_out e^blk_lse) / (e^lse + e^blk_lse). The running lse starts at -inf;
    a row with both at -inf (no key seen yet) keeps weight 0 rather than NaN."""
    o, m = out[..., rows:, :], lse[..., rows:]
    new = torch.logaddexp(m, blk_lse)
    # Rows that have seen no key yet, here either (document masking), stay at 0 and -inf.
    seen = new > float("-inf")
    keep = torch.where(seen, (m - new).exp(), 0.0)
    add = torch.where(seen, (blk_lse - new).exp(), 0.0)
    o.mul_(keep[..., None]).add_(blk_out * add[..., None])
    m.copy_(new)


def _start(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running output (B, H, Sq, V) and log-sum-exp (B, H, Sq), fp32, before any block."""
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
    return out, torch.full(q.shape[:-1], float("-inf"), device=q.device)


def _finish(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The merged output in `dtype`, shaped (B, H, S, E) but laid out (B, S, H, E) as SDPA lays
    out its own: the model's transpose-and-reshape before the output projection is then a view,
    so the projection saves this very tensor instead of a copy of it."""
    b, h, s, e = out.shape
    final = torch.empty((b, s, h, e), dtype=dtype, device=out.device).transpose(1, 2)
    return final.copy_(out)


def _sub_block(q, pair: Pair):
    """The part of the pair's block to compute, from its bound (_block_bounds): (rows, keys,
    its Masking), or None when causality skips the block, or the documents do. The mask is
    (Sq, Sk), or (B, 1, 1, Sq, Sk) under document masking (the grouped heads' shape); None where
    nothing is masked."""
    q_pos, k_pos, documents = pair.q_pos, pair.k_pos, pair.docs
    rows, keys, masked = pair.bound
    if rows >= q.shape[2] or keys == 0:
        return None
    if documents is not None:
        mask = attention_mask(q_pos[rows:], k_pos[:keys], documents)[:, :, None]
        if not mask.any():  # every query of the block is in a later document than its keys
            return None
    else:
        mask = (q_pos[rows:, None] >= k_pos[None, :keys]) if masked else None
    shape = (q.shape[0], q.shape[1], q.shape[2] - rows, keys)
    return (
        rows,
        keys,
        Masking(mask, pair.own, dropout_scale(pair.drop, shape, q.device, pair.index)),
    )


def _attend(out, lse, q, k, v, pair: Pair) -> None:
    """Attend q (B, H, Sq, E) to the block k (B, K, Sk, E), v (B, K, Sk, V) of `pair` and merge
    into (out, lse)."""
    part = _sub_block(q, pair)
    if part is None:
        return
    rows, keys, masking = part
    blk_out, blk_lse = _block_forward(q[:, :, rows:], k[:, :, :keys], v[:, :, :keys], masking)
    _merge(out, lse, blk_out, blk_lse, rows)


def _attend_backward(dq, q, k, v, do, out, lse, pair: Pair):
    """Backward of _attend: adds the block's part of dq into `dq` (fp32) and returns its
    (dk, dv) for the block's first `keys` keys (fp32, (B, K, keys, E) and (B, K, keys, V)), or
    None if skipped."""
    part = _sub_block(q, pair)
    if part is None:
        return None
    rows, keys, masking = part
    dq_b, dk_b, dv_b = _block_backward(
        q[:, :, rows:], k[:, :, :keys], v[:, :, :keys], do[:, :, rows:], out[:, :, rows:],
        lse[:, :, rows:], masking,
    )  # fmt: skip
    dq[:, :, rows:] += dq_b
    return dk_b, dv_b


# --- allgather -------------------------------------------------------------------------------


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """x (...) -> (cp, ...): every rank's x, in group rank order."""
    cp = dist.get_world_size(group)
    # gloo wants the output concatenated along dim 0, not stacked: (cp * x0, ...).
    out = x.new_empty((cp * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out.view(cp, *x.shape)


def _gather_positions(pos: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(S_local,) -> (cp, S_local): every rank's key positions (a few bytes per token)."""
    cp = dist.get_world_size(group)
    out = pos.new_empty(cp * pos.numel())
    dist.all_gather_single(out, pos.contiguous(), group=group)
    return out.view(cp, -1)


class _AllGatherAttention(torch.autograd.Function):
    """All-gather attention. K and V travel in one collective, side by side along the head dim
    (E + V), and only the K kv heads (GQA-sized), after RoPE. Saved for backward: q, the
    gathered K/V (cp x this rank's), the output and its fp32 log-sum-exp, the positions; no
    mask, no score matrix. Backward: each computed block's dK/dV goes into a (cp, B, K,
    S_local, E + V) buffer in the input dtype, reduce-scattered so that each rank receives the
    sum for its own block (checked: gloo reduce-scatters fp32 and bf16 in torch 2.13)."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, group, drop, docs):
        cp, rank, e = dist.get_world_size(group), dist.get_rank(group), k.shape[-1]
        kv = _all_gather(torch.cat((k, v), -1), group)  # (cp, B, K, S_local, E + V)
        k_pos_all = _gather_positions(k_pos, group)  # (cp, S_local)
        bounds = _block_bounds(q_pos, k_pos_all)
        out, lse = _start(q, v)
        for src, bound in enumerate(bounds):
            k_src, v_src = kv[src, ..., :e], kv[src, ..., e:]
            pair = Pair(q_pos, k_pos_all[src], bound, src == rank, drop, rank * cp + src, docs)
            _attend(out, lse, q, k_src, v_src, pair)
        out = _finish(out, q.dtype)
        ctx.group, ctx.bounds, ctx.drop, ctx.docs = group, bounds, drop, docs
        ctx.save_for_backward(q, kv, q_pos, k_pos_all, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, q_pos, k_pos_all, out, lse = ctx.saved_tensors
        cp, rank, e = dist.get_world_size(ctx.group), dist.get_rank(ctx.group), q.shape[-1]
        do = grad_out.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros_like(kv)
        for src, bound in enumerate(ctx.bounds):
            pair = Pair(
                q_pos, k_pos_all[src], bound, src == rank, ctx.drop, rank * cp + src, ctx.docs
            )
            grads = _attend_backward(dq, q, kv[src, ..., :e], kv[src, ..., e:], do, out, lse, pair)
            if grads is not None:
                keys = grads[0].shape[2]
                dkv[src, :, :, :keys, :e] = grads[0]
                dkv[src, :, :, :keys, e:] = grads[1]
        mine = dkv.new_empty(dkv.shape[1:])  # (B, K, S_local, E + V)
        dist.reduce_scatter_single(mine, dkv.flatten(0, 1), group=ctx.group)
        return dq.to(q.dtype), mine[..., :e], mine[..., e:], None, None, None, None, None


# --- ring ------------------------------------------------------------------------------------


def _ring_start(tensors: tuple[torch.Tensor, ...], group: dist.ProcessGroup, tag: int = 0):
    """Post the sends of `tensors` to the next rank and the receives of same-shaped tensors
    from the previous one. Tags keep apart the K/V and the dK/dV exchanges that are in flight
    at the same time in backward (gloo matches P2P messages by tag; NCCL by posting order, which
    is the same on every rank)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    received = [torch.empty_like(t) for t in tensors]
    ops = []
    for i, (t, buf) in enumerate(zip(tensors, received, strict=True)):
        ops.append(dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % cp, tag=tag + i))
        ops.append(
            dist.P2POp(dist.irecv, buf, group=group, group_peer=(rank - 1) % cp, tag=tag + i)
        )
    return dist.batch_isend_irecv(ops), received


def _ring_finish(pending) -> list[torch.Tensor]:
    works, received = pending
    for w in works:
        w.wait()
    return received


class _RingAttention(torch.autograd.Function):
    """Ring attention. Saved for backward: q, k, v (this rank's, input dtype), the output (input
    dtype) and its log-sum-exp (B, H, S_local) in fp32, the positions; no score matrix. In
    flight per rank: the block being computed and the next one arriving (K/V in the input dtype;
    in backward also their dK/dV accumulators, in fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, group, drop, docs):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        # Every rank's key positions up front (one small all-gather), so each rank knows before
        # the ring starts which part of each block it will compute.
        k_pos_all = _gather_positions(k_pos, group)  # (cp, S_local)
        bounds = _block_bounds(q_pos, k_pos_all)
        out, lse = _start(q, v)
        blk = (k.contiguous(), v.contiguous())
        for step in range(cp):
            src = (rank - step) % cp  # the rank whose K/V block this rank holds at this step
            # The next block is already on its way while this one is computed.
            pending = _ring_start(blk, group) if step < cp - 1 else None
            pair = Pair(
                q_pos, k_pos_all[src], bounds[src], src == rank, drop, rank * cp + src, docs
            )
            _attend(out, lse, q, *blk, pair)
            if pending is not None:
                blk = tuple(_ring_finish(pending))
        out = _finish(out, q.dtype)
        ctx.group, ctx.bounds, ctx.drop, ctx.docs = group, bounds, drop, docs
        ctx.save_for_backward(q, k, v, q_pos, k_pos_all, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, q_pos, k_pos_all, out, lse = ctx.saved_tensors
        group, bounds = ctx.group, ctx.bounds
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        do = grad_out.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # The dK/dV accumulator of a block travels with it: it starts at the block's owner,
        # gathers each rank's contribution as it passes, and after cp hops is home again. Sending
        # every contribution straight home instead would need traffic off the ring (to a
        # different rank at every step) and a buffer per block at the owner.
        acc = (k.new_zeros(k.shape, dtype=torch.float32), v.new_zeros(v.shape, dtype=torch.float32))
        blk = (k.contiguous(), v.contiguous())
        pending_acc = None
        for step in range(cp):
            src = (rank - step) % cp
            pending_kv = _ring_start(blk, group) if step < cp - 1 else None
            pair = Pair(
                q_pos, k_pos_all[src], bounds[src], src == rank, ctx.drop, rank * cp + src, ctx.docs
            )
            grads = _attend_backward(dq, q, *blk, do, out, lse, pair)
            if pending_acc is not None:  # src's accumulator, from the rank that held it last
                acc = tuple(_ring_finish(pending_acc))
            if grads is not None:
                keys = grads[0].shape[2]
                acc[0][:, :, :keys] += grads[0]
                acc[1][:, :, :keys] += grads[1]
            if cp > 1:
                pending_acc = _ring_start(acc, group, tag=2)
            if pending_kv is not None:
                blk = tuple(_ring_finish(pending_kv))
        if pending_acc is not None:
            acc = tuple(_ring_finish(pending_acc))  # this rank's own block, back home
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None, None, None
