"""The learning-rate schedule: linear warmup, then cosine to min_lr at the last step."""

from __future__ import annotations

import math

import pytest

from launcher.config import TrainConfig
from launcher.optim import lr_at


def test_warmup_then_cosine_to_min_lr():
    t = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    lrs = [lr_at(s, t) for s in range(t.steps)]
    assert lrs[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    middle = 10 + (100 - 10 - 1) / 2
    assert lr_at(math.floor(middle), t) == pytest.approx(0.55, abs=0.02)


def test_no_warmup_starts_at_peak():
    t = TrainConfig(steps=5, warmup_steps=0, lr=2.0, min_lr=0.0)
    assert lr_at(0, t) == pytest.approx(2.0) and lr_at(4, t) == pytest.approx(0.0)
