"""Process group, device and the named DeviceMesh built from a validated plan."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Mesh dimensions, outermost first: pipeline stages span the slowest links, tensor parallelism
# the fastest, so tp is innermost (consecutive ranks, one node).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh | None  # None when running as a single process
    dp_mesh: DeviceMesh | None  # dp_replicate x dp_shard flattened: who shares the batch

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0


def init(device_type: str, degrees: dict[str, int], timeout_s: float = 600) -> Dist:
    """Join the env:// process group (torchrun, SLURM) and build the mesh; or stay single."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(device)
        return Dist(0, 1, 0, device, None, None)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=timeout_s))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    mesh = build_mesh(device_type, degrees)
    return Dist(
        rank, world, local_rank, device, mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")
    )


def build_mesh(device_type: str, degrees: dict[str, int]) -> DeviceMesh:
    """All of MESH_DIMS, size-1 ones too, so that code can always name them."""
    return init_device_mesh(
        device_type, tuple(degrees[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS
    )


def all_reduce_mean(x: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Mean of x over a 1-D mesh (gloo has no AVG, so SUM then divide)."""
    if mesh is None or mesh.size() == 1:
        return x
    x = x.clone()
    dist.all_reduce(x, group=mesh.get_group())
    return x / mesh.size()


def shutdown() -> None:
    """Leave the process group together (gloo aborts if a peer tears down mid-operation)."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
