"""The learning-rate schedules: linear warmup, then cosine, linear, constant or
warmup-stable-decay to min_lr at the last step."""

from __future__ import annotations

import math

import pytest

from launcher.config import TrainConfig
from launcher.training.optim import lr_at


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


# Each schedule's value at chosen steps of 100 with 10 of warmup (lr 1.0 -> min_lr 0.1); the
# decay runs over steps 10..99, progress (step - 10) / 89.
SCHEDULES = {
    "cosine": {0: 0.1, 9: 1.0, 10: 1.0, 99: 0.1},
    "linear": {0: 0.1, 10: 1.0, 99: 0.1, 10 + 89 // 2: 0.1 + 0.9 * (1 - 44 / 89)},
    "constant": {0: 0.1, 9: 1.0, 10: 1.0, 50: 1.0, 99: 1.0},
    # decay_fraction 0.2: flat until progress 0.8 (step 81.2), then linear to 0.1 at step 99.
    "wsd": {10: 1.0, 50: 1.0, 81: 1.0, 90: 0.1 + 0.9 * (1 - 80 / 89) / 0.2, 99: 0.1},
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_each_schedule_at_chosen_steps(schedule):
    t = TrainConfig(
        steps=100, warmup_steps=10, lr=1.0, min_lr=0.1, lr_schedule=schedule, decay_fraction=0.2
    )
    for step, want in SCHEDULES[schedule].items():
        assert lr_at(step, t) == pytest.approx(want), (schedule, step)
    lrs = [lr_at(s, t) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))  # never rises after warmup
