"""Explicit positions: a model fed a permutation of the sequence together with each token's
position computes, token for token, what it computes on the sequence in order.

This is the property context parallelism relies on (a cp rank holds chunks from two places of
every sequence): RoPE angles and learned position embeddings follow the given positions, and
the causal mask compares positions, not indices. Plain torch, one process.
"""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config

from launcher import models
from launcher.models.families import FAMILIES
from launcher.parallel.context_parallel import chunk_positions


def build(family: str, fused: bool) -> torch.nn.Module:
    """The family's debug preset cut to 2 layers (deepseek's: an MLA block with a dense MLP,
    then one with routed experts), without dropout."""
    cfg = compose_config([f"model={FAMILIES[family].debug}", "model.n_layers=2"])
    args = {**vars(cfg.model), "max_seq_len": 64, "flash_attention": fused, "dropout": 0.0}
    model = models.build(family, args)
    model.init_weights(0)
    return model.eval()


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "unfused"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batched", [False, True], ids=["(S,)", "(B, S)"])
def test_permuted_tokens_with_positions_match_in_order(family, fused, batched):
    torch.manual_seed(0)
    model = build(family, fused)
    tokens = torch.randint(0, 96, (2, 32))
    # A load-balanced cp rank's tokens (chunks 1 and 6 of 8), then everything else, shuffled.
    mine = chunk_positions(32, 4, 1, load_balance=True)
    rest = torch.tensor([i for i in range(32) if i not in set(mine.tolist())])
    perm = torch.cat([mine, rest[torch.randperm(len(rest))]])
    positions = perm.expand(2, -1) if batched else perm
    with torch.no_grad():
        expected = model(tokens)[:, perm]
        got = model(tokens[:, perm], positions)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_positions_are_not_ignored():
    """The check above is not vacuous: the same permuted tokens at positions 0..S-1 differ."""
    model = build("llama", True)
    tokens = torch.randint(0, 96, (1, 32))
    perm = torch.randperm(32)
    with torch.no_grad():
        in_order = model(tokens)[:, perm]
        wrong = model(tokens[:, perm])
    assert (wrong - in_order).abs().max() > 1e-2
