"""The planner against published runs it was not fitted to (`python -m launcher.plan.calibrate
--published`; launcher/plan/published.py names each run, its source and what it fits)."""

from __future__ import annotations

import re

import pytest
from conftest import compose_config

from launcher.plan import calibrate


@pytest.fixture(scope="module")
def report():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        calibrate.main(["--published"])
    return out.getvalue()


def figure(report: str, pattern: str) -> float:
    return float(re.search(pattern, report).group(1))


def test_held_out_mfu_within_five_points_on_average_and_eight_on_each(report):
    assert figure(report, r"held-out MFU: mean absolute error ([0-9.]+) points") <= 5.0
    assert figure(report, r"held-out MFU: .* worst ([0-9.]+) \(") <= 8.0


def test_held_out_tokens_per_s_of_fsdp2_engines_within_fifteen_percent(report):
    assert figure(report, r"held-out tokens/s, fsdp2: mean absolute error ([0-9.]+)%") <= 15.0


def test_every_published_peak_memory_within_ten_percent(report):
    assert figure(report, r"peak memory: worst error ([0-9.]+)%") <= 10.0


def test_each_stack_is_fitted_to_its_own_fit_run_only(report):
    """The fused stacks' scales are fitted (so their fit runs land on the published figure)
    and each lies between torchtitan's eager H100 runs and the A100 fit's 1."""
    te = figure(report, r"te ([0-9.]+) \(fitted")
    meta = figure(report, r"meta ([0-9.]+) \(fitted")
    h100 = compose_config(["hardware=h100_80g"]).hardware.efficiency_scale
    assert h100 < te < 1 and h100 < meta < 1
    for line in report.splitlines():
        if "│ fit " in line and ("NeMo 8B" in line or "on 8,192" in line):
            assert re.search(r"[+-]0\.\d%", line), line
