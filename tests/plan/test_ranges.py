"""Every numeric setting has a range (launcher/plan/ranges.py), and a value outside it is
refused by name before any other rule or estimate reads it."""

from __future__ import annotations

import copy
import functools

import pytest
from conftest import compose_config

from launcher.plan import make_plan
from launcher.plan.ranges import RANGES, Range, numeric_keys

DEGREES = {f"parallel.{a}" for a in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")}


def test_every_numeric_setting_has_a_range():
    keys = set(numeric_keys())
    assert keys - DEGREES - set(RANGES) == set(), "a numeric setting without a range"
    assert set(RANGES) - keys == set(), "a range for a setting the schema does not have"


@pytest.mark.parametrize(
    ("rng", "inside", "outside"),
    [
        (Range(0, 1, open_high=True), [0, 0.5], [1, -0.1, float("nan")]),
        (Range(0, 1, open_low=True, open_high=True), [0.5], [0, 1]),
        (Range(low=1), [1, 10**12], [0, float("inf")]),
        (Range(low=0, open_low=True), [1e-30, 1e30], [0, float("-inf")]),
    ],
)
def test_a_range_holds_finite_values_inside_it_only(rng, inside, outside):
    assert all(rng.holds(v) for v in inside)
    assert not any(rng.holds(v) for v in outside)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lr=nan", "train.lr=nan must be > 0"),
        ("train.lr=inf", "train.lr=inf must be > 0"),
        ("train.beta1=2.0", "train.beta1=2.0 must be in [0, 1)"),
        ("model.head_dim=0", "model.head_dim=0 must be >= 1 (unset: dim // n_heads)"),
        ("train.seed=-1", "train.seed=-1 must be in [0, 9.22337e+18]"),
        ("hardware.peak_tflops=inf", "hardware.peak_tflops=inf must be > 0"),
        ("train.timeout_s=inf", "train.timeout_s=inf must be > 0 (seconds)"),
        ("train.grad_clip=nan", "train.grad_clip=nan must be >= 0 (0 turns clipping off)"),
        ("hardware.efficiency_scale=nan", "hardware.efficiency_scale=nan must be > 0"),
        ("logging.log_interval=-5", "logging.log_interval=-5 must be >= 1"),
        ("model.norm_eps=-1", "model.norm_eps=-1.0 must be > 0"),
        ("model.rope_theta=0", "model.rope_theta=0.0 must be > 0 (the RoPE base)"),
        ("model.aux_loss_coef=nan", "model.aux_loss_coef=nan must be >= 0"),
        ("train.weight_decay=nan", "train.weight_decay=nan must be >= 0"),
        ("train.max_skipped_steps=-1", "train.max_skipped_steps=-1 must be >= 0"),
    ],
)
def test_a_value_outside_its_range_is_refused_by_name(override, message):
    plan = make_plan(compose_config([override]))
    text = " ".join(str(p) for p in plan.errors)
    assert message in text
    assert not plan.valid


def outside(rng: Range, kind: type):
    """A value of `kind` just outside `rng` (NaN for an unbounded float)."""
    if rng.low is not None:
        return rng.low if rng.open_low else rng.low - 1
    return float("nan")


@functools.cache
def default_config():
    return compose_config([])


def with_value(key: str, value):
    """The default config with one setting changed (composing each would take 60 ms)."""
    cfg = copy.deepcopy(default_config())
    *path, last = key.split(".")
    node = cfg
    for part in path:
        node = getattr(node, part)
    setattr(node, last, value)
    return cfg


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_setting_out_of_range_is_refused_without_crashing_a_rule(key):
    kind = numeric_keys()[key]
    for value in (outside(RANGES[key], kind), *([float("nan"), float("inf")] * (kind is float))):
        plan = make_plan(with_value(key, value))
        assert f"{key}={value}" in " ".join(str(p) for p in plan.errors), value
