"""Compose the parallelism axes for a model, in one fixed order.

Order (as in torchtitan): float8 linears (precision.fp8) -> tensor parallelism -> context
parallelism -> activation checkpointing -> compile -> data parallelism (FSDP/HSDP or DDP). TP
rewrites the modules' parameters into DTensors that FSDP then shards on the data-parallel mesh
dimensions; CP swaps each block's attention core, which selective checkpointing then wraps (so
the ring is what is recomputed); checkpointing and compile wrap blocks that must already be TP-
sharded (so the recomputed and compiled code is the sharded one); FSDP comes last because it
groups each (wrapped, compiled) block into one communication unit. Context-parallel ranks hold
the same parameters and different tokens, so FSDP shards over dp_shard x cp and DDP averages
over dp x cp.

All of it runs on the meta device (`build`): the model is built whole there, split, sharded,
and only then does each rank allocate and initialise what it holds; DDP, which needs real
parameters, wraps last.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from launcher import models
from launcher.config import Config
from launcher.layout import Layout, recomputed
from launcher.models.init import Plan
from launcher.parallel import pipeline_parallel  # torch.distributed.pipelining: pp > 1 only
from launcher.parallel.context_parallel import apply_cp
from launcher.parallel.data_parallel import DTYPES, apply_ddp, apply_fsdp
from launcher.parallel.expert_parallel import apply_ep, apply_moe_hooks, expert_parameter_names
from launcher.parallel.float8 import apply_float8
from launcher.parallel.materialize import materialize
from launcher.parallel.recompute import apply_ac, apply_compile
from launcher.parallel.tensor_parallel import apply_tp
from launcher.runtime.distributed import Dist


def keeps_shards(layout: Layout, compiled: bool, index: int) -> bool:
    """Whether block `index` keeps its gathered inputs' sequence shards (tensor_parallel.py):
    the saved-tensor hooks cannot run inside a checkpointed block (its recompute gathers again
    anyway) or a compiled one (the partitioner keeps the gathered tensor)."""
    checkpointed = layout.recompute in ("full", "op") and recomputed(index, layout.recompute_every)
    return not compiled and not checkpointed


def parallelize(model: nn.Module, layout: Layout, cfg: Config, d: Dist) -> nn.Module:
    """Shard a model (built identically on every rank, on the meta device or real) as the
    layout says: every axis but DDP (`replicate`). Model family, compile and precision come
    from the config; everything about the layout from `layout`."""
    if cfg.precision.fp8.value != "none":
        apply_float8(model, cfg.precision.fp8.value, emulate=d.device.type != "cuda")
    if layout.tp > 1:
        apply_tp(
            model,
            d.mesh["tp"],
            cfg.model.family,
            layout.sequence_parallel,
            layout.loss_parallel,
            keep_shards=partial(keeps_shards, layout, cfg.train.compile),
            compiled=cfg.train.compile,
        )
    expert_mesh = None
    if cfg.model.n_routed_experts and (layout.ep > 1 or layout.tp > 1):
        # Under tp the routed experts see a tp-th of the tokens each: their ranks form an
        # expert-parallel layout even with ep=1 (experts replicated over the tp ranks).
        ep_mesh, expert_mesh, flat = d.expert_meshes(layout)
        apply_ep(
            model,
            ep_mesh,
            grad_scale=expert_mesh.size() / layout.dp_cp,
            reduce_group=None if layout.fsdp_enabled else flat.get_group(),
        )
    if cfg.model.n_routed_experts and layout.cp * layout.tp > 1:
        apply_moe_hooks(model, d.split_group().get_group())
    if layout.cp > 1:
        apply_cp(model, d.mesh["cp"].get_group(), layout.context_method)
    if layout.recompute != "none":
        apply_ac(
            model,
            layout.recompute,
            layout.recompute_every,
            cfg.train.compile,
            layout.recompute_matmuls,
        )
    if cfg.train.compile:
        apply_compile(model)
    if d.mesh is None or layout.dp_cp == 1 or not layout.fsdp_enabled:
        return model
    prec = cfg.precision
    return apply_fsdp(
        model,
        d.fsdp_mesh,
        reshard_after_forward=layout.reshard_after_forward,
        param_dtype=prec.param_dtype.value,
        reduce_dtype=prec.grad_dtype.value,
        expert_mesh=expert_mesh,
    )


def replicate(model: nn.Module, layout: Layout, d: Dist) -> nn.Module:
    """DDP over dp x cp where the parameters are replicated and no pipeline averages them
    itself (Layout.grads_averaged_by_trainer); applied once the parameters are real (its
    first step checks their shapes across ranks and broadcasts rank 0's values)."""
    if d.mesh is None or layout.dp_cp == 1 or layout.fsdp_enabled:
        return model
    if layout.grads_averaged_by_trainer:
        return model
    return apply_ddp(model, d.dp_cp_mesh, d.device, skip=expert_parameter_names(model))


@dataclass
class Built:
    """This rank's share of the model: (stage index, module) for each pipeline stage it runs
    (one, index 0, without a pipeline), and the (embedding, output) names of a tied matrix."""

    stages: list[tuple[int, nn.Module]]
    tied: tuple[str, str] | None


def build(cfg: Config, layout: Layout, d: Dist, pp_rank: int) -> Built:
    """The one build path of every run and of the dry run: the whole model on the meta device
    (no memory), split into this pipeline rank's stages, parallelized, then, unless the device
    is meta itself (the dry run), allocated and initialised on the device with only what this
    rank holds (launcher/parallel/materialize.py), and finally replicated where DDP applies."""

    with torch.device("meta"):
        model = models.build(cfg.model.family, vars(cfg.model))
    model.to(DTYPES[cfg.precision.master_dtype.value])
    plan = Plan.of(model)  # the full model's parameters, for every rank's initial values
    tied = None
    if layout.pp > 1:
        tied = model.pipeline_tied()
        stages = pipeline_parallel.split(
            model, pp_rank, layout.pp, layout.stages_per_rank, layout.schedule, layout.stage_layers
        )
    else:
        stages = [(0, model)]
    stages = [(i, parallelize(m, layout, cfg, d)) for i, m in stages]
    if d.device.type != "meta":
        for _, m in stages:
            materialize(m, d.device, cfg.train.seed, plan)
    return Built([(i, replicate(m, layout, d)) for i, m in stages], tied)
