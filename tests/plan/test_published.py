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
    assert figure(report, r"held-out MFU, bf16: mean absolute error ([0-9.]+) points") <= 5.0
    assert figure(report, r"held-out MFU, bf16: .* worst ([0-9.]+) \(") <= 8.0


def test_held_out_tokens_per_s_of_fsdp2_engines_within_fifteen_percent(report):
    assert figure(report, r"tokens/s, fsdp2 bf16: mean absolute error ([0-9.]+)%") <= 15.0


def test_held_out_fp8_runs_within_the_bf16_runs_bars(report):
    """The FP8 rows this engine could run as published (FSDP, CP 2, rowwise TP) held to the
    bf16 rows' bars, on average and each; the rows whose engine did what this one does not
    (float8 TP, Transformer Engine's fused casts) are shown, neither fitted nor held."""
    assert figure(report, r"held-out MFU, fp8: mean absolute error ([0-9.]+) points") <= 5.0
    assert figure(report, r"held-out MFU, fp8: .* worst ([0-9.]+) \(") <= 8.0
    assert figure(report, r"tokens/s, fsdp2 fp8: mean absolute error ([0-9.]+)%") <= 15.0
    assert int(figure(report, r"held-out MFU, fp8: .*\(([0-9]+) runs\)")) >= 4
    shown = [line for line in report.splitlines() if "│ shown: " in line]
    assert len(shown) == 5 and all("FP8" in line for line in shown)


def test_every_published_peak_memory_within_ten_percent(report):
    assert figure(report, r"peak memory: worst error ([0-9.]+)%") <= 10.0


def test_each_stack_is_fitted_to_its_own_fit_run_only(report):
    """The fused stacks' scales are fitted (so their fit runs land on the published figure)
    and each lies between torchtitan's eager H100 runs and the A100 fit's 1."""
    te = figure(report, r"te ([0-9.]+) \(fitted")
    meta = figure(report, r"meta ([0-9.]+) \(fitted")
    torchtitan = compose_config(["hardware=h100_hbm2e"]).hardware.efficiency_scale
    assert torchtitan < te < 1 and torchtitan < meta < 1
    for line in report.splitlines():
        if "│ fit " in line and ("NeMo 8B" in line or "on 8,192" in line):
            assert re.search(r"[+-]0\.\d%", line), line
