"""AdamW (ZeRO-1: states sharded over dp_shard), warmup + cosine schedule, global-norm clipping."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

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


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients across every rank; scale them down to max_norm if > 0.

    Sharded (DTensor) gradients give a DTensor norm whose full_tensor() reduces over the mesh
    dimensions they are sharded on; replicated (DDP) gradients are already whole.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
