"""Pipeline parallelism: cut the model into (virtual) stages and run them with a
torch.distributed.pipelining schedule.

The split comes from the layout (launcher/layout.py): layers per stage as even as
possible with the extra ones in the middle, stage s on rank s % pp for the looped schedules
and rank s or 2 pp - 1 - s for the V-shaped ones. Each stage is a pruned copy of the whole
model: layers outside its range removed, tok_embeddings / embed only on the first stage,
norm and output only on the last. The model classes allow those to be None. A tied
embedding is held by both the first and the last stage (TiedEmbedding).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._backward import stage_backward

from launcher.layout import (
    SCHEDULES,
    SINGLE,
    Layout,
    rank_stages,
    split_layers,
    stage_owner,
    stage_starts,
)
from launcher.models.layers import LogitRecord
from launcher.models.moe import MoE
from launcher.parallel.data_parallel import local_tensor

# torch's class for each of layout.SCHEDULES, in that order.
SCHEDULE_CLASSES = dict(
    zip(
        SCHEDULES,
        (
            ScheduleGPipe,
            Schedule1F1B,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
            ScheduleDualPipeV,
        ),
        strict=True,
    )
)


def stage_module(
    model: nn.Module, first_layer: int, n_layers: int, first: bool, last: bool
) -> nn.Module:
    """A copy of `model` holding layers [first_layer, first_layer + n_layers) only, and what
    else the model keeps on a first or last stage (its as_stage)."""
    stage = copy.deepcopy(model)
    keep = {str(i) for i in range(first_layer, first_layer + n_layers)}
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    stage.as_stage(first, last)
    return stage


def split(
    model: nn.Module, pp_rank: int, pp: int, v: int, schedule: str, counts: tuple[int, ...] = ()
) -> list[tuple[int, nn.Module]]:
    """(stage index, module) for every stage this pipeline rank runs, in stage order; `counts`
    gives the layers per stage (the planner's split), () the even default."""
    counts = list(counts) or split_layers(len(model.layers), pp * v)
    starts = stage_starts(counts)
    n_stages = pp * v
    return [
        (s, stage_module(model, starts[s], counts[s], s == 0, s == n_stages - 1))
        for s in sorted(rank_stages(pp_rank, pp, v, schedule))
    ]


@dataclass
class TiedEmbedding:
    """A tied embedding under a pipeline, kept as Megatron keeps it: stage 0 holds the matrix
    as its embedding and the last stage a copy as its output projection (or as the token table
    its multi-token prediction reads: the model's pipeline_tied), both from the same
    initialisation. Their gradients are summed after backward (each is a part of the one
    matrix's gradient), so both take the same steps; the copy is counted once in the gradient
    norm and its optimizer states are saved under the embedding's name. On this rank:
    `embedding` if it holds stage 0, `copy` if it holds the last stage, `group` the two
    pipeline ranks (None when one rank holds both stages, as the V schedules place them)."""

    names: tuple[str, str]  # (embedding, its copy on the last stage)
    embedding: nn.Parameter | None
    copy: nn.Parameter | None
    group: object | None

    @torch.no_grad()
    def sync_grads(self) -> None:
        import torch.distributed as dist

        held = [local_tensor(p.grad) for p in (self.embedding, self.copy) if p is not None]
        if len(held) == 2:
            held[0].add_(held[1])
            held[1].copy_(held[0])
        elif held:
            dist.all_reduce(held[0], group=self.group)


class Stage(PipelineStage):
    """torch's stage, except that MoE layers do not count the forward it runs once more to
    learn the shapes it sends (on the first step) in their expert loads and balance losses,
    nor QK-clip's records its logits (a later stage's inputs there are not the batch's).
    Not eval mode: torch then runs backward through it, and recompute must see the same
    graph."""

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        # The split schedules' weight pass is one autograd call per group of parameters, each
        # a graph task of its own, and a checkpointed block is recomputed once per graph task
        # that reaches it: as many times as its graph groups its parameters, which differs
        # between ranks when routed experts get no tokens on one of them. Their recomputed
        # all-to-alls then fell out of step (deepseek_v3_debug, dualpipev, recompute=full, step
        # 10: 512 tokens received in forward, 509 in the recompute). One GraphExecGroup for the
        # whole weight pass recomputes each block once there. (The input pass is a graph task
        # of its own and recomputes once more: it needs some of the same saved tensors, which
        # one group for both passes does not allow.)
        from torch.utils.checkpoint import GraphExecGroup

        with GraphExecGroup():
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    def _forward_metadata_inference(self, *args, **kwargs):
        moes = [m for m in self.submod.modules() if isinstance(m, MoE)]
        for moe in moes:
            moe.parallelize(count_steps=False)
        model = getattr(self.submod, "module", self.submod)  # under DDP, the model it wraps
        counted = getattr(model, "count_steps", None)  # the model's own sums (deepseek's MTP)
        if counted is not None:
            model.count_steps = False
        cores = [m for m in self.submod.modules() if isinstance(m, LogitRecord) and m.track_logits]
        for core in cores:
            core.track_logits = False
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            for core in cores:
                core.track_logits = True
            for moe in moes:
                moe.parallelize(count_steps=True)
            if counted is not None:
                model.count_steps = counted


class ReshardingStage(Stage):
    """A stage whose FSDP module reshards its parameters and reduce-scatters its gradients after
    every micro-batch's backward (pipeline.reshard_each_microbatch). torch's stage keeps both
    until the last micro-batch: it turns resharding and gradient sync off before each backward
    and runs FSDP's post-backward by hand once all micro-batches are done (which then finds
    nothing left to reduce). Full backward only; the rules refuse the split schedules."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(
            bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
        )
        return grads, None


def build_schedule(
    stages: list[tuple[int, nn.Module]],
    n_stages: int,
    schedule: str,
    microbatches: int,
    loss_fn,
    mesh: DeviceMesh,
    device: torch.device,
    reshard_each_microbatch: bool = False,
):
    """The schedule object driving this rank's stages over the pp process group."""
    group = mesh.get_group()
    stage_cls = ReshardingStage if reshard_each_microbatch else Stage
    pipeline_stages = [
        stage_cls(module, index, n_stages, device, group=group) for index, module in stages
    ]
    cls = SCHEDULE_CLASSES[schedule]
    if schedule in SINGLE:
        return cls(pipeline_stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    return cls(pipeline_stages, n_microbatches=microbatches, loss_fn=loss_fn)


@torch.no_grad()
def forward_only(
    stages: dict[int, nn.Module],
    lay: Layout,
    mesh: DeviceMesh,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn,
    positions: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Evaluation: run the batch through the stages in order, passing activations point to point
    (not every schedule has a forward-only mode) in the layout's placement; returns the loss on
    the last stage's rank.
    `positions`: of the tokens in x (context parallelism), None meaning 0..S-1; `documents`:
    document masking (models.layers)."""
    import torch.distributed as dist

    n_stages, schedule = lay.n_stages, lay.schedule
    pp, me, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    peer = lambda stage: dist.get_global_rank(group, stage_owner(stage, pp, schedule))  # noqa: E731
    h = x
    for s in range(n_stages):
        if stage_owner(s, pp, schedule) != me:
            continue
        if s > 0 and stage_owner(s - 1, pp, schedule) != me:  # (B, S, D) or a sequence shard of it
            shape = torch.empty(3, dtype=torch.int64, device=x.device)
            dist.recv(shape, src=peer(s - 1), group=group)
            h = torch.empty(*shape.tolist(), dtype=torch.float32, device=x.device)
            dist.recv(h, src=peer(s - 1), group=group)
            h = h.to(torch.get_default_dtype())
        h = stages[s](h, positions, documents)
        if s == n_stages - 1:
            return loss_fn(h, y)
        if stage_owner(s + 1, pp, schedule) != me:
            dist.send(
                torch.tensor(h.shape, dtype=torch.int64, device=x.device),
                dst=peer(s + 1),
                group=group,
            )
            dist.send(h.float().contiguous(), dst=peer(s + 1), group=group)
    return None
