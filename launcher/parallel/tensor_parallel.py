"""Tensor (+ sequence) parallelism for every family (Megatron layout).

Column-parallel Q/K/V and gate/up (fc1) projections, row-parallel output and down (fc2)
projections: each block needs one all-reduce forward and one backward per sublayer. With
sequence parallelism the norms, dropout and residual stream are sharded along the sequence
(Shard(1)) and each all-reduce becomes a reduce-scatter + all-gather of the same volume.
The embedding is vocab-parallel; with loss parallelism the output projection leaves the logits
sharded over the vocabulary and the loss is computed without gathering them.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from models.moe import MoE


def apply_tp(
    model: nn.Module, mesh: DeviceMesh, family: str, sequence_parallel: bool, loss_parallel: bool
) -> None:
    """Shard `model` in place over the 1-D tp mesh."""
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    root: dict[str, object] = {}
    if family == "gpt":
        # Token and position embeddings are summed, so the vocab-parallel lookup hands back a
        # replicated tensor and the sum is then cut along the sequence.
        root["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sp:
            root["embed"] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1)
            )
    else:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if sp:
        root["norm"] = SequenceParallel()
    root["output"] = ColwiseParallel(
        input_layouts=residual,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    parallelize_module(model, mesh, root)
    model.tie_weights()  # tied halves are now the same vocab-sharded DTensor

    group = mesh.get_group()
    for block in model.layers.values():
        plan = attention_plan(block.attention, family, residual)
        if family == "deepseek":
            # MLA's rotated key is shared by all heads: each rank's backward adds only its own
            # heads' share of its gradient (Megatron's "copy to tensor-parallel region").
            block.attention.shared_key.register_forward_hook(
                lambda module, args, out: _SumGradient.apply(out, group)
            )
        # llama's attention takes (x, rope, positions); gpt's takes (x, positions).
        extra = (None, None) if family != "gpt" else (None,)
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
            # MLA's latent projections are plain (replicated) layers: they take the gathered
            # input as a local tensor. Its gradient is still whole: every path from it into
            # the heads passes a column-parallel layer, whose backward all-reduces, or the
            # shared key's hook above.
            plan["attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), *extra),
                desired_input_layouts=(Replicate(), *extra),
                use_local_output=family == "deepseek",
            )
        if isinstance(block.feed_forward, MoE):
            plan.update(moe_plan(block.feed_forward, sp, residual))
            split_routed_tokens(block.feed_forward, mesh, sp)
        else:
            up, down = ("fc1", "fc2") if family == "gpt" else ("w1", "w2")
            plan[f"feed_forward.{up}"] = ColwiseParallel()
            plan[f"feed_forward.{down}"] = RowwiseParallel(output_layouts=residual)
            if family != "gpt":
                plan["feed_forward.w3"] = ColwiseParallel()
            if sp:
                plan["feed_forward"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                )
        parallelize_module(block, mesh, plan)


def attention_plan(attention: nn.Module, family: str, residual) -> dict[str, object]:
    """Heads split over tp: the projections into heads column-parallel, the output projection
    row-parallel. MLA (deepseek) keeps its latent down-projections and their norms replicated
    (every rank computes the small latents) and splits the up-projections by head."""
    if family == "deepseek":
        into_heads = ["wq_b" if attention.q_latent else "wq", "wkv_b"]
    else:
        into_heads = ["wq", "wk", "wv"]
    plan: dict[str, object] = {f"attention.{name}": ColwiseParallel() for name in into_heads}
    plan["attention.wo"] = RowwiseParallel(output_layouts=residual)
    return plan


def moe_plan(moe: MoE, sp: bool, residual) -> dict[str, object]:
    """An MoE layer under tp: the routed experts take a tp-th of the tokens each (see
    split_routed_tokens; the experts themselves are expert-parallel, never tp-sharded), the
    router's gate is replicated with its tokens sharded (Shard(0) of the (T, D) rows, so its
    gradient sums over the tp ranks), the shared experts are a Megatron MLP on all tokens."""
    plan: dict[str, object] = {
        "feed_forward.router.gate": SequenceParallel(sequence_dim=0, use_local_output=True)
    }
    if sp:  # the routed part works on the local sequence shard as it comes
        plan["feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    if moe.shared is not None:
        plan["feed_forward.shared.w1"] = ColwiseParallel()
        plan["feed_forward.shared.w3"] = ColwiseParallel()
        plan["feed_forward.shared.w2"] = RowwiseParallel(output_layouts=residual)
        if sp:
            plan["feed_forward.shared"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    return plan


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over `group`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SplitSequence(torch.autograd.Function):
    """x (B, S, D), the same on every tp rank -> this rank's (B, S / tp, D); backward gathers
    the slices' gradients, so that every rank holds the whole (identical) gradient again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(n, dim=1)[r].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_sequence(grad.contiguous(), ctx.group), None


class _GatherSequence(torch.autograd.Function):
    """This rank's (B, S / tp, D) -> the whole (B, S, D) on every tp rank; backward keeps this
    rank's slice of the (identical) gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _gather_sequence(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=1)[r].contiguous(), None


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=1)


def _tp_moe_forward(self, x: torch.Tensor) -> torch.Tensor:
    # x: (B, S / tp, D) under sequence parallelism, else (B, S, D) on every tp rank.
    routed = self.routed(x if self.tp_sp else _SplitSequence.apply(x, self.tp_group))
    out = routed if self.tp_sp else _GatherSequence.apply(routed, self.tp_group)
    return out if self.shared is None else out + self.shared(x)


def split_routed_tokens(moe: MoE, mesh: DeviceMesh, sp: bool) -> None:
    """Each tp rank routes and computes a tp-th of the layer's tokens (its sequence shard)
    instead of all ranks repeating the whole: dropless MoE has no weights to split by tp."""
    moe.tp_group, moe.tp_sp = mesh.get_group(), sp
    moe.forward = types.MethodType(_tp_moe_forward, moe)
