"""Expert parallelism and what every MoE layer needs from the engine.

`apply_ep` shards each MoE layer's stacked experts along the expert dimension over the ep mesh
(DTensors, Shard(0): a checkpoint holds the whole (E, ...) stack and reshards to any ep) and
gives the layer an `ExpertDispatch` (MoE.parallelize): dispatch -> local grouped experts ->
combine:

  x (N, D) this rank's token copies sorted by global expert, counts (E,)
    -> exchange counts (all-to-all): how many copies each rank sends to each of my L = E / ep
    -> all-to-all of the copies (uneven splits)  -> (M, D) ordered by (source rank, my expert)
    -> reorder to (my expert, source rank)        -> grouped SwiGLU of my L experts
    -> the inverse reorder, the reverse all-to-all -> (N, D) in x's order.

Both all-to-alls carry gradients (backward is the opposite all-to-all). Dropless: every copy is
computed. The ep group is carved from dp_shard x cp x tp (consecutive ranks, so ep sits on the
fastest links); the experts' own data-parallel group is what remains
(launcher/runtime/distributed.py).

`apply_moe_hooks` gives every MoE layer the sum over the ranks that split its tokens (context-
and tensor-parallel ranks), which the balance losses need to equal one process's;
`balance_step` sums the expert loads over all ranks after each step (metrics, bias update).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from launcher.models.moe import MoE, grouped_swiglu
from launcher.parallel.data_parallel import average_grads, local_tensor

# The balance-loss statistics need an all-reduce with a backward (each rank's share of the
# gradient): torch.distributed.nn.functional.all_reduce. torch 2.13 marks it deprecated in
# favour of the functional collectives; until one of those carries the backward, it stays,
# and its warning (one line per rank per step) is silenced here, where it is caused.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed.nn.functional.all_reduce is deprecated",
    category=FutureWarning,
)


def moe_layers(model: nn.Module) -> list[tuple[int, MoE]]:
    """(block index, MoE) of every MoE layer this model part holds (a prediction depth's
    too: models.llama.Transformer.blocks)."""
    blocks = getattr(model, "module", model).blocks()  # under DDP, the model it wraps
    return [
        (i, block.feed_forward)
        for i, block in blocks
        if isinstance(getattr(block, "feed_forward", None), MoE)
    ]


def dispatch_plan(
    counts: torch.Tensor, ep: int, group
) -> tuple[list[int], list[int], torch.Tensor]:
    """Split sizes for the copies (send, receive) and received (ep, L) counts: row src holds how
    many copies rank src sends for each of my local experts."""
    local = counts.numel() // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # even splits: L counts per rank
    received = received.view(ep, local)
    # The layer's one host sync: both split lists in one transfer.
    send, recv = torch.stack([counts.view(ep, local).sum(1), received.sum(1)]).tolist()
    return send, recv, received


class _AllToAll(torch.autograd.Function):
    """Rows of x (N, D) to the ranks of `group`: in_splits[r] of them to rank r, out_splits[r]
    received from it. Backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list, in_splits: list, group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ExpertDispatch:
    """An MoE layer's experts sharded over the ep ranks of `group`: runs them on this rank's
    token copies (see the module's docstring). grad_scale: their gradient's correction (see
    apply_ep); reduce_group: where their gradients are averaged without FSDP (None: FSDP)."""

    def __init__(self, group, ep: int, grad_scale: float, reduce_group=None):
        self.group, self.ep, self.grad_scale, self.reduce_group = (
            group,
            ep,
            grad_scale,
            reduce_group,
        )

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        group, ep = self.group, self.ep
        weights = (experts.w1, experts.w2, experts.w3)
        weights = [_ScaleGrad.apply(local_tensor(w), self.grad_scale) for w in weights]
        if ep == 1:  # every expert here (tensor parallelism alone): nothing to send
            return grouped_swiglu(x, counts, *weights)
        send, recv, received = dispatch_plan(counts, ep, group)
        mine = _AllToAll.apply(x, recv, send, group)  # (M, D) by (source, expert)
        local = received.shape[1]
        # Sort the received blocks by (local expert, source): key l x ep + src for block
        # (src, l).
        block_key = (
            torch.arange(local, device=x.device) * ep + torch.arange(ep, device=x.device)[:, None]
        )
        row_key = block_key.flatten().repeat_interleave(received.flatten())
        order = row_key.argsort(stable=True)
        y = grouped_swiglu(mine[order], received.sum(0), *weights)
        y = torch.empty_like(y).index_copy(0, order, y)  # back to (source, expert) order
        return _AllToAll.apply(y, send, recv, group)


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel experts' parameters (each rank holds its own experts)."""
    return [
        p
        for _, moe in moe_layers(model)
        if moe.parallel.dispatch is not None
        for p in moe.experts.parameters()
    ]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Names of the expert-parallel experts' parameters (DDP must leave them alone)."""
    mine = {id(p) for p in expert_params(model)}
    return [name for name, p in model.named_parameters() if id(p) in mine]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, grad_scale: float, reduce_group=None) -> None:
    """Shard every MoE layer's experts over `ep_mesh` (1-D) and route their tokens there.

    An expert's gradient on its rank already sums what every ep rank's tokens contributed, and
    the experts' data-parallel reduction then averages over the ranks holding the same experts
    (dp_replicate x dp_shard x cp x tp / ep of them). The loss is the mean over the dp x cp
    ranks' losses, so `grad_scale` = (dp_replicate x that) / (dp x cp) corrects the average.
    Without FSDP that reduction is `sync_expert_grads` over `reduce_group`.
    """
    ep = ep_mesh.size()
    for _, moe in moe_layers(model):
        experts = moe.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            shard = distribute_tensor(p.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
        moe.parallelize(dispatch=ExpertDispatch(ep_mesh.get_group(), ep, grad_scale, reduce_group))


def sync_expert_grads(parts: list[nn.Module]) -> None:
    """Average the experts' gradients over the ranks holding the same experts, where no FSDP
    does it (DDP, ZeRO-1, or no data parallelism beside tp)."""
    moes = [moe for part in parts for _, moe in moe_layers(part) if moe.parallel.dispatch]
    group = moes[0].parallel.dispatch.reduce_group if moes else None
    if group is None or dist.get_world_size(group) == 1:
        return
    # Every layer's experts share the group: one all-reduce for them all (local shards).
    grads = [
        local_tensor(p.grad) for m in moes for p in m.experts.parameters() if p.grad is not None
    ]
    average_grads(grads, group)


def apply_moe_hooks(model: nn.Module, split_group) -> None:
    """Balance-loss statistics summed over `split_group`, the cp x tp ranks holding other tokens
    of the same sequences (None: one rank holds them all)."""
    if split_group is None:
        return
    for _, moe in moe_layers(model):
        moe.parallelize(reduce_split=lambda t, g=split_group: dist_fn.all_reduce(t, group=g))


def balance_step(
    parts: list[nn.Module], n_layers: int, e: int, microbatches: int, bias_update_speed: float
) -> dict:
    """After a step, on every rank (a collective over the world): each MoE layer's expert load
    summed over all ranks that ran it (each layer lives on one pipeline stage), DeepSeek-V3's
    bias update from it, and the step's metrics: the balance losses (summed over layers, mean
    over forwards) and each layer's max / mean load (1 is perfect balance). `e`: the routed
    experts of every MoE layer."""
    layers = [(i, moe) for part in parts for i, moe in moe_layers(part)]
    device = layers[0][1].router.load.device if layers else torch.device("cpu")
    # Per layer: load per expert, the balance losses' sum, how many ranks ran it.
    stats = torch.zeros(n_layers, e + 2, dtype=torch.float64, device=device)
    for i, moe in layers:
        stats[i, :e] = moe.router.load
        stats[i, e] = moe.aux_loss_sum.to(device)
        stats[i, e + 1] = 1.0
        moe.router.load.zero_()
        moe.aux_loss_sum = torch.zeros((), device=device)
    if dist.is_initialized():
        dist.all_reduce(stats)
    for i, moe in layers:
        if bias_update_speed and moe.router.expert_bias is not None:
            # Overloaded experts lose bias, underloaded ones gain it; every rank of the stage
            # applies the same update from the same global load.
            load = stats[i, :e]
            step = bias_update_speed * torch.sign(load.mean() - load)
            moe.router.expert_bias += step.to(moe.router.expert_bias.dtype)
    held = (stats[:, e + 1] > 0).nonzero().flatten().tolist()
    metrics = {}
    if held:
        forwards = stats[held, e + 1] * microbatches
        metrics["aux_loss"] = float((stats[held, e] / forwards).sum())
    for i in held:
        load = stats[i, :e]
        metrics[f"expert_load/layer_{i}"] = float(load.max() / load.mean().clamp_min(1e-12))
    return metrics
