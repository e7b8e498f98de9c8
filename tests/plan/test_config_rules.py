"""The config rules (launcher/plan/config_rules.py) are registered checks that declare what
they read: each declared setting is one the config has, and a config that breaks a rule is
refused under that rule's name."""

from __future__ import annotations

import dataclasses
import fnmatch

import pytest
from conftest import compose_config

from launcher.plan.config_rules import CONFIG_RULES, config_problems


def test_every_setting_a_rule_reads_is_one_the_config_has():
    cfg = compose_config([])
    known = [
        prefix + f.name
        for group in dataclasses.fields(cfg)
        for prefix, obj in [(group.name + ".", getattr(cfg, group.name))]
        if dataclasses.is_dataclass(obj)
        for f in dataclasses.fields(obj)
    ] + [g.name for g in dataclasses.fields(cfg)]
    for rule in CONFIG_RULES:
        for read in rule.reads:
            if read == "every numeric setting":
                continue
            assert fnmatch.filter(known, read), (
                f"{rule.check.__name__} reads {read}: no such setting"
            )


@pytest.mark.parametrize(
    ("overrides", "rule"),
    [
        (["train.min_lr=1.0"], "lr"),
        (["train.seq_len=4096"], "seq_len"),
        (["checkpoint.initial_load_format=hf"], "checkpoint"),
        (["profile.memory=true"], "profile"),
        (["precision.compute_dtype=bf16", "precision.param_dtype=fp32"], "precision"),
        (["model.n_kv_heads=3"], "model"),
    ],
)
def test_a_broken_rule_is_refused_under_its_name(overrides, rule):
    assert [p.rule for p in config_problems(compose_config(overrides))] == [rule]


def test_the_first_rules_stop_the_others():
    """A value out of its range is reported alone: the rules after it divide by it."""
    problems = config_problems(compose_config(["model.n_heads=0", "train.min_lr=1.0"]))
    assert [p.rule for p in problems] == ["model"]
