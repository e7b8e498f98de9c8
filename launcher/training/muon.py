"""Muon: each weight matrix's update orthogonalised whole (Jordan et al. 2024, "Muon: an
optimizer for hidden layers"; Liu et al. 2025, "Muon is scalable for LLM training", Moonlight).

For each matrix W with gradient G: the momentum M <- mu M + (1 - mu) G (torch.optim.Muon's
form; Moonlight's M <- mu M + G differs by the factor 1 - mu, which the orthogonalisation
removes); with Nesterov the update direction is (1 - mu) G + mu M, else M; O = NS(direction), a
few Newton-Schulz iterations in bf16 that map it to the nearest semi-orthogonal matrix (its
singular values near 1); W <- W (1 - lr wd) - lr' O, with lr' = lr x 0.2 sqrt(max(A, B)) for an
A x B matrix (Moonlight's scaling, so that the update's RMS matches AdamW's and AdamW's lr and
weight decay carry over) or lr x sqrt(max(1, A / B)) (Keller Jordan's original). A stack of
experts (E, A, B) is E matrices, each orthogonalised alone.

A matrix split across ranks (an FSDP shard, a tensor-parallel slice: a DTensor) is gathered
whole for its orthogonalisation and its update taken back to the shard: each rank holding a
piece of it computes the same O (see `whole`). Under ZeRO-1 (launcher/parallel/zero.py) each
matrix is whole on every rank and one rank of its group, its owner, steps it and broadcasts it.
QK-clip, applied after this step, is launcher/training/qk_clip.py.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate

# Keller Jordan's quintic coefficients (torch.optim.Muon's), 5 iterations.
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
NS_STEPS = 5
EPS = 1e-7
ADJUST_LR = ("match_rms_adamw", "original")
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def orthogonalise(
    g: torch.Tensor, steps: int, coefficients, eps: float = EPS, dtype=torch.bfloat16
) -> torch.Tensor:
    """Newton-Schulz in bf16 as torch.optim.Muon computes it (the same operations: addmm), over
    the last two dimensions; a leading dimension is a stack of matrices (baddbmm). `dtype`
    fp32: the same iteration unrounded (the parity tests: bf16 rounds the last fp32 bits of
    two layouts' gradients apart now and then, and the iteration carries that far)."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x = x.div(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x.div(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, shape, adjust: str) -> float:
    """The learning rate of a matrix's orthogonalised update (its last two dimensions A x B)."""
    rows, cols = shape[-2:]
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


def whole(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole matrix of which `local` is this rank's piece, laid out as the parameter
    `like` (a DTensor: gathered over every dimension it is split over); `local` itself else."""
    if not isinstance(like, DTensor):
        return local
    piece = DTensor.from_local(
        local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )
    return piece.full_tensor()


def piece(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a whole matrix, laid out as the parameter `like` (no communication:
    every rank holds the same whole)."""
    if not isinstance(like, DTensor):
        return full
    mesh = like.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements).to_local()


class Muon(torch.optim.Optimizer):
    """Muon over matrices (2-D) and stacks of them (3-D, experts); parameters plain tensors or
    DTensors (see the module docstring). State: `momentum_buffer`, one per parameter, shaped
    and placed as it."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = NS_STEPS,
        adjust_lr: str = "match_rms_adamw",
        ns_dtype: str = "bf16",
    ):
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"adjust_lr={adjust_lr!r} must be one of {', '.join(ADJUST_LR)}")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype={ns_dtype!r} must be one of {', '.join(NS_DTYPES)}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, adjust_lr=adjust_lr, ns_dtype=ns_dtype)  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon takes matrices and stacks of them, not {p.shape}")

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("Muon.step takes no closure: the loss is computed before it")
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                grad, weights = local(p.grad), local(p)
                local(buf).lerp_(grad, 1 - mu)
                direction = grad.lerp(local(buf), mu) if group["nesterov"] else local(buf)
                full = orthogonalise(
                    whole(direction, p), group["ns_steps"], NS_COEFFICIENTS, EPS,
                    NS_DTYPES[group["ns_dtype"]],
                )  # fmt: skip
                update = piece(full.to(weights.dtype), p)
                weights.mul_(1 - lr * wd)
                weights.add_(update, alpha=-adjusted_lr(lr, p.shape, group["adjust_lr"]))


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (a view: writing it writes the DTensor), a tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
