"""Compute efficiency per hardware generation and under train.compile (docs/planner.md,
"Calibration"): each GEMM at the A100 fit for its narrowest dimension times the preset's
efficiency_scale (times its compile_factor when compiled), the memory-bound work at the
preset's memory bandwidth, unless hardware.efficiency gives a measured rate."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from conftest import compose_config

from launcher.plan import calibrate, kernels, make_plan
from launcher.plan.terms.compute import layer_cost

# Llama 3 8B, FSDP over one node: tp=1, so compile changes no saved activation (compiled
# sequence parallelism keeps its gathered inputs: the activation count's business, not this).
FSDP_8B = ["model=llama3_8b", "train.seq_len=4096", "train.global_batch_size=64"]


def plan(*overrides: str):
    p = make_plan(compose_config(list(overrides)))
    assert p.estimate is not None, p.errors
    return p


def cost(p):
    return layer_cost(p.context, p.layout, False, p.layout.micro_batch_size * 4096)


def test_each_generation_reaches_its_scale_of_the_a100_fit():
    """The GEMM curve is Megatron-LM's on A100 (scale 1); this engine's kind of stack reaches a
    share of it there and a smaller one of the H100's peak (calibrate --hopper fits both); the
    H100's attention core runs at its fused kernel's measured share of peak."""
    a100, h100 = plan(*FSDP_8B, "hardware=a100_80g"), plan(*FSDP_8B, "hardware=h100_80g")
    sa, sh = a100.cfg.hardware.efficiency_scale, h100.cfg.hardware.efficiency_scale
    assert sh < sa < 1.0
    assert a100.context.efficiency == kernels.model_efficiency(4096, sa)
    assert h100.context.efficiency == pytest.approx(sh / sa * a100.context.efficiency)
    # Same layout, same FLOPs: GEMM time goes as 1 / (peak x efficiency), the memory-bound
    # work as 1 / memory bandwidth.
    a, h = cost(a100), cost(h100)
    assert a.gemm / h.gemm == pytest.approx(989 * sh / (312 * sa))
    # The attention core: the A100 at the curve's maximum, the H100 at its kernel's own rate.
    ha = h100.cfg.hardware.attention_efficiency
    assert a.core / h.core == pytest.approx(989 * ha / (312 * kernels.EFFICIENCY_MAX * sa))
    assert a.memory / h.memory == pytest.approx(3350 / 2039)


def test_a_gemm_narrower_than_the_model_runs_slower_per_flop():
    """Tensor parallelism shards the GEMMs: 1/8 of the FLOPs at a lower efficiency."""
    one, eight = (
        plan(*FSDP_8B, "hardware=h100_80g"),
        plan(*FSDP_8B, "hardware=h100_80g", "parallel.tp=8"),
    )
    assert cost(eight).gemm > cost(one).gemm / 8
    assert (
        kernels.gemm_efficiency(512, 1) < kernels.gemm_efficiency(4096, 1) < kernels.EFFICIENCY_MAX
    )


@pytest.mark.parametrize("preset", ["h800", "b200"])
def test_the_other_hopper_and_blackwell_presets_take_the_h100_scale(preset):
    """No run of their own: they take h100_80g's (h200 has this engine's measured runs)."""
    assert (
        plan(f"hardware={preset}").cfg.hardware.efficiency_scale == calibrate.hopper_scale_in_use()
    )


def test_compile_speeds_the_kernels_fuses_the_memory_bound_work_and_leaves_memory():
    eager = plan(*FSDP_8B, "hardware=h100_80g")
    compiled = plan(*FSDP_8B, "hardware=h100_80g", "train.compile=true")
    e, c = cost(eager), cost(compiled)
    assert e.gemm / c.gemm == pytest.approx(compiled.cfg.hardware.compile_factor)
    assert c.memory / e.memory == pytest.approx(kernels.ELEMENTWISE_COMPILED)
    assert compiled.estimate.time["compute"] < eager.estimate.time["compute"]
    # The blocks keep what they kept; the compiled loss peaks at the logits and their gradient
    # in bf16 (4 bytes per logit) where the eager one peaks at 12.
    assert compiled.memory.activations == eager.memory.activations
    logits = compiled.layout.micro_batch_size * 4096 * compiled.cfg.model.vocab_size
    assert eager.memory.other - compiled.memory.other == pytest.approx(logits * (12 - 4))


def test_compile_leaves_tensor_parallel_time_exposed_as_it_was():
    """DTensor TP has no async TP: its collectives do not shrink with faster blocks."""
    args = ["recipe=llama3_405b_8192gpu", "recompute.every=1"]
    eager, compiled = plan(*args), plan(*args, "train.compile=true")
    assert compiled.estimate.time["tp"] == eager.estimate.time["tp"] > 0
    assert compiled.estimate.time["compute"] < eager.estimate.time["compute"]


@pytest.mark.parametrize("compile_", ["false", "true"])
def test_an_explicit_efficiency_is_taken_as_measured(compile_):
    """hardware.efficiency is the measured rate of the kernels as configured: neither the
    generation's scale, nor the compile factor, nor a GEMM's width rescales it."""
    p = plan(*FSDP_8B, "hardware=h100_80g", "hardware.efficiency=0.3", f"train.compile={compile_}")
    assert p.context.efficiency == 0.3
    reference = plan(*FSDP_8B, "hardware=h100_80g", "hardware.efficiency=0.3")
    assert cost(p).gemm == cost(reference).gemm
    flops = 6 * p.context.shape.dense_layer * 4096 * p.layout.micro_batch_size
    assert cost(p).gemm == pytest.approx(flops / (989e12 * 0.3), rel=1e-3)


@pytest.fixture(scope="module")
def hopper():
    """calibrate --hopper's output, once: the fits, every run's residual, the presets."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        calibrate.main(["--hopper"])
    return buf.getvalue()


def residuals(out: str) -> dict[str, tuple[str, float]]:
    """{run: (fits, residual)} of the engine's table: its rows start with a directory/job."""
    found = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) > 6 and re.fullmatch(r"h\d00-[0-9]+-[0-9]+-[0-9]+\w?/\w+", cells[0]):
            found[cells[0]] = (cells[3], float(cells[6].rstrip("%")) / 100)
    return found


def test_each_preset_holds_what_calibrate_fits_on_its_own_part(hopper):
    """h100_hbm2e and a100_80g: torchtitan's runs on those parts; h100_80g and h200: this
    engine's runs on the GH100 die; h800 and b200 take h100_80g's (tests above)."""
    flat = " ".join(hopper.split())
    for preset in calibrate.TORCHTITAN_PRESETS:
        fitted = float(re.search(rf"{preset} ([0-9.]+) \(in use", flat).group(1))
        in_use = compose_config([f"hardware={preset}"]).hardware.efficiency_scale
        assert fitted == pytest.approx(in_use, abs=0.005), preset
    factor = float(re.search(r"h100_hbm2e's compile_factor ([0-9.]+)", flat).group(1))
    for preset in ("h100_hbm2e", "a100_80g"):  # a100_80g takes it: no compiled A100 run
        hw = compose_config([f"hardware={preset}"]).hardware
        assert factor == pytest.approx(hw.compile_factor, abs=0.005), preset
    scale, factor = (
        float(x)
        for x in re.search(
            r"efficiency_scale ([0-9.]+) fitted to \S+, compile_factor ([0-9.]+)", flat
        ).groups()
    )
    overhead = float(
        re.search(r"microbatch_overhead_us ([0-9,]+) to", flat).group(1).replace(",", "")
    )
    fp8 = float(re.search(r"efficiency_scale_fp8 ([0-9.]+) to \S+, FP8_ROWWISE", flat).group(1))
    rowwise = float(re.search(r"FP8_ROWWISE ([0-9.]+) to", flat).group(1))
    assert rowwise == pytest.approx(kernels.FP8_ROWWISE, abs=0.005)
    for preset in (*calibrate.ENGINE_PRESETS, "h800", "b200"):
        hw = compose_config([f"hardware={preset}"]).hardware
        assert (hw.efficiency_scale, hw.compile_factor) == pytest.approx((scale, factor), abs=0.005)
        assert hw.microbatch_overhead_us == pytest.approx(overhead, rel=0.01), preset
        assert hw.efficiency_scale_fp8 == pytest.approx(fp8, abs=0.005), preset
    titan = float(re.search(r"its efficiency_scale_fp8 ([0-9.]+) to its FP8", flat).group(1))
    hbm2e = compose_config(["hardware=h100_hbm2e"]).hardware.efficiency_scale_fp8
    assert titan == pytest.approx(hbm2e, abs=0.005)
    # Every preset names its part, and the last table says what each was fitted on.
    for preset in calibrate.FITTED_ON:
        part = compose_config([f"hardware={preset}"]).hardware.part
        assert part and preset in hopper, preset


def test_the_fit_runs_and_their_copies_land_within_ten_percent(hopper):
    """The presets' fit: this engine's H100 compiled run and H200 eager run (fitted on) and the
    Llama runs of the same workload (copies: shown, not held out) within 10%."""
    found = residuals(hopper)
    assert found["h100-2026-11-26/bench_compiled"][0] == "compile"
    assert found["h200-2026-11-26/bench_eager"][0] == "scale"
    llama = [run for run in found if run.endswith(("bench_compiled", "bench_eager", "llama"))]
    llama += ["h200-2026-11-26/bench_4096_eager"]
    llama += [f"h200-2026-11-27b/{job}" for job in ("llama_alone", "llama_foreach")]
    assert len(llama) == 7
    for run in llama:
        assert abs(found[run][1]) <= 0.10, (run, found[run])
    assert sorted(found[run][0] for run in llama) == ["compile", *["copy"] * 5, "scale"]


def test_the_held_out_runs_are_the_workloads_no_fit_run_has(hopper):
    """Held-out discipline (docs/planner.md): every run sharing a fit run's workload (model,
    sequence, micro-batch, per-rank layout) is a copy, and a run of code since replaced
    superseded, never held out; the held-out runs are the other families', their residuals
    shown apart from the fitted ones'."""
    found = residuals(hopper)
    held = sorted(run for run, (fits, _) in found.items() if fits == "-")
    assert held == [
        "h200-2026-11-27/dsv2", "h200-2026-11-27/dsv2_eager", "h200-2026-11-27/gpt",
        "h200-2026-11-27/gpt_flash", "h200-2026-11-27b/gpt_eager",
    ]  # fmt: skip
    assert found["h200-2026-11-27/gpt_eager"][0] == "superseded"  # its softmax since replaced
    worst = max(abs(found[run][1]) for run in held)
    assert "held-out runs: 5, mean absolute tokens/s residual" in hopper
    assert f"worst {worst:.1%}" in hopper
    runs = calibrate.engine_runs()
    uses = calibrate.engine_uses(runs)
    workloads = {f"{d}/{row['job']}": calibrate.workload(cfg) for d, row, cfg in runs}
    fitted = {workloads[run] for run, use in uses.items() if use in calibrate.ENGINE_FITS.values()}
    assert not {workloads[run] for run in held} & fitted


def test_the_fp8_runs_fit_and_their_copies_land_within_ten_percent(hopper):
    """efficiency_scale_fp8 fitted to the 8B shape cut to 16 layers, FP8_ROWWISE to the 1B's
    rowwise run; the 8-layer cut and the 1B's tensorwise run (their workloads: copies, not
    held out) within 10%."""
    found = residuals(hopper)
    assert found["h200-2026-11-27b/l16_fp8"][0] == "fp8"
    assert found["h200-2026-11-27b/llama_fp8_row"][0] == "rowwise"
    for job in ("l8b_fp8", "llama_fp8"):
        fits, residual = found[f"h200-2026-11-27b/{job}"]
        assert fits == "copy" and abs(residual) <= 0.10, (job, residual)


def test_each_micro_batch_costs_the_parts_overhead():
    """hardware.microbatch_overhead_us: the device's time per micro-batch outside the kernels
    (fitted per part: calibrate --hopper), once per micro-batch of the step."""
    args = [*FSDP_8B, "hardware=h100_80g", "train.micro_batch_size=1"]
    none = plan(*args, "hardware.microbatch_overhead_us=0")
    some = plan(*args, "hardware.microbatch_overhead_us=5000")
    mbs = 64 // 8  # global 64 over dp 8, micro-batches of 1
    added = some.estimate.time["compute"] - none.estimate.time["compute"]
    assert added == pytest.approx(mbs * 5e-3)
