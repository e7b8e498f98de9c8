"""Activation checkpointing (recompute) and per-block compile.

- full: each block keeps only its input; the whole block is recomputed in backward.
- selective: each block's attention core (scores, softmax, dropout, weighted sum) is
  recomputed from q, k and v in backward; everything else is kept: the norm inputs and outputs,
  q, k, v, the core's output, and the MLP's tensors. With fused attention the core keeps only
  q, k, v, its output and the log-sum-exp anyway, so selective saves the score matrices
  (b H s^2 per block) only when model.flash_attention=false, as Korthikanti et al. define it.
- op: per-op selective checkpointing (torch.utils.checkpoint's selective-checkpoint API, the
  policy torchtitan's "op" mode uses): each block keeps
  its input, the outputs of its matmuls (projections, the grouped experts' matmuls), of fused
  attention, and of the collectives that reduce (all-reduce, reduce-scatter), and recomputes
  the rest in backward: norms, rotations, activations, the non-fused attention core, and the
  sequence-parallel all-gathers (gathered again, as Korthikanti et al. do). Under tp a
  row-parallel matmul's output is a partial sum that only its reduction reads: the block keeps
  the reduction and recomputes the matmul (_PartialSum). `matmuls="alternate"` keeps only
  every other matmul's output, the 1st, 3rd, 5th, ... of each block's forward (torchtitan's
  rule: a Llama block keeps q, v, w1, w2 and recomputes k, wo, w3); the count runs over the
  block's mm and addmm, the partial sums recomputed under tp included.
`every` = k applies the mode to blocks 0, k, 2k, ... only (torchtitan's frequency); the others
keep everything.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from launcher.layout import recomputed
from launcher.models.layers import LogitRecord

aten, funcol = torch.ops.aten, torch.ops._c10d_functional
OP_SAVED = {
    aten.mm.default,
    aten.addmm.default,
    aten._grouped_mm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    funcol.all_reduce.default,
    funcol.reduce_scatter_tensor.default,
}


MATMULS = {aten.mm.default, aten.addmm.default}

# Profiler annotations are no computation, and FSDP's hooks on a unit inside a checkpointed
# block (the experts, on their own mesh) open a different number of them in forward and in the
# recompute, which breaks SAC's per-op replay (torchtitan#3427; pytorch#196862 ignores them).
torch.utils.checkpoint.SAC_IGNORED_OPS.update(
    {
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    }
)


class _PartialSum:
    """Under tp, a row-parallel Linear's matmul (wo, w2: weight sharded along its input) gives a
    partial sum, dim wide per token, that only its reduction reads; the reduction is saved (a
    shard of it under sequence parallelism), so keeping the partial sum too would keep the
    block's widest tensors twice. A forward pre-hook on such a Linear marks the next matmul the
    policy sees as recomputed instead. Backward's recompute replays the forward's decisions
    without asking the policy, so the mark its hooks set is left over: the block's own pre-hook
    clears it before each forward."""

    next_is_partial = False

    @classmethod
    def mark(cls, module, args) -> None:
        cls.next_is_partial = True

    @classmethod
    def clear(cls, module, args) -> None:
        cls.next_is_partial = False


def _op_policy(ctx, func, *args, counts=None, **kwargs) -> CheckpointPolicy:
    """`counts`: under matmuls="alternate", the matmuls seen so far in this block's forward and
    in its recompute (counted apart, as each may consult the policy)."""
    recompute = CheckpointPolicy.PREFER_RECOMPUTE
    if LogitRecord.computing:  # QK-clip's record: nothing of it kept (launcher/models/layers.py)
        return recompute
    if func in MATMULS:
        skip = False
        if counts is not None:
            counts[ctx.is_recompute] += 1
            skip = counts[ctx.is_recompute] % 2 == 0
        if _PartialSum.next_is_partial:
            _PartialSum.next_is_partial = False
            return recompute
        if skip:
            return recompute
    return CheckpointPolicy.MUST_SAVE if func in OP_SAVED else recompute


def _op_context(alternate: bool):
    """The selective-checkpoint contexts of one checkpointed forward (a fresh matmul count
    for each under alternate)."""
    counts = {False: 0, True: 0} if alternate else None
    return create_selective_checkpoint_contexts(partial(_op_policy, counts=counts))


def row_parallel(module: nn.Module) -> bool:
    """A Linear whose weight is a DTensor sharded along its input dimension (Shard(1))."""
    weight = getattr(module, "weight", None)
    return (
        isinstance(module, nn.Linear)
        and isinstance(weight, DTensor)
        and any(p.is_shard(1) for p in weight.placements)
    )


def apply_ac(
    model: nn.Module,
    mode: str,
    every: int = 1,
    compiled: bool = False,
    matmuls: str = "all",
) -> None:
    """Wrap blocks (full, op) or their attention cores (selective) in place; every k-th.
    Under op, eager blocks recompute their row-parallel partial sums (_PartialSum); compiled
    ones keep them: the policy then runs while the graph is traced, not in step with Python
    hooks (and compile with tp is refused on CPU, so that could not be tested here)."""
    for index, block in model.blocks():
        if not recomputed(index, every):
            continue
        if mode == "full":
            model.set_block(index, checkpoint_wrapper(block))
        elif mode == "op":
            if not compiled:
                block.register_forward_pre_hook(_PartialSum.clear)
                for sub in block.modules():
                    if row_parallel(sub):
                        sub.register_forward_pre_hook(_PartialSum.mark)
            context = partial(_op_context, matmuls == "alternate")
            model.set_block(index, checkpoint_wrapper(block, context_fn=context))
        elif mode == "selective":
            block.attention.core = checkpoint_wrapper(block.attention.core)


def apply_compile(model: nn.Module) -> None:
    """Compile each block in place (module names, hence checkpoints, are unchanged)."""
    for _, block in model.blocks():
        block.compile()
