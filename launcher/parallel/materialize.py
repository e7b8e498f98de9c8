"""A model built and parallelized on the meta device, made real: each rank allocates only the
parameters and buffers it holds, on its device, and computes their initial values itself.

A parameter a rank holds is a box of the full tensor (its FSDP, tensor- or expert-parallel
shard, or the whole tensor where it is replicated); launcher/models/init.py draws exactly that box,
with the values one process holding the whole model would draw there. No rank ever holds more than
its share, and no collective runs: every rank's values follow from the seed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from launcher.models.init import Plan, fill_box

Box = tuple[slice, ...]

# Segments wrappers add to parameter names (DDP, activation checkpointing, compile); a
# checkpoint names parameters without them, as the plain model does.
WRAPPER_SEGMENTS = ("module", "_checkpoint_wrapped_module", "_orig_mod")


def canonical_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def local_box(t: torch.Tensor) -> Box:
    """The part of the full tensor this rank holds, as one slice per dimension."""
    if not isinstance(t, DTensor):
        return tuple(slice(0, n) for n in t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def when_real(module: nn.Module, register) -> None:
    """Call `register()` once `module`'s parameters are real: now, or after `materialize`.
    For what must hold on the parameter objects themselves (a tensor's gradient hook):
    to_empty swaps a DTensor parameter's contents for new ones, its hooks left behind."""
    if any(p.is_meta for p in module.parameters()):
        module.__dict__.setdefault("_when_real", []).append(register)
    else:
        register()


def shared_places(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Where one parameter object sits in several modules (a tied embedding): its places."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((m, name))
    return [where for where in places.values() if len(where) > 1]


def to_empty(module: nn.Module, device: torch.device) -> None:
    """module.to_empty(device), its tied weights still tied: to_empty gives each module a new
    Parameter for a plain tensor moved off the meta device (DTensors are swapped in place),
    so a weight two modules share would become two."""
    shared = shared_places(module)
    module.to_empty(device=device)
    for (first, name), *others in shared:
        for other, other_name in others:
            setattr(other, other_name, getattr(first, name))


@torch.no_grad()
def materialize(part: nn.Module, device: torch.device, seed: int, plan: Plan) -> None:
    """Allocate `part` (a parallelized model or pipeline stage, on meta) on `device` and give
    every parameter this rank's box of its initial value (`plan`: the full model's)."""
    to_empty(part, device)
    for module in part.modules():
        for register in module.__dict__.pop("_when_real", []):
            register()
    for name, p in part.named_parameters():
        name = plan.canonical(canonical_name(name))
        local = p.to_local() if isinstance(p, DTensor) else p
        box = local_box(p)
        fill_box(
            local,
            part.init_rule(name),
            seed,
            plan.first_tile[name],
            plan.shapes[name],
            tuple(s.start for s in box),
        )
    part.init_buffers()
