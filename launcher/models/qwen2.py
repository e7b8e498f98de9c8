"""Qwen2 (dense): Llama 3's block with biases on the query, key and value projections (none on
the output projection or the MLP), as transformers' Qwen2ForCausalLM."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.models.init import ZEROS, Rule
from launcher.models.llama import Attention, LlamaArgs, Transformer, TransformerBlock


@dataclass(kw_only=True)
class Qwen2Args(LlamaArgs):
    """The model config fields this family reads (their defaults: launcher/models/config.py)."""


class Qwen2(Transformer):
    def make_block(self, args: Qwen2Args, index: int) -> TransformerBlock:
        return TransformerBlock(args, attention=Attention(args, qkv_bias=True))

    def init_rule(self, name: str) -> Rule:
        """Llama's, the biases at zero (as transformers starts them)."""
        return ZEROS if name.endswith(".bias") else super().init_rule(name)
