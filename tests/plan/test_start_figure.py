"""The plan's memory at start (Memory.start, the "at start" row): the rank's share of the
parameters as launcher.parallel.build allocates them, in the master dtype, plus one band of
initialisation tiles and the reserve, against the model's own parameter count."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config

from launcher import models
from launcher.models.tiles import band_bytes
from launcher.plan import make_plan
from launcher.plan.estimate import build_transient


def parameters(cfg) -> int:
    with torch.device("meta"):
        model = models.build(cfg.model.family, vars(cfg.model))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("ranks", [1, 4])
def test_start_is_the_share_as_built_plus_one_band_and_the_reserve(ranks):
    cfg = compose_config(
        [f"hardware.devices_per_node={ranks}", f"parallel.dp_shard={ranks}", "precision=fp32"]
    )
    plan = make_plan(cfg)
    assert plan.ok, plan.errors
    m, ctx = plan.memory, plan.context
    widest = max(cfg.model.dim, cfg.model.ffn_dim)
    assert build_transient(cfg.model) == band_bytes(widest)
    share = 4 * parameters(cfg) / ranks
    assert m.start - ctx.reserve - band_bytes(widest) == pytest.approx(share, rel=1e-3)
    assert plan.fits and m.start <= m.total
