"""Compute efficiency per hardware generation and under train.compile (docs/planner.md,
"Calibration"): the A100 fit times the preset's efficiency_scale times EFFICIENCY_COMPILED, unless
hardware.efficiency gives a measured one."""

from __future__ import annotations

import re

import pytest
from conftest import compose_config

from launcher.plan import calibrate, make_plan
from launcher.plan.estimate import EFFICIENCY_COMPILED, compute_efficiency

# Llama 3 8B, FSDP over one node: tp=1, so compile changes no saved activation (compiled
# sequence parallelism keeps its gathered inputs: the activation count's business, not this).
FSDP_8B = ["model=llama3_8b", "train.seq_len=4096", "train.global_batch_size=64"]


def plan(*overrides: str):
    p = make_plan(compose_config(list(overrides)))
    assert p.estimate is not None, p.errors
    return p


def test_hopper_reaches_its_scale_of_the_a100_fit():
    a100, h100 = plan(*FSDP_8B, "hardware=a100_80g"), plan(*FSDP_8B, "hardware=h100_80g")
    assert a100.cfg.hardware.efficiency_scale == 1.0
    assert h100.cfg.hardware.efficiency_scale == 0.62
    assert a100.context.efficiency == compute_efficiency(4096)
    assert h100.context.efficiency == pytest.approx(0.62 * a100.context.efficiency)
    # Same layout, same FLOPs: compute time goes as 1 / (peak x efficiency).
    ratio = a100.estimate.time.compute / h100.estimate.time.compute
    assert ratio == pytest.approx(989 * 0.62 / 312)


@pytest.mark.parametrize("preset", ["h800", "h200", "b200"])
def test_the_other_hopper_and_blackwell_presets_take_the_h100_scale(preset):
    assert plan(f"hardware={preset}").cfg.hardware.efficiency_scale == 0.62


def test_compile_divides_compute_time_by_its_factor_and_leaves_memory():
    eager = plan(*FSDP_8B, "hardware=h100_80g")
    compiled = plan(*FSDP_8B, "hardware=h100_80g", "train.compile=true")
    assert compiled.context.efficiency == pytest.approx(
        EFFICIENCY_COMPILED * eager.context.efficiency
    )
    assert eager.estimate.time.compute / compiled.estimate.time.compute == pytest.approx(1.16)
    assert compiled.estimate.memory == eager.estimate.memory


def test_compile_leaves_tensor_parallel_time_exposed_as_it_was():
    """DTensor TP has no async TP: its collectives do not shrink with faster blocks."""
    args = ["recipe=llama3_405b_8192gpu", "recompute.every=1"]
    eager, compiled = plan(*args), plan(*args, "train.compile=true")
    assert compiled.estimate.time.tp == eager.estimate.time.tp > 0
    assert compiled.estimate.time.compute < eager.estimate.time.compute


@pytest.mark.parametrize("compile_", ["false", "true"])
def test_an_explicit_efficiency_is_taken_as_measured(compile_):
    """hardware.efficiency is the run's measured efficiency as configured: neither the
    generation's scale nor the compile factor rescales it."""
    p = plan(*FSDP_8B, "hardware=h100_80g", "hardware.efficiency=0.3", f"train.compile={compile_}")
    assert p.context.efficiency == 0.3
    reference = plan(*FSDP_8B, "hardware=h100_80g", "hardware.efficiency=0.3")
    assert p.estimate.time.compute == reference.estimate.time.compute


def test_the_h100_scale_is_what_calibrate_fits_to_torchtitan(capsys):
    calibrate.main(["--hopper"])
    out = capsys.readouterr().out
    fitted = float(re.search(r"efficiency_scale ([0-9.]+) fitted", out).group(1))
    assert fitted == pytest.approx(0.62, abs=0.005)
    # The compiled rows, not fitted, check EFFICIENCY_COMPILED: within 10% of torchtitan's.
    for line in out.splitlines():
        if "compiled" in line:
            residual = float(re.search(r"([+-][0-9.]+)%", line).group(1))
            assert abs(residual) < 10, line
