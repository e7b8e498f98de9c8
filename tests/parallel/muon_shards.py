"""Job (tests/group.py, 4 ranks): Muon (launcher/training/muon.py) steps DTensor parameters split
over a 1-D mesh (rows, columns) and a 2 x 2 mesh (FSDP's rows over a tensor-parallel column
split, and a stack of experts split by rows); each rank writes the whole results, which
tests/test_muon.py holds to one process stepping the whole tensors."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from launcher.training.muon import Muon

SHAPES = {"rows": (48, 40), "columns": (32, 64), "2d": (40, 48), "experts": (4, 24, 40)}
STEPS = 5


def start(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The starting value and the target of the quadratic loss, the same on every rank."""
    gen = torch.Generator().manual_seed(len(name))
    shape = SHAPES[name]
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def stepped(param, target) -> None:
    opt = Muon([param], lr=0.02, weight_decay=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        ((param - target) ** 2).sum().backward()
        opt.step()


def job(out: Path, *_: str) -> None:
    flat = init_device_mesh("cpu", (4,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layouts = {
        "rows": (flat, [Shard(0)]),
        "columns": (flat, [Shard(1)]),
        "2d": (grid, [Shard(0), Shard(1)]),
        "experts": (grid, [Shard(1), Shard(2)]),
    }
    results = {}
    for name, (mesh, placements) in layouts.items():
        value, target = start(name)
        param = torch.nn.Parameter(distribute_tensor(value, mesh, placements))
        stepped(param, distribute_tensor(target, mesh, placements))
        results[name] = param.detach().full_tensor()
    if dist.get_rank() == 0:
        torch.save(results, out / "muon.pt")
