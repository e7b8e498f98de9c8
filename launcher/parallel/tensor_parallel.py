"""Tensor (+ sequence) parallelism for every family (Megatron layout).

Column-parallel Q/K/V and gate/up (fc1) projections, row-parallel output and down (fc2)
projections: each block needs one all-reduce forward and one backward per sublayer. With
sequence parallelism the norms, dropout and residual stream are sharded along the sequence
(Shard(1)) and each all-reduce becomes a reduce-scatter + all-gather of the same volume.
The embedding is vocab-parallel; with loss parallelism the output projection leaves the logits
sharded over the vocabulary and the loss is computed without gathering them.

Under sequence parallelism the column-parallel projections all-gather their input (a norm's
sequence shard) in forward; autograd would then keep the gathered whole-sequence tensor for
their weight gradients. `gather_keeping_shard` keeps the shard instead and gathers it again in
backward (Korthikanti et al. 2022), so a block keeps what their table counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from launcher.models import families
from launcher.models.families import COLUMN, HEADS, ROW
from launcher.models.moe import MoE
from launcher.parallel.materialize import when_real


def _styles(residual) -> dict[str, Callable[[], object]]:
    """The records' TP styles (launcher/models/families.py) as torch's, the residual stream between
    blocks laid out as `residual`."""
    return {
        COLUMN: ColwiseParallel,
        ROW: lambda: RowwiseParallel(output_layouts=residual),
        # (B, S, heads, E) in, the rank's heads: a replicated gain whose gradient is summed
        # over tp (each rank's holds its own heads' share).
        HEADS: lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
    }


def apply_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    family: str,
    sequence_parallel: bool,
    loss_parallel: bool,
    keep_shards: Callable[[int], bool] = lambda index: True,
    compiled: bool = False,
) -> None:
    """Shard `model` in place over the 1-D tp mesh. keep_shards(block index): under sequence
    parallelism, whether that block keeps the sequence shard of each gathered projection input
    for backward rather than the gathered tensor (autograd's saved-tensor hooks: not inside a
    checkpointed or compiled block, whose recompute or partitioner decides what is kept).
    compiled: the blocks will be compiled (see `waited_output`)."""
    sp = sequence_parallel
    fam = families.family(family)
    gathered_inputs = []  # (module name in a block, whether it takes a local tensor)
    residual = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    styles = _styles(residual)
    root: dict[str, object] = {}
    if fam.tp_embedding_sum:
        # Token and position embeddings are summed, so the vocab-parallel lookup hands back a
        # replicated tensor and the sum is then cut along the sequence.
        root[fam.tp_embedding] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()
        )
        if sp:
            root[fam.tp_embedding_sum] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1)
            )
    else:
        root[fam.tp_embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if sp:
        root["norm"] = SequenceParallel()
        # Multi-token prediction's depths: their norms and projection run on the rank's
        # sequence shard (replicated weights, gradients summed over tp), as the final norm.
        for name in families.family(family).ahead(model.args):
            if ".block." not in name:
                root[name.rsplit(".", 1)[0]] = SequenceParallel(use_local_output=True)
    root["output"] = ColwiseParallel(
        input_layouts=residual,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    # A pipeline stage holds some of these only: torch warns, with the whole module printed,
    # for every plan key it cannot find, so the plan names only what this stage holds.
    parallelize_module(model, mesh, {k: v for k, v in root.items() if _find(model, k)})
    model.tie_weights()  # tied halves are now the same vocab-sharded DTensor
    # torch 2.13's embedding backward hands the vocab-sharded table a replicated (whole)
    # gradient; each rank keeps its own rows, as the table itself (the memory ledger found
    # it: vocab x dim more per rank until the optimizer step).
    embedding = _find(model, fam.tp_embedding)
    if embedding is not None:  # a pipeline stage after the first has none

        def regrid() -> None:
            table = embedding.weight
            table.register_hook(lambda g: g.redistribute(table.device_mesh, table.placements))

        when_real(embedding, regrid)
        if compiled:
            waited_output(_find(model, fam.tp_embedding_sum or fam.tp_embedding))

    group = mesh.get_group()
    for index, block in model.blocks():
        plan = {
            name: styles[style]()
            for name, style in fam.tp_block.items()
            if _find(block, name) is not None
        }
        for name in fam.tp_shared:  # read by every head, each rank holding its own heads
            block.get_submodule(name).register_forward_hook(
                lambda module, args, out: _SumGradient.apply(out, group)
            )
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
            # A sublayer whose replicated layers take the gathered input as a local tensor
            # (MLA's latent projections): its gradient is still whole, as every path from it
            # into the heads passes a column-parallel layer, whose backward all-reduces, or a
            # tp_shared module's hook above.
            gathered_inputs.append(("attention", "attention" in fam.tp_local_input))
        if isinstance(block.feed_forward, MoE):
            plan.update(moe_plan(block.feed_forward, sp, residual))
            split_routed_tokens(block.feed_forward, mesh, sp)
        elif sp:
            gathered_inputs.append(("feed_forward", False))
        parallelize_module(block, mesh, plan)
        if sp and isinstance(block.feed_forward, MoE) and block.feed_forward.shared is not None:
            gathered_inputs.append(("feed_forward.shared", False))
        for name, local in gathered_inputs:
            module = block.get_submodule(name)
            gather_sequence_input(module, mesh, local, keep_shards(int(index)))
        gathered_inputs.clear()


def _find(module: nn.Module, path: str) -> nn.Module | None:
    """The submodule at a dotted path, or None where a part of it is missing or None (a
    pipeline stage without the embedding, a block without that projection)."""
    for part in path.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return None
    return module


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
    if moe.shared is not None:  # under sp its input is gathered by apply_tp
        styles = _styles(residual)
        plan.update({name: styles[style]() for name, style in families.TP_ROUTED.items()})
    return plan


class _Regather:
    """The sequence shard of one gathered input, gathered again in backward once for all the
    views of it that autograd saved (q, k and v projections share one input), and released
    after the last of them is unpacked. The shard itself is saved through the saved-tensor
    hooks that were active around the module (`outer`: e.g. offloading, or a measurement)."""

    def __init__(self, shard: torch.Tensor, group, outer):
        self.outer, self.group = outer, group
        self.shard = shard if outer is None else outer[0](shard)
        self.refs, self.full = 0, None

    def take(self) -> torch.Tensor:
        if self.full is None:
            shard = self.shard if self.outer is None else self.outer[1](self.shard)
            self.full = _gather_sequence(shard.contiguous(), self.group)
        full, self.refs = self.full, self.refs - 1
        if self.refs == 0:
            self.full = None
        return full


@dataclass
class _GatheredView:
    """What is saved in place of a view of the gathered tensor: how to cut it from a gather."""

    holder: _Regather
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    spec: object  # the DTensor's spec, or None for a local tensor

    def rebuild(self) -> torch.Tensor:
        view = self.holder.take().as_strided(self.size, self.stride, self.offset)
        if self.spec is None:
            return view
        s = self.spec
        return DTensor.from_local(
            view, s.mesh, s.placements, shape=s.shape, stride=s.tensor_meta.stride
        )


@dataclass
class _Passed:
    value: object  # what the outer pack hook made of a tensor this module saved


def _storage(t: torch.Tensor) -> int:
    """The data pointer of t's storage (a DTensor's local one; a collective's output that
    nothing has waited for yet is a wrapper of the tensor it fills)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if isinstance(local, AsyncCollectiveTensor):
        local = local.elem
    return local.untyped_storage().data_ptr()


def waited_output(module: nn.Module) -> None:
    """Hand on `module`'s output as a plain tensor rather than the wrapper of a collective's
    output that nothing has waited for yet (AsyncCollectiveTensor: the vocab-parallel
    embedding's all-reduce or reduce-scatter). A compiled block that takes such a wrapper
    returns no gradient for it in torch 2.13: the embedding got none, and the next backward
    failed in DTensor's Redistribute ('Tensor' object has no attribute '_local_tensor',
    llama3_debug tp=2 on CPU). A copy of the residual stream once per micro-batch; the hook
    runs outside the compiled blocks (a hook on a compiled block is compiled with it)."""

    def hook(_module, _args, out):
        return out.clone() if isinstance(out, AsyncCollectiveTensor) else out

    module.register_forward_hook(hook)


def gather_sequence_input(module: nn.Module, mesh: DeviceMesh, local: bool, keep: bool) -> None:
    """Gather `module`'s first input from its sequence shard (Shard(1)) to the whole sequence
    (Replicate; a local tensor when `local`), what PrepareModuleInput does; with `keep`, what
    autograd saves of the gathered tensor while the module runs is the shard, gathered again
    in backward. Every other saved tensor goes through the hooks active around the module."""
    group = mesh.get_group()

    def pre_hook(mod, args):
        x = args[0]
        shard = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(1)])
        gathered = shard.redistribute(mesh, [Replicate()])
        if keep and torch.is_grad_enabled():
            whole = gathered._local_tensor
            # The saved tensors are views of `whole`, cut again from a fresh gather of the
            # same (contiguous) layout.
            assert whole.is_contiguous() and whole.storage_offset() == 0
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            holder = _Regather(shard.to_local().detach(), group, outer)
            ptr = _storage(whole)

            def pack(t):
                if _storage(t) == ptr:
                    holder.refs += 1
                    spec = t._spec if isinstance(t, DTensor) else None
                    v = t._local_tensor if spec is not None else t
                    return _GatheredView(holder, v.shape, v.stride(), v.storage_offset(), spec)
                return t if outer is None else _Passed(outer[0](t))

            def unpack(p):
                if isinstance(p, _GatheredView):
                    return p.rebuild()
                return outer[1](p.value) if isinstance(p, _Passed) else p

            mod._saved_hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            mod._saved_hooks.__enter__()
        return (gathered.to_local() if local else gathered, *args[1:])

    def post_hook(mod, args, out):
        hooks = mod.__dict__.pop("_saved_hooks", None)
        if hooks is not None:
            hooks.__exit__(None, None, None)

    module.register_forward_pre_hook(pre_hook)
    module.register_forward_hook(post_hook)


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


def split_routed_tokens(moe: MoE, mesh: DeviceMesh, sp: bool) -> None:
    """Each tp rank routes and computes a tp-th of the layer's tokens (its sequence shard)
    instead of all ranks repeating the whole: dropless MoE has no weights to split by tp.
    Under sequence parallelism the layer's input already is that shard."""
    if sp:
        return
    group = mesh.get_group()
    moe.parallelize(
        split_tokens=lambda x: _SplitSequence.apply(x, group),
        gather_tokens=lambda y: _GatherSequence.apply(y, group),
    )
