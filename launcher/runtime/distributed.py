"""Process group, device and the named DeviceMesh built from a validated layout."""

from __future__ import annotations

import gc
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from launcher.layout import MESH_DIMS, Layout
from launcher.runtime.failures import restart_attempt


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh | None  # None when running as a single process
    dp_mesh: DeviceMesh | None  # dp_replicate x dp_shard flattened: who shares the batch
    # dp_replicate x dp_shard x cp flattened: who averages gradients and the loss (a context
    # parallel rank holds part of every sequence, so it is a data-parallel rank for them).
    dp_cp_mesh: DeviceMesh | None = None
    # FSDP's mesh: dp_shard (x cp: those ranks hold the same parameters), with dp_replicate
    # outermost under HSDP; shard_mesh is its sharding dimension alone (ZeRO-1's group too).
    fsdp_mesh: DeviceMesh | None = None
    shard_mesh: DeviceMesh | None = None
    # MoE models: see expert_meshes and split_group.
    _experts: tuple[DeviceMesh, DeviceMesh, DeviceMesh] | None = None
    _split: DeviceMesh | None = None

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    def expert_meshes(self, layout: Layout) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
        """The ep ranks (carved from dp_shard x cp x tp, innermost), the experts' data-
        parallel mesh (the rest of those ranks, with dp_replicate outermost under HSDP) and
        that mesh flattened to one dimension.

        A root mesh of its own over the same ranks: (dp_shard, cp, tp) flattened row-major is
        (edp, ep), so an ep group is ep consecutive ranks. FSDP needs the experts' DTensor mesh
        (ep) and their sharding mesh (edp) to share a root, hence one root for both. Built on
        first use; every rank must ask (it creates process groups).
        """
        if self._experts is None:
            inner = layout.dp_shard * layout.cp * layout.tp
            shape = (layout.pp, layout.dp_replicate, inner // layout.ep, layout.ep)
            names = ("pp", "dp_replicate", "edp", "ep")
            root = init_device_mesh(self.mesh.device_type, shape, mesh_dim_names=names)
            edp = root["dp_replicate", "edp"] if layout.dp_replicate > 1 else root["edp"]
            flat = root["dp_replicate", "edp"]._flatten("edp_all")
            self._experts = (root["ep"], edp, flat)
        return self._experts

    @property
    def experts_flat(self) -> DeviceMesh | None:
        """The experts' data-parallel mesh flattened, where the engine built the expert meshes
        (expert parallelism, or routed experts under tp); None elsewhere. Builds nothing."""
        return self._experts[2] if self._experts is not None else None

    def expert_shard_group(self, layout: Layout):
        """ZeRO-1's group for the routed experts' states: the ranks of one dp_replicate
        replica holding the same experts (edp), or None where that is one rank."""
        if layout.dp_shard * layout.cp * layout.tp // layout.ep == 1:
            return None
        _, edp, _ = self.expert_meshes(layout)
        return (edp["edp"] if edp.ndim > 1 else edp).get_group()

    def pp_pair_group(self, a: int, b: int):
        """The process group of this rank's pipeline coordinates a and b among the ranks that
        share every other coordinate (Megatron's embedding group: first and last stage).
        Every rank must ask: one group per such pair is created, on every rank."""
        ranks = self.mesh.mesh.movedim(MESH_DIMS.index("pp"), -1).flatten(0, -2)
        pairs = [[int(row[a]), int(row[b])] for row in ranks]
        mine, _ = dist.new_subgroups_by_enumeration(pairs)
        return mine

    def split_group(self) -> DeviceMesh:
        """cp x tp flattened: the ranks holding other tokens of the same sequences (an MoE
        layer splits its tokens over tp). Built on first use; every rank must ask."""
        if self._split is None:
            self._split = self.mesh["cp", "tp"]._flatten("cp_tp")
        return self._split

    def local_rank_of(self, dim: str) -> int:
        """This rank's coordinate along a mesh dimension (0 on a single process)."""
        return self.mesh[dim].get_local_rank() if self.mesh is not None else 0

    def group(self, dim: str):
        """The process group of a mesh dimension, or None when it has one rank."""
        if self.mesh is None or self.mesh[dim].size() == 1:
            return None
        return self.mesh[dim].get_group()


def init(device_type: str, layout: Layout, timeout_s: float = 600) -> Dist:
    """Join the env:// process group (torchrun, SLURM) and build the mesh; or stay single.
    In a process that already belongs to a group (the tests' long-lived groups, which train one
    layout after another), build the mesh over that group.

    Every collective, the first rendezvous included, gives up after `timeout_s` seconds.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
        return mesh_dist(layout, device_type, device, dist.get_rank(), local_rank)
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return single(device_type)
    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun restarts reuse the rendezvous store, which still holds the previous attempt's
    # gloo addresses (the new group then connects to dead peers); a key prefix per attempt
    # gives every attempt a clean namespace (tests/e2e/test_failures.py restarts a killed rank).
    store = dist.PrefixStore(f"attempt_{restart_attempt()}", store)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # gloo beside nccl: the stop flag and async checkpoints use CPU tensors.
        backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device
        )
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return mesh_dist(layout, device_type, device, rank, local_rank)


def single(device_type: str, local_rank: int = 0) -> Dist:
    """One process outside any group, on cuda:local_rank (or the CPU): a run of one device, or
    a rank's own one-process work before its group forms (launcher.selftest's references)."""
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    return Dist(0, 1, 0, device, None, None)


def mesh_dist(
    layout: Layout, device_type: str, device: torch.device, rank: int, local_rank: int = 0
) -> Dist:
    """The named mesh of every MESH_DIMS dimension (size-1 ones too, so that code can always
    name them) and the flattened meshes torchtitan names: dp (who shares the batch),
    dp_shard_cp (FSDP's sharding dimension: cp ranks hold the same parameters) and dp_cp (who
    averages gradients), over the current default group.

    The one mesh builder: training calls it after joining the group, the dry run over a fake
    group of the full world size.
    """
    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIMS)
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    dp_cp_mesh = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    if layout.cp == 1:
        shard_mesh = mesh["dp_shard"]
        fsdp_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else shard_mesh
    else:
        shard_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        fsdp_mesh = shard_mesh
        if layout.dp_replicate > 1:
            # torch 2.13 warns that slicing a flattened dimension from the root will be
            # deprecated, and offers no other way to the 2-D HSDP mesh beside the TP mesh.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                fsdp_mesh = mesh["dp_replicate", "dp_shard_cp"]
    return Dist(
        rank, layout.world, local_rank, device, mesh, dp_mesh, dp_cp_mesh, fsdp_mesh, shard_mesh
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
