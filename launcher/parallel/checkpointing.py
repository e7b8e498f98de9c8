"""Activation checkpointing (recompute) and per-block compile.

- full: each block keeps only its input; the whole block is recomputed in backward.
- selective: each block's attention core (scores, softmax, dropout, weighted sum) is
  recomputed from q, k and v in backward; everything else is kept: the norm inputs and outputs,
  q, k, v, the core's output, and the MLP's tensors. With fused attention the core keeps only
  q, k, v, its output and the log-sum-exp anyway, so selective saves the score matrices
  (b H s^2 per block) only when model.flash_attention=false, as Korthikanti et al. define it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_ac(model: nn.Module, mode: str) -> None:
    """Wrap blocks (full) or their attention cores (selective) in place."""
    for name, block in model.layers.named_children():
        if mode == "full":
            model.layers[name] = checkpoint_wrapper(block)
        elif mode == "selective":
            block.attention.core = checkpoint_wrapper(block.attention.core)


def apply_compile(model: nn.Module) -> None:
    """Compile each block in place (module names, hence checkpoints, are unchanged)."""
    for block in model.layers.values():
        block.compile()
