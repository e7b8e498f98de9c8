"""Compose the parallelism axes for a model, in one fixed order.

Order (as in torchtitan): tensor parallelism -> activation checkpointing -> compile -> data
parallelism (FSDP/HSDP or DDP). TP rewrites the modules' parameters into DTensors that FSDP
then shards on the data-parallel mesh dimensions; checkpointing and compile wrap blocks that
must already be TP-sharded (so the recomputed and compiled code is the sharded one); FSDP comes
last because it groups each (wrapped, compiled) block into one communication unit.
"""

from __future__ import annotations

from torch import nn

from launcher.config import Config
from launcher.distributed import Dist
from launcher.layout import Layout
from launcher.parallel.checkpointing import apply_ac, apply_compile
from launcher.parallel.data_parallel import apply_ddp, apply_fsdp
from launcher.parallel.tensor_parallel import apply_tp


def parallelize(model: nn.Module, layout: Layout, cfg: Config, d: Dist) -> nn.Module:
    """Apply the layout to a model built identically on every rank (model family, compile and
    precision come from the config; everything about the layout from `layout`)."""
    if layout.tp > 1:
        apply_tp(
            model, d.mesh["tp"], cfg.model.family, layout.sequence_parallel, layout.loss_parallel
        )
    if layout.recompute != "none":
        apply_ac(model, layout.recompute)
    if cfg.train.compile:
        apply_compile(model)
    if d.mesh is None or layout.dp == 1:
        return model
    prec = cfg.precision
    if layout.fsdp_enabled:
        dims = ("dp_replicate", "dp_shard") if layout.dp_replicate > 1 else ("dp_shard",)
        return apply_fsdp(
            model,
            d.mesh[dims],
            reshard_after_forward=layout.zero_stage == 3,
            param_dtype=prec.param_dtype.value,
            reduce_dtype=prec.grad_dtype.value,
        )
    return apply_ddp(model, d.dp_mesh, d.device)
