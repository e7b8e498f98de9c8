"""Job (tests/group.py, 4 ranks): Muon (launcher/training/muon.py) steps DTensor parameters split
over a 1-D mesh (rows, columns, a stack of whole experts) and a 2 x 2 mesh (FSDP's rows over a
tensor-parallel column split, a stack of experts split by rows, HSDP's two copies of a row
split), and a plain tensor copied on every rank (DDP's); each rank writes the whole results,
which tests/test_muon.py holds to one process stepping the whole tensors, and how many matrices
the ranks orthogonalised together at each step."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from launcher.training.muon import Muon

SHAPES = {
    "rows": (48, 40),
    "columns": (32, 64),
    "2d": (40, 48),
    "experts": (4, 24, 40),
    "whole experts": (8, 24, 40),
    "hsdp": (40, 48),
    "ddp": (24, 32),
}
# Matrices a step orthogonalises: one per matrix, one per expert of a stack.
MATRICES = {name: shape[0] if len(shape) == 3 else 1 for name, shape in SHAPES.items()}
STEPS = 5


def start(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The starting value and the target of the quadratic loss, the same on every rank."""
    gen = torch.Generator().manual_seed(len(name))
    shape = SHAPES[name]
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def stepped(param, target, replicas=None) -> list[int]:
    """Muon's STEPS on p; the matrices orthogonalised at each step, over every rank."""
    opt = Muon([param], lr=0.02, weight_decay=0.1)
    opt.replicas = replicas or opt.replicas
    counts = []
    for _ in range(STEPS):
        opt.zero_grad()
        ((param - target) ** 2).sum().backward()
        opt.step()
        count = torch.tensor(opt.orthogonalised)
        if dist.is_initialized():
            dist.all_reduce(count)
        counts.append(int(count))
    return counts


def job(out: Path, *_: str) -> None:
    flat = init_device_mesh("cpu", (4,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layouts = {
        "rows": (flat, [Shard(0)]),
        "columns": (flat, [Shard(1)]),
        "2d": (grid, [Shard(0), Shard(1)]),
        "experts": (grid, [Shard(1), Shard(2)]),
        "whole experts": (flat, [Shard(0)]),
        "hsdp": (grid, [Replicate(), Shard(0)]),
    }
    results, counts = {}, {}
    for name, (mesh, placements) in layouts.items():
        value, target = start(name)
        param = torch.nn.Parameter(distribute_tensor(value, mesh, placements))
        counts[name] = stepped(param, distribute_tensor(target, mesh, placements))
        results[name] = param.detach().full_tensor()
    value, target = start("ddp")
    param = torch.nn.Parameter(value)
    counts["ddp"] = stepped(param, target, replicas=list(range(dist.get_world_size())))
    results["ddp"] = param.detach()
    if dist.get_rank() == 0:
        torch.save({"results": results, "counts": counts}, out / "muon.pt")
