"""Data-parallel axis: FSDP2 / HSDP (ZeRO-3), ZeRO-2, and DDP (ZeRO-0; the model side of ZeRO-1).

ZeRO-1's optimizer-state sharding lives in launcher/training/optim.py; here it is plain DDP.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    param_dtype: str,
    reduce_dtype: str,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard each block, then the root (embedding, final norm, output) as the last unit.

    A 1-D mesh gives FSDP over dp_shard; a 2-D (dp_replicate, dp_shard) mesh gives HSDP:
    sharded within dp_shard, replicated (gradients all-reduced) across dp_replicate.
    reshard_after_forward=False is ZeRO-2: parameters stay gathered from forward to backward.
    """
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    placement = widest_when_few(mesh.size(-1))

    for _, block in model.blocks():
        experts = getattr(getattr(block, "feed_forward", None), "experts", None)
        if expert_mesh is not None and experts is not None:
            # Expert-parallel experts differ per ep rank: their own unit over the ranks that
            # hold the same experts (their gradient's scale: launcher/parallel/expert_parallel).
            fully_shard(
                experts,
                mesh=expert_mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=mp,
                shard_placement_fn=widest_when_few(expert_mesh.size(-1)),
            )
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp,
            shard_placement_fn=placement,
        )
    # The root's parameters are needed again first thing in backward: never reshard them.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    return model


def widest_when_few(shards: int):
    """FSDP's placement for each parameter: dim 0 by default, but stacked experts (E, ffn,
    dim) with fewer experts here than ranks would leave ranks empty (E / ep of them under
    expert parallelism), so those shard their largest dimension instead."""

    def placement(p: nn.Parameter) -> Shard | None:
        shape = p.to_local().shape if isinstance(p, DTensor) else p.shape
        if len(shape) > 1 and shape[0] < shards:
            return Shard(max(range(len(shape)), key=lambda i: shape[i]))
        return None

    return placement


def apply_ddp(
    model: nn.Module, mesh: DeviceMesh, device: torch.device, skip: list[str] = ()
) -> nn.Module:
    """Replicate over the flattened data-parallel group; gradients all-reduced (averaged).
    `skip`: parameters DDP leaves alone (expert-parallel experts, reduced over their own
    group)."""
    device_ids = [device.index] if device.type == "cuda" else None
    if skip:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(skip))
    # The rope buffer is derived from config, identical everywhere: no broadcast each forward.
    # The initial shape check and sync cannot run on a meta-device dry run.
    return DistributedDataParallel(
        model,
        process_group=mesh.get_group(),
        device_ids=device_ids,
        forward_sync_buffers=False,
        init_sync=device.type != "meta",
    )


def grad_sync(model: nn.Module, sync: bool):
    """Context for one micro-batch: DDP skips the all-reduce until the last one.

    FSDP reduce-scatters every micro-batch (gradients stay sharded, which is the point of
    ZeRO-2/3), so it needs no context.
    """
    if isinstance(model, DistributedDataParallel) and not sync:
        return model.no_sync()
    return nullcontext()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (a view: writing into it writes
    the DTensor), a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def average_grads(grads: list[torch.Tensor], group) -> None:
    """Average gradients in place over `group`, as DDP would (one all-reduce per dtype, of all
    of them flattened together). A DTensor gradient (tensor parallelism) is averaged shard by
    shard: the ranks of `group` hold the same shard of it."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        g = local_tensor(g)
        by_dtype.setdefault(g.dtype, []).append(g)
    n = dist.get_world_size(group)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= n
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))
