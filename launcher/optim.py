"""AdamW per model part (ZeRO-1: states sharded over dp_shard; moments optionally in bf16 beside
fp32 master weights), warmup + cosine schedule, global-norm clipping.

torch.distributed.optim (ZeRO-1) and torch.distributed.checkpoint (state dicts) are imported
where they are used: a run reaches its first step without them unless it runs ZeRO-1.
"""

from __future__ import annotations

import math
import sys
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from launcher.config import PrecisionConfig, TrainConfig
from launcher.distributed import Dist
from launcher.layout import Layout
from launcher.parallel.data_parallel import DTYPES
from launcher.parallel.expert_parallel import expert_params

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

# Segments wrappers add to parameter names (DDP, activation checkpointing, compile); a
# checkpoint names parameters without them, as the plain model does.
WRAPPER_SEGMENTS = ("module", "_checkpoint_wrapped_module", "_orig_mod")


def param_groups(
    model: nn.Module, weight_decay: float, skip: frozenset = frozenset()
) -> list[dict]:
    """Decay matrices (weights, embeddings); leave vectors (norm gains) undecayed. `skip`:
    parameters left out."""
    params = [p for p in model.parameters() if p.requires_grad and p not in skip]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def canonical_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


class MomentDtypeAdamW(torch.optim.AdamW):
    """AdamW whose exp_avg and exp_avg_sq are stored in `moment_dtype` (bf16) while the
    parameters, the master weights, keep their own dtype (fp32).

    Each parameter's update runs in the parameter's dtype: its moments are upcast, updated as
    torch's single-tensor AdamW does (same operations in the same order: with moment_dtype equal
    to the parameters' it matches torch.optim.AdamW(foreach=False) bit for bit) and rounded back.
    One parameter at a time, so the transient fp32 copies are one tensor's, never the model's.
    The state keeps torch's keys and layout (a scalar fp32 `step`; DTensor moments beside DTensor
    parameters), so the flattened and ZeRO-1 checkpoint paths and DCP resharding are unchanged.
    """

    def __init__(self, params, *, moment_dtype: torch.dtype, **kwargs):
        super().__init__(params, **kwargs)
        self.moment_dtype = moment_dtype

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every floating state to its parameter's dtype on load; store them narrow.
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.moment_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key] = torch.zeros_like(
                            p, dtype=self.moment_dtype, memory_format=torch.preserve_format
                        )
                state["step"] += 1
                step = state["step"].item()
                exp_avg = state["exp_avg"].to(p.dtype)
                exp_avg_sq = state["exp_avg_sq"].to(p.dtype)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                exp_avg.lerp_(p.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                step_size = lr / (1 - beta1**step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
        return loss


def moment_dtype(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.dtype:
    """The dtype `opt` keeps p's Adam moments in."""
    return getattr(opt, "moment_dtype", p.dtype)


class Optimizers:
    """One AdamW per model part (pipeline stage), stepped together.

    Checkpoint keys are `state.<parameter>.<exp_avg|exp_avg_sq|step>` and
    `param_groups.<parameter>.<option>` with the model's own parameter names, which stages
    keep: they do not depend on the pipeline layout, the sharding or the wrappers. ZeRO-1's
    ZeroRedundancyOptimizer has no such state dict (its own is indexed by position and
    gathered on one rank), so each rank gives the entries of the parameters it owns and takes
    them back the same way: DCP reshards them like any other tensor.
    """

    def __init__(self, pairs: list[tuple[nn.Module, torch.optim.Optimizer]]):
        # (model part, optimizer): one per part, two under ZeRO-1 with expert parallelism.
        self.pairs = pairs
        self.optimizers = [opt for _, opt in pairs]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        out: dict = {}
        for part, opt in self.pairs:
            if is_zero1(opt):
                out.update(zero1_entries(part, opt))
            else:
                out.update(get_optimizer_state_dict(part, opt, options=flat()))
        return out

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        for part, opt in self.pairs:
            if is_zero1(opt):
                load_zero1(part, opt, state)
            else:
                mine = get_optimizer_state_dict(part, opt, options=flat())
                set_optimizer_state_dict(part, opt, {k: state[k] for k in mine}, options=flat())


def flat():
    """State-dict options: one flat dict keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def is_zero1(opt: torch.optim.Optimizer) -> bool:
    # build_optimizers imports torch.distributed.optim for ZeRO-1; without it, none is ZeRO-1.
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(opt, module.ZeroRedundancyOptimizer)


def owned(part: nn.Module, opt: ZeroRedundancyOptimizer):
    """(canonical name, parameter, its group in the local optimizer) for each parameter whose
    Adam states this rank keeps."""
    group_of = {p: g for g in opt.optim.param_groups for p in g["params"]}
    for name, p in part.named_parameters():
        if p in group_of:
            yield canonical_name(name), p, group_of[p]


def zero1_entries(part: nn.Module, opt: ZeroRedundancyOptimizer) -> dict:
    """This rank's share of a ZeRO-1 optimizer in the flattened layout (zeros where no step
    has made the state yet, so that a fresh optimizer is also a template to load into)."""
    out: dict = {}
    for name, p, group in owned(part, opt):
        state = opt.optim.state.get(p, {})
        dtype = moment_dtype(opt.optim, p)
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"state.{name}.{key}"] = (
                state[key] if key in state else torch.zeros_like(p, dtype=dtype)
            )
        out[f"state.{name}.step"] = state["step"] if "step" in state else torch.zeros(())
        for key, value in group.items():
            if key != "params":
                out[f"param_groups.{name}.{key}"] = value
    return out


def load_zero1(part: nn.Module, opt: ZeroRedundancyOptimizer, state: dict) -> None:
    for name, p, group in owned(part, opt):
        dtype = moment_dtype(opt.optim, p)
        opt.optim.state[p] = {
            "step": state[f"state.{name}.step"].detach().clone().float(),
            "exp_avg": state[f"state.{name}.exp_avg"].detach().clone().to(dtype),
            "exp_avg_sq": state[f"state.{name}.exp_avg_sq"].detach().clone().to(dtype),
        }
        for key in group:
            if key != "params" and f"param_groups.{name}.{key}" in state:
                group[key] = state[f"param_groups.{name}.{key}"]


def build_optimizers(
    parts: list[nn.Module], layout: Layout, t: TrainConfig, d: Dist, prec: PrecisionConfig
) -> Optimizers:
    """AdamW per part; with ZeRO-1 its states sharded over dp_shard x cp (ranks that hold the
    same parameters). Moments in precision.optimizer_dtype: torch's own AdamW when that is the
    master weights' dtype (the parity tests compare it bit for bit), MomentDtypeAdamW otherwise."""
    kwargs = {"lr": t.lr, "betas": (t.beta1, t.beta2), "eps": 1e-8}
    adamw = torch.optim.AdamW
    if prec.optimizer_dtype != prec.master_dtype:
        # A partial, not a constructor keyword: ZeRO-1 would copy such a keyword into every
        # param group, and param groups are saved in checkpoints.
        adamw = partial(MomentDtypeAdamW, moment_dtype=DTYPES[prec.optimizer_dtype.value])
    pairs: list[tuple[nn.Module, torch.optim.Optimizer]] = []
    for part in parts:
        if layout.zero1_enabled:
            # Each dp_shard x cp rank keeps the Adam states of its share of the parameters, steps
            # them and broadcasts the result; gradients arrive whole from DDP's all-reduce.
            # Expert-parallel experts differ between ranks: never broadcast, their own AdamW.
            from torch.distributed.optim import ZeroRedundancyOptimizer

            experts = frozenset(expert_params(part))
            zero = ZeroRedundancyOptimizer(
                param_groups(part, t.weight_decay, skip=experts),
                optimizer_class=adamw,
                process_group=d.shard_mesh.get_group(),
                **kwargs,
            )
            pairs.append((part, zero))
            if experts:
                own = [p for p in part.parameters() if p in experts]
                pairs.append(
                    (
                        part,
                        adamw([{"params": own, "weight_decay": t.weight_decay}], **kwargs),
                    )
                )
        else:
            pairs.append((part, adamw(param_groups(part, t.weight_decay), **kwargs)))
    return Optimizers(pairs)


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup from lr/warmup to lr, then cosine decay to min_lr at the last step."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps - 1)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


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
        # A tensor, never a Python number: reading the norm on the host would stall the step
        # until backward is done on an asynchronous device (the loss is read once, at its end).
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device))
    return norm
