"""Activation checkpointing (recompute) and per-block compile.

- full: each block keeps only its input; the whole block is recomputed in backward.
- selective: each block's attention core (scores, softmax, dropout, weighted sum) is
  recomputed from q, k and v in backward; everything else is kept: the norm inputs and outputs,
  q, k, v, the core's output, and the MLP's tensors. With fused attention the core keeps only
  q, k, v, its output and the log-sum-exp anyway, so selective saves the score matrices
  (b H s^2 per block) only when model.flash_attention=false, as Korthikanti et al. define it.
- op: per-op selective checkpointing (torch.utils.checkpoint's selective-checkpoint API, the
  policy torchtitan's "op" mode uses, without its every-other-matmul rule): each block keeps
  its input, the outputs of its matmuls (projections, the grouped experts' matmuls), of fused
  attention, and of the collectives that reduce (all-reduce, reduce-scatter), and recomputes
  the rest in backward: norms, rotations, activations, the non-fused attention core, and the
  sequence-parallel all-gathers (gathered again, as Korthikanti et al. do).
`every` = k applies the mode to blocks 0, k, 2k, ... only (torchtitan's frequency); the others
keep everything.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from launcher.layout import recomputed

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


def _op_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in OP_SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: str, every: int = 1) -> None:
    """Wrap blocks (full, op) or their attention cores (selective) in place; every k-th."""
    for name, block in model.layers.named_children():
        if not recomputed(int(name), every):
            continue
        if mode == "full":
            model.layers[name] = checkpoint_wrapper(block)
        elif mode == "op":
            context = partial(create_selective_checkpoint_contexts, _op_policy)
            model.layers[name] = checkpoint_wrapper(block, context_fn=context)
        elif mode == "selective":
            block.attention.core = checkpoint_wrapper(block.attention.core)


def apply_compile(model: nn.Module) -> None:
    """Compile each block in place (module names, hence checkpoints, are unchanged)."""
    for block in model.layers.values():
        block.compile()
