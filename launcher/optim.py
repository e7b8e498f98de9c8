"""AdamW (ZeRO-1: states sharded over dp_shard), warmup + cosine schedule, global-norm clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate

from launcher.config import TrainConfig
from launcher.distributed import Dist
from launcher.plan import Plan


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (weights, embeddings); leave vectors (norm gains) undecayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, plan: Plan, d: Dist) -> torch.optim.Optimizer:
    t = plan.cfg.train
    kwargs = {"lr": t.lr, "betas": (t.beta1, t.beta2), "eps": 1e-8}
    groups = param_groups(model, t.weight_decay)
    if plan.cfg.data_parallel.zero_stage == 1 and plan.degrees["dp_shard"] > 1:
        # Each dp_shard rank keeps the Adam states of its share of the parameters, steps them
        # and broadcasts the result; gradients arrive whole from DDP's all-reduce.
        return ZeroRedundancyOptimizer(
            groups,
            optimizer_class=torch.optim.AdamW,
            process_group=d.mesh["dp_shard"].get_group(),
            **kwargs,
        )
    return torch.optim.AdamW(groups, **kwargs)


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup from lr/warmup to lr, then cosine decay to min_lr at the last step."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps - 1)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_group=None) -> torch.Tensor:
    """Global L2 norm of all gradients across every rank; scale them down to max_norm if > 0.

    Gradients may be plain (replicated) tensors or DTensors on different meshes (FSDP shards,
    TP shards, both). Each rank sums the squares of what it holds, grouped by the mesh
    dimensions the gradient is sharded over; each group is all-reduced over exactly those
    dimensions (replicated dimensions hold copies, which must be counted once); the pipeline
    stages' totals are then summed over `pp_group`.
    """
    sums: dict[tuple, list] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(
                    placements=[Replicate() if pl.is_partial() else pl for pl in g.placements]
                )
            # Not is_shard(): FSDP over a TP-sharded dimension uses _StridedShard, which is not.
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            key, mesh, local = (id(g.device_mesh), dims), g.device_mesh, g.to_local()
        else:
            key, mesh, local = (None, ()), None, g
        entry = sums.setdefault(
            key, [mesh, torch.zeros((), dtype=torch.float32, device=local.device)]
        )
        entry[1] = entry[1] + local.float().pow(2).sum()
    total = None
    for (_, dims), (mesh, sq) in sums.items():
        for dim in dims:
            dist.all_reduce(sq, group=mesh.get_group(dim))
        total = sq if total is None else total + sq.to(total.device)
    if total is None:
        total = torch.zeros(())
    if pp_group is not None:  # each pipeline stage holds different parameters
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm.item() + 1e-6))
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return norm
