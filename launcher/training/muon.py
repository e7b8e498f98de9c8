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

A matrix split across ranks (an FSDP shard, a tensor-parallel slice: a DTensor) or held whole
by several (HSDP's and DDP's copies) is orthogonalised whole by one of them, once a step, and each
holder gets its piece of the result (launcher/training/spread.py: the owners spread over the
ranks by their Newton-Schulz work). Under ZeRO-1 (launcher/parallel/zero.py) each matrix is whole
on every rank and one rank of its group, its owner, steps it and broadcasts it. QK-clip, applied
after this step, is launcher/training/qk_clip.py.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from launcher.training import spread

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
        # The ranks holding copies of the parameters outside their DTensors' meshes (DDP's
        # replicas, this rank among them: the caller sets them before the first step):
        # spread.holdings.
        self.me = dist.get_rank() if dist.is_initialized() else 0
        self.replicas = [self.me]
        self._plans: dict[tuple, tuple] = {}
        # Matrices this rank orthogonalised in its last step (tests: once each over the ranks).
        self.orthogonalised = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon takes matrices and stacks of them, not {p.shape}")

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("Muon.step takes no closure: the loss is computed before it")
        stepped = [
            (group, p) for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        if not stepped:
            return
        ns = self.defaults
        dtype = NS_DTYPES[ns["ns_dtype"]]
        directions = []
        for group, p in stepped:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            grad, buf = local(p.grad), local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - group["momentum"])
            direction = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            directions.append(direction.to(dtype))
        units, offsets = self._plan([p for _, p in stepped])
        self.orthogonalised = sum(u.owner == self.me for u in units)
        updates = spread.orthogonalised(
            units, directions, offsets, self.me,
            partial(orthogonalise, steps=ns["ns_steps"], coefficients=NS_COEFFICIENTS, eps=EPS,
                    dtype=dtype),
        )  # fmt: skip
        for (group, p), update in zip(stepped, updates, strict=True):
            lr, weights = group["lr"], local(p)
            weights.mul_(1 - lr * group["weight_decay"])
            weights.add_(
                update.to(weights.dtype), alpha=-adjusted_lr(lr, p.shape, group["adjust_lr"])
            )

    def _plan(self, params: list[torch.Tensor]) -> tuple[list, list[int]]:
        """The units of `params` with their owners (spread.plan) and where each local stack
        starts among its experts; the same parameters get the same plan every step."""
        key = tuple(id(p) for p in params)
        if key not in self._plans:
            held = [spread.holdings(p, self.replicas, self.me) for p in params]
            units = spread.plan(
                [(tuple(p.shape), h) for p, h in zip(params, held, strict=True)],
                self.defaults["ns_steps"],
            )
            offsets = [h[self.me][0][0].start for h in held]
            self._plans[key] = (units, offsets)
        return self._plans[key]


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (a view: writing it writes the DTensor), a tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
