"""Compose the parallelism axes for a model, in one fixed order.

Order (as in torchtitan): tensor parallelism -> activation checkpointing -> compile -> data
parallelism (FSDP/HSDP or DDP). TP rewrites the modules' parameters into DTensors that FSDP
then shards on the data-parallel mesh dimensions; checkpointing and compile wrap blocks that
must already be TP-sharded (so the recomputed and compiled code is the sharded one); FSDP comes
last because it groups each (wrapped, compiled) block into one communication unit.
"""

from __future__ import annotations

from torch import nn

from launcher.distributed import Dist
from launcher.parallel.checkpointing import apply_ac, apply_compile
from launcher.parallel.data_parallel import apply_ddp, apply_fsdp
from launcher.parallel.tensor_parallel import apply_tp
from launcher.plan import Plan


def parallelize(model: nn.Module, plan: Plan, d: Dist) -> nn.Module:
    """Apply the plan's layout to a model built identically on every rank."""
    cfg, degrees = plan.cfg, plan.degrees
    if degrees["tp"] > 1:
        apply_tp(
            model,
            d.mesh["tp"],
            cfg.model.family,
            cfg.tensor.sequence_parallel,
            cfg.tensor.loss_parallel,
        )
    if cfg.recompute.mode.value != "none":
        apply_ac(model, cfg.recompute.mode.value)
    if cfg.train.compile:
        apply_compile(model)
    if d.mesh is None or plan.dp == 1:
        return model
    stage = cfg.data_parallel.zero_stage
    prec = cfg.precision
    if degrees["dp_shard"] > 1 and stage >= 2:
        dims = ("dp_replicate", "dp_shard") if degrees["dp_replicate"] > 1 else ("dp_shard",)
        return apply_fsdp(
            model,
            d.mesh[dims],
            reshard_after_forward=stage == 3,
            param_dtype=prec.param_dtype.value,
            reduce_dtype=prec.grad_dtype.value,
        )
    return apply_ddp(model, d.dp_mesh, d.device)
