"""QK-clip (Kimi Team 2025, "Kimi K2: Open Agentic Intelligence", MuonClip): after each applied
optimizer step, every attention head h whose largest logit of the step S_max^h exceeded the
threshold tau (optimizer.qk_clip) has its query and key weights scaled so that its logits are
scaled by gamma_h = tau / S_max^h: that step's largest would have been tau. Other heads are left
as they are. Which rows of which weights, and by what, is the family's (the attention modules'
`qk_clip_rows`: MHA and GQA in launcher/models/layers.py `query_key_rows`, MLA in deepseek.py).

S_max^h: each attention core records its heads' largest q k^T / sqrt(E) over the step's
training forwards (launcher/models/layers.py `max_logits`; under context parallelism over every
rank's keys). Here those records are laid out over every head (a tensor-parallel rank holds a
slice of the heads) and reduced (max) over the ranks that saw other tokens (dp x cp) and over
tp, so that every rank holding a piece of a head's weights computes the same gamma; each then
scales the rows it holds (an FSDP shard, a tensor-parallel slice): no weight moves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from launcher.models.layers import LogitRecord
from launcher.training.muon import local, piece


def attentions(parts: list[nn.Module]) -> list[nn.Module]:
    """The attention modules of the parts, in their order (the same on every rank of a stage)."""
    return [m for part in parts for m in part.modules() if hasattr(m, "qk_clip_rows")]


def core(attention: nn.Module) -> LogitRecord:
    """An attention module's core (inside a recompute wrapper where recompute put one)."""
    return next(m for m in attention.modules() if isinstance(m, LogitRecord))


def track(parts: list[nn.Module]) -> None:
    """Have every attention core record its largest logits (what `clip` reads)."""
    for m in attentions(parts):
        core(m).track_logits = True


def reset(parts: list[nn.Module]) -> None:
    """Forget the records (a skipped step's: the next step's maxima are its own)."""
    for m in attentions(parts):
        core(m).max_logit = None


@torch.no_grad()
def scale_rows(p: torch.Tensor, factor: torch.Tensor) -> None:
    """p's rows (dimension 0, whole: `factor` has one per row) scaled in place, on the piece
    of them this rank holds."""
    if isinstance(p, DTensor) and any(pl.is_shard() and pl.dim != 0 for pl in p.placements):
        raise ValueError(f"QK-clip scales rows; this parameter is split over columns: {p.shape}")
    f = factor.to(device=local(p).device, dtype=p.dtype).reshape(-1, *([1] * (p.ndim - 1)))
    local(p).mul_(piece(f, p))


@torch.no_grad()
def clip(parts: list[nn.Module], threshold: float, d) -> dict:
    """The clip after an applied step, and its record for the step's metrics: the largest
    logit of the step over every head of the model and how many heads were clipped."""
    modules = attentions(parts)
    cores = [core(m) for m in modules]
    records = [c.max_logit for c in cores]
    if any(r is None for r in records):
        raise RuntimeError("QK-clip: an attention core recorded no logits this step")
    tp, tp_rank = (1, 0) if d.mesh is None else (d.mesh["tp"].size(), d.local_rank_of("tp"))
    rows = []
    for r in records:  # this rank's heads at their place among the layer's (tp slices)
        row = torch.full((r.numel() * tp,), float("-inf"), device=r.device)
        row[tp_rank * r.numel() : (tp_rank + 1) * r.numel()] = r
        rows.append(row)
    flat = torch.cat(rows) if rows else torch.full((1,), float("-inf"), device=d.device)
    groups = [] if d.mesh is None else [d.dp_cp_mesh, d.mesh["tp"]]
    for mesh in groups:
        if mesh.size() > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=mesh.get_group())
    clipped = 0
    for m, c, largest in zip(
        modules, cores, flat.split([row.numel() for row in rows]), strict=True
    ):
        over = largest > threshold
        if bool(over.any()):
            gamma = torch.where(over, threshold / largest, torch.ones_like(largest))
            for p, factor in m.qk_clip_rows(gamma):
                scale_rows(p, factor)
            clipped += int(over.sum())
        c.max_logit = None
    # Over the pipeline's stages: the model's largest logit and its clipped heads.
    largest, count = flat.max().reshape(1), torch.tensor([clipped], device=flat.device)
    pp = d.group("pp") if d.mesh is not None else None
    if pp is not None:
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=pp)
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=pp)
    return {"max_logit": largest.item(), "clipped_heads": int(count.item())}
