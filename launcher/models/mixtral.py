"""Mixtral: Llama 3 attention with a sparse mixture of SwiGLU experts in place of the MLP.

Each token goes to its top_k experts by a softmax router; their outputs are summed with the
router weights renormalised over the chosen k (launcher/models/moe.py). Plain torch, no distributed
import.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from launcher.models.llama import LlamaArgs, Transformer, TransformerBlock
from launcher.models.moe import MoE, Router


@dataclass(kw_only=True)
class MixtralArgs(LlamaArgs):
    """The model config fields this family reads (their defaults: launcher/models/config.py)."""

    n_routed_experts: int
    top_k: int
    moe_ffn_dim: int
    aux_loss_coef: float  # the Switch balance loss per forward (Mixtral trained with 0.02)


def softmax_experts(args: MixtralArgs, normalize: bool = True) -> MoE:
    """n_routed_experts SwiGLU experts of moe_ffn_dim, each token sent to its top_k by a
    softmax router, their weights renormalised over the chosen where `normalize` (Mixtral's
    and Qwen3 MoE's layer)."""
    router = Router(args.dim, args.n_routed_experts, args.top_k, normalize=normalize)
    return MoE(
        args.dim,
        args.moe_ffn_dim,
        args.n_routed_experts,
        router,
        aux_loss_coef=args.aux_loss_coef,
    )


class Mixtral(Transformer):
    def make_block(self, args: MixtralArgs, index: int) -> nn.Module:
        return TransformerBlock(args, feed_forward=softmax_experts(args))
