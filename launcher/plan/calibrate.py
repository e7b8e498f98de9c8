"""`python -m launcher.plan.calibrate`: fit the planner's constants to published runs and to
this engine's own (docs/planner.md, "Calibration"; the runs: launcher/plan/published.py).

(no option) The GEMM curve, EFFICIENCY_MAX x w / (w + EFFICIENCY_DIM) in
launcher/plan/kernels.py, to the even rows of Narayanan et al. 2021, Table 1 (recipes
megatron_gpt_*, planned as compiled blocks for Megatron's fused kernels), checked on the odd
ones: each row's TFLOP/s per GPU with Megatron's own FLOP count, 96 B s l h^2 (1 + s/(6h) +
V/(16 l h)) per iteration (full recomputation, attention counted without the causal mask),
grid search on the squared relative error.

`--hopper`: each GPU preset's `hardware.efficiency_scale` and `compile_factor`, fitted to runs on
its own part. h100_hbm2e (the 500 W HBM2e H100s of torchtitan's runs) and a100_80g: the scale
to torchtitan's eager runs marked "fit" on each, h100_hbm2e's compile factor to its compiled H100
ones; every torchtitan run's residual. h100_80g and h200 (one die, GH100): this engine's own
runs in docs/measured, the scale to its eager run on an H200, the factor to its compiled run on
a 700 W H100 SXM, every other run held out, with speed and memory residuals (h800 and b200
take h100_80g's). Last, each preset's part and what its figures were fitted on.

`--published`: every published run's prediction and error, fitted and held-out marked, each
fused stack's scale fitted to its own fit runs; the held-out aggregates.

`--from SWEEP_DIR`: a sweep's completed jobs (launcher/sweep.py: each job's overrides and its
measured tokens/s per device, the median step after the first), or the one-device benchmarks
in a directory (`python -m launcher.bench.gpu --json`: its overrides and the engine's
tokens/s), per hardware preset and
train.compile: refits the constants the runs determine (KNOBS), prints every job's residual
before and after with its terms, the residual by term, and the overrides to use.

The residuals of the held-out runs, which the plan's bands read: `python -m
launcher.plan.held_out`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from rich.console import Console
from rich.table import Table

from launcher.cli import compose, fail
from launcher.plan import kernels, make_plan
from launcher.plan.published import FUSED, MEGATRON, MEGATRON_KERNELS, RUNS, STACKS, megatron_runs
from launcher.plan.search import candidate_overrides, with_overrides
from launcher.runtime import sweep_files


def megatron_flops(cfg) -> float:
    m, t = cfg.model, cfg.train
    b, s, layers, h, v = t.global_batch_size, t.seq_len, m.n_layers, m.dim, m.vocab_size
    return 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))


def predicted_tflops(cfgs, eff_max: float, eff_dim: float) -> list[float]:
    saved = kernels.EFFICIENCY_MAX, kernels.EFFICIENCY_DIM
    kernels.EFFICIENCY_MAX, kernels.EFFICIENCY_DIM = eff_max, eff_dim
    try:
        out = []
        for cfg in cfgs:
            plan = make_plan(cfg)
            out.append(megatron_flops(cfg) / plan.estimate.time.step / plan.world_size / 1e12)
        return out
    finally:
        kernels.EFFICIENCY_MAX, kernels.EFFICIENCY_DIM = saved


def error(pred, reported) -> float:
    return sum(((p - r) / r) ** 2 for p, r in zip(pred, reported, strict=True))


def fit(cfgs, reported) -> tuple[float, float, list[float]]:
    """Grid search, coarse then fine, over EFFICIENCY_MAX and EFFICIENCY_DIM."""
    best = None
    for eff_max, eff_dim in [(a / 100, d * 100) for a in range(40, 96) for d in range(0, 31)]:
        pred = predicted_tflops(cfgs, eff_max, eff_dim)
        if best is None or error(pred, reported) < best[0]:
            best = (error(pred, reported), eff_max, eff_dim, pred)
    _, a0, d0, _ = best
    for eff_max, eff_dim in [
        (a0 + a / 1000, max(0.0, d0 + d * 10)) for a in range(-10, 11) for d in range(-10, 11)
    ]:
        pred = predicted_tflops(cfgs, eff_max, eff_dim)
        if error(pred, reported) < best[0]:
            best = (error(pred, reported), eff_max, eff_dim, pred)
    return best[1], best[2], best[3]


def bench_rows(directory: Path) -> list[dict]:
    """`python -m launcher.bench.gpu --json` files in `directory`, as sweep summary rows: the
    engine's measured tokens/s on one device for the bench's overrides."""
    rows = []
    for path in sorted(directory.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # not a benchmark's file
        if not isinstance(result, dict) or "overrides" not in result:
            continue
        engine = result.get("contenders", {}).get("engine", {})
        if "tokens_per_s" not in engine:
            continue  # a benchmark whose engine did not finish
        overrides = ["hardware.devices_per_node=1", "hardware.nodes=1", *result["overrides"]]
        rows.append(
            {
                "job": path.stem,
                "status": "completed",
                "overrides": overrides,
                "tokens_per_s": engine["tokens_per_s"],
                "peak_allocated_gib": engine.get("peak_allocated_gib"),
                "layout": " ".join(o for o in result["overrides"] if not o.startswith("model=")),
            }
        )
    return rows


def measured_runs(sweep_dir: str) -> list[tuple[dict, object]]:
    """(summary row, Config) of every completed job of the sweep with a measured speed, or of
    every one-device benchmark (`launcher.bench.gpu --json`) in the directory."""

    out = []
    rows = bench_rows(Path(sweep_dir)) or sweep_files.job_rows(sweep_dir)
    for row in rows:
        if row["status"] != "completed" or row.get("tokens_per_s") is None:
            continue
        speed, job = row["tokens_per_s"], f"{sweep_dir}: job {row['job']}"
        if isinstance(speed, bool) or not (
            isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0
        ):
            fail(f"{job}: tokens_per_s={speed!r} is not a positive, finite number of tokens/s")
        overrides = row["overrides"]
        if not (isinstance(overrides, list) and all(isinstance(o, str) for o in overrides)):
            fail(f"{job}: its overrides {overrides!r} are not a list of overrides")
        try:
            cfg = compose(overrides)
        except Exception as e:  # Hydra's own errors, and ours (ValueError): said in one line
            fail(f"{job}: its overrides {' '.join(overrides)} do not compose: {e}")
        if cfg.plan.candidate >= 0:  # the layout that job trained
            cfg = compose(with_overrides(row["overrides"], candidate_overrides(cfg)[0]))
        out.append((row, cfg))
    return out


def with_hardware(cfg, **values):
    """`cfg` with hardware fields replaced."""
    return replace(cfg, hardware=replace(cfg.hardware, **values))


def predicted_speed(cfg, efficiency: float) -> float:
    """tokens/s per device the planner predicts for `cfg` at `efficiency` of peak."""
    return make_plan(with_hardware(cfg, efficiency=efficiency)).estimate.tokens_per_s_per_device


def fp8_speed(cfg, scale: float) -> float:
    """tokens/s per device the planner predicts for `cfg` with
    hardware.efficiency_scale_fp8=scale."""
    return make_plan(
        with_hardware(cfg, efficiency_scale_fp8=scale)
    ).estimate.tokens_per_s_per_device


def scaled_speed(cfg, scale: float) -> float:
    """tokens/s per device the planner predicts for `cfg` with hardware.efficiency_scale=scale."""
    hw = replace(cfg.hardware, efficiency=0.0, efficiency_scale=scale)
    return make_plan(replace(cfg, hardware=hw)).estimate.tokens_per_s_per_device


def best_factor(predict, cfgs, measured: list[float], low: float, high: float) -> float:
    """The factor in [low, high] minimising the squared relative error of `predict(cfg,
    factor)` against the measured speeds: a geometric grid, then a finer one around the best."""

    def err(x: float) -> float:
        pairs = zip(cfgs, measured, strict=True)
        return sum((predict(c, x) - m) ** 2 / m**2 for c, m in pairs)

    decades = math.log10(high / low)
    grid = [low * 10 ** (decades * i / 90) for i in range(91)]
    best = min(grid, key=err)
    step = decades / 90 / 30
    fine = [best * 10 ** (step * i) for i in range(-15, 16)]
    return min((x for x in fine if low <= x <= high), key=err)


def fit_to(runs: list[tuple], predict, low: float, high: float) -> float:
    """best_factor over (Config, measured tokens/s) pairs."""
    return best_factor(predict, [c for c, _ in runs], [m for _, m in runs], low, high)


def fit_efficiency(cfgs, measured: list[float]) -> float:
    """The efficiency (0.1% to 100% of peak) whose predicted speeds come closest."""
    return best_factor(predicted_speed, cfgs, measured, 1e-3, 1.0)


@dataclass(frozen=True)
class Knob:
    """A hardware constant `calibrate --from` can refit, the terms whose time it sets, and
    its range."""

    field: str
    terms: tuple[str, ...]
    low: float
    high: float


KNOBS = (
    Knob("efficiency", ("compute", "recompute"), 1e-3, 1.0),
    Knob("op_overhead_us", ("compute",), 0.1, 1000.0),
    Knob("collective_latency_us", ("tp", "cp", "ep", "dp", "pp"), 0.1, 10000.0),
)


def determined(knob: Knob, plans, host_serial: bool) -> bool:
    """Whether the runs can tell this constant: its terms take at least 5% of some run's
    step (the host's per-op time counts only where it adds to the step, on a CPU)."""
    if knob.field == "op_overhead_us" and not host_serial:
        return False
    return any(
        sum(p.estimate.time[t] for t in knob.terms) > 0.05 * p.estimate.time.step for p in plans
    )


def refit(cfgs, measured: list[float], knobs) -> dict[str, float]:
    """Coordinate descent over the knobs (each on a geometric grid, then a finer one), from
    the values in use, minimising the squared relative error of tokens/s per device."""
    values = {k.field: getattr(cfgs[0].hardware, k.field) for k in knobs}
    if "efficiency" in values and not values["efficiency"]:
        values["efficiency"] = make_plan(cfgs[0]).context.efficiency

    def predict(cfg, **trial):
        return make_plan(with_hardware(cfg, **trial)).estimate.tokens_per_s_per_device

    for _ in range(12):  # until no constant moves by more than 0.1%
        moved = False
        for k in knobs:
            others = {f: v for f, v in values.items() if f != k.field}
            before = values[k.field]
            values[k.field] = best_factor(
                lambda c, x, k=k, others=others: predict(c, **others, **{k.field: x}),
                cfgs,
                measured,
                k.low,
                k.high,
            )
            moved |= abs(values[k.field] - before) > 1e-3 * abs(before) or not before
        if not moved:
            break
    return values


def fewest_knobs(cfgs, measured: list[float], knobs) -> tuple[list, dict[str, float]]:
    """Refit the knobs; with no more runs than knobs (which cannot tell them apart), refit
    each set of one fewer than the runs (at least one) and keep the first set in KNOBS' order
    that lands within 0.5% of the closest. One run on a fast CPU is an example: the efficiency
    alone, capped at peak, leaves a third of it unexplained where the per-op time sets it."""
    if len(cfgs) > len(knobs):
        return list(knobs), refit(cfgs, measured, knobs)

    def residual(values) -> float:
        pred = [
            make_plan(with_hardware(c, **values)).estimate.tokens_per_s_per_device for c in cfgs
        ]
        return rms([(p - m) / m for p, m in zip(pred, measured, strict=True)])

    fits = [
        (list(subset), refit(cfgs, measured, subset))
        for subset in itertools.combinations(knobs, max(1, len(cfgs) - 1))
    ]
    errors = [residual(values) for _, values in fits]
    return next(f for f, e in zip(fits, errors, strict=True) if e <= min(errors) + 0.005)


def rms(r: list[float]) -> float:
    return math.sqrt(sum(x * x for x in r) / len(r))


def part_speed(
    cfg,
    scale: float,
    factor: float,
    overhead_us: float | None = None,
    fp8_scale: float | None = None,
) -> float:
    """tokens/s per device the planner predicts for `cfg` with the part's efficiency_scale,
    compile_factor and (unless None) microbatch_overhead_us and efficiency_scale_fp8
    replaced."""
    hw = replace(cfg.hardware, efficiency=0.0, efficiency_scale=scale, compile_factor=factor)
    if overhead_us is not None:
        hw = replace(hw, microbatch_overhead_us=overhead_us)
    if fp8_scale is not None:
        hw = replace(hw, efficiency_scale_fp8=fp8_scale)
    return make_plan(replace(cfg, hardware=hw)).estimate.tokens_per_s_per_device


def rowwise_scale(fp8_scale: float, rowwise: float) -> float:
    """The efficiency_scale_fp8 that plans a rowwise run at `rowwise` of tensorwise's speed
    under `fp8_scale` (the planner multiplies by kernels.FP8_ROWWISE, the value in use)."""
    return fp8_scale * rowwise / kernels.FP8_ROWWISE


def workload(cfg) -> tuple:
    """What a run measures apart from the constants fitted to it: its model (a cut of it, fewer
    layers, is the same per layer), sequence, micro-batch and per-rank layout (tp, pp and its
    schedule, cp, ep, recompute). Not its data-parallel degree, compile or precision: the first
    only adds its collectives, the others are what the constants fitted on it scale."""
    p = cfg.parallel
    schedule = cfg.pipeline.schedule if p.pp > 1 else ""
    shape = (cfg.train.seq_len, cfg.train.micro_batch_size, p.tp, p.pp, p.cp, p.ep)
    return (cfg.model.name, *shape, cfg.recompute.mode.value, schedule)


def near_copies(rows) -> dict[str, str]:
    """Each row of `rows` ((name, use, cfg)) that is not "fit" but shares a fit row's workload,
    with that fit row's name: a held-out row must never be one (docs/planner.md, "Held-out
    discipline")."""
    fits: dict[tuple, str] = {}
    for name, use, cfg in rows:
        if use == "fit":
            fits.setdefault(workload(cfg), name)
    return {
        name: fits[workload(cfg)]
        for name, use, cfg in rows
        if use != "fit" and workload(cfg) in fits
    }


def is_fp8(cfg) -> bool:
    return cfg.precision.fp8.value != "none"


def in_use(preset: str) -> tuple[float, float, float, float]:
    hw = compose([f"hardware={preset}"]).hardware
    return (
        hw.efficiency_scale,
        hw.compile_factor,
        hw.microbatch_overhead_us,
        hw.efficiency_scale_fp8,
    )


# The presets whose figures torchtitan's published runs set: its eager "fit" rows on each give
# the scale, its compiled H100 rows h100_hbm2e's compile_factor (a100_80g takes that factor:
# torchtitan published no compiled A100 run), its FP8 "fit" row h100_hbm2e's
# efficiency_scale_fp8.
TORCHTITAN_PRESETS = ("h100_hbm2e", "a100_80g")


def calibrate_hopper() -> None:
    """The presets' efficiency_scale and compile_factor, each fitted to runs on its own part:
    torchtitan's published ones (its eager rows marked "fit" for the scale of h100_hbm2e and
    a100_80g, its compiled H100 rows for h100_hbm2e's factor; launcher/plan/published.py),
    then this engine's own on the GH100 die (calibrate_engine); every run's residual, the
    held-out ones included, and the presets with what each was fitted on."""

    runs = [r for r in RUNS if r.stack == "torchtitan"]
    cfgs = [compose(r.overrides.split()) for r in runs]
    compiled = ["train.compile=true" in r.overrides for r in runs]

    def fit_rows(compiled_: bool, fp8: bool, preset: str | None = None) -> list[tuple]:
        return [
            (c, r.tokens_per_s)
            for r, c, k in zip(runs, cfgs, compiled, strict=True)
            if r.use == "fit"
            and not r.fits
            and k == compiled_
            and is_fp8(c) == fp8
            and preset in (None, c.hardware.name)
        ]

    scales = {
        preset: fit_to(fit_rows(False, False, preset), scaled_speed, 0.1, 2.0)
        for preset in TORCHTITAN_PRESETS
    }
    factor = fit_to(
        fit_rows(True, False), lambda c, f: part_speed(c, scales[c.hardware.name], f), 0.5, 2.0
    )
    fp8_scale = fit_to(
        fit_rows(True, True),
        lambda c, x: part_speed(c, scales[c.hardware.name], factor, fp8_scale=x),
        0.1,
        2.0,
    )
    fitted = ", ".join(f"{p} {scales[p]:.3f} (in use: {in_use(p)[0]})" for p in scales)
    table = Table(
        title=f"torchtitan's runs: efficiency_scale fitted to its eager rows: {fitted}; "
        f"h100_hbm2e's compile_factor {factor:.3f} to its compiled rows (in use: "
        f"{in_use('h100_hbm2e')[1]}), its efficiency_scale_fp8 {fp8_scale:.3f} to its FP8 "
        f"row (in use: {in_use('h100_hbm2e')[3]})",
        title_justify="left",
    )
    for col in ("run", "part", "fits", "published tok/s/GPU", "predicted", "residual"):
        table.add_column(col, justify="left" if col in ("run", "part") else "right")
    for run, cfg, k in zip(runs, cfgs, compiled, strict=True):
        p = part_speed(cfg, scales[cfg.hardware.name], factor, fp8_scale=fp8_scale)
        kind = "fp8" if is_fp8(cfg) else ("compile" if k else "scale")
        fits = {"fit": kind, "shown": f"shown: {run.lacks}", "copy": "copy"}.get(run.use, "-")
        table.add_row(
            run.name,
            cfg.hardware.name,
            fits,
            f"{run.tokens_per_s:,.0f}",
            f"{p:,.0f}",
            f"{(p - run.tokens_per_s) / run.tokens_per_s:+.1%}",
        )
    Console(width=140).print(table)
    calibrate_engine()
    Console(width=170).print(presets_table())


# This engine's own runs (launcher.bench.gpu --json; docs/speed.md, "On one GPU") on the GH100
# die that the H100 SXM and the H200 share: the same SMs, clocks and peak, the memory apart
# (memory_gbps). efficiency_scale is fitted to the eager Llama run on the H200, compile_factor
# to the compiled one on the H100, microbatch_overhead_us to the pair of H200 runs that differ
# in their micro-batches alone (8 of 1 against 4 of 2 at sequence 4096: the same tokens, the
# same GEMM widths to the planner; measured before the loss was compiled, which costs per token,
# not per micro-batch); efficiency_scale_fp8 to the FP8 run of Llama 3 8B's shape cut to 16
# layers on an H200 (the largest share of float8 GEMMs measured), kernels.FP8_ROWWISE to the
# rowwise run of Llama 3.2 1B against the tensorwise one beside it; every other run in these
# directories is held out (the sub-directories, runs of code since changed, are not read as
# runs).
MEASURED = Path(__file__).resolve().parents[2] / "docs" / "measured"
ENGINE_RUNS = ("h100-2026-11-26", "h200-2026-11-26", "h200-2026-11-27", "h200-2026-11-27b")
ENGINE_SCALE_RUN = ("h200-2026-11-26", "bench_eager")
ENGINE_COMPILE_RUN = ("h100-2026-11-26", "bench_compiled")
ENGINE_FP8_RUN = ("h200-2026-11-27b", "l16_fp8")
ENGINE_ROWWISE_RUN = ("h200-2026-11-27b", "llama_fp8_row")
ENGINE_MICROBATCH_RUNS = (
    "h200-2026-11-26/eager-loss",
    "bench_4096_compiled",
    "bench_4096_mb2_compiled",
)
ENGINE_PRESETS = ("h100_80g", "h200")


def step_seconds(cfg, tokens_per_s: float) -> float:
    return cfg.train.global_batch_size * cfg.train.seq_len / tokens_per_s


def fit_overhead(scale: float, factor: float) -> float:
    """microbatch_overhead_us from the pair of runs that differ in their micro-batches alone:
    the measured step-time difference past the planner's own, per micro-batch."""
    directory, many, few = ENGINE_MICROBATCH_RUNS
    runs = {row["job"]: (row, cfg) for row, cfg in measured_runs(str(MEASURED / directory))}
    gap = {}
    for job in (many, few):
        row, cfg = runs[job]
        measured = step_seconds(cfg, row["tokens_per_s"])
        planned = step_seconds(cfg, part_speed(cfg, scale, factor, 0.0))
        gap[job] = (measured - planned, cfg.train.global_batch_size // cfg.train.micro_batch_size)
    (gap_many, n_many), (gap_few, n_few) = gap[many], gap[few]
    return max(0.0, (gap_many - gap_few) / (n_many - n_few) * 1e6)


def engine_runs() -> list[tuple[str, dict, object]]:
    """(directory, summary row, Config) of this engine's measured runs."""
    return [(d, row, cfg) for d in ENGINE_RUNS for row, cfg in measured_runs(str(MEASURED / d))]


ENGINE_FITS = {
    ENGINE_SCALE_RUN: "scale",
    ENGINE_COMPILE_RUN: "compile",
    ENGINE_FP8_RUN: "fp8",
    ENGINE_ROWWISE_RUN: "rowwise",
}


# Runs of code since replaced, each with the run that measured the same workload on the code
# that replaced it: shown, never held out (they measure an engine that is no longer this one).
SUPERSEDED = {
    # CUDA autocast's fp32 softmax, before models.layers.Softmax kept torch's fused kernels
    # (docs/measured/h200-2026-11-27b/README.md).
    "h200-2026-11-27/gpt_eager": "h200-2026-11-27b/gpt_eager",
}


def engine_uses(runs) -> dict[str, str]:
    """What each engine run ("DIR/JOB") is to the fit: the constant fitted to it, "copy of" the
    fit run whose workload it shares (shown, never held out: the micro-batch pair's runs
    included), "superseded by" the run of its workload on the code that replaced it, or "-"
    (held out)."""
    directory, *jobs = ENGINE_MICROBATCH_RUNS
    pair = [(row["job"], cfg) for row, cfg in measured_runs(str(MEASURED / directory))]
    rows = [(f"{directory}/{job}", "fit", cfg) for job, cfg in pair if job in jobs]
    rows += [
        (f"{d}/{row['job']}", "fit" if (d, row["job"]) in ENGINE_FITS else "held-out", cfg)
        for d, row, cfg in runs
    ]
    copies = near_copies(rows)
    uses = {}
    for d, row, _ in runs:
        name = f"{d}/{row['job']}"
        copy = f"copy of {copies[name]}" if name in copies else "-"
        if name in SUPERSEDED:
            copy = f"superseded by {SUPERSEDED[name]}"
        uses[name] = ENGINE_FITS.get((d, row["job"]), copy)
    return uses


@dataclass(frozen=True)
class EngineFit:
    """What calibrate fits to this engine's runs on the GH100 die."""

    scale: float  # efficiency_scale
    factor: float  # compile_factor
    overhead: float  # microbatch_overhead_us
    fp8_scale: float  # efficiency_scale_fp8
    rowwise: float  # kernels.FP8_ROWWISE

    def plan(self, cfg):
        """make_plan of `cfg` with these constants."""
        fp8 = self.fp8_scale
        if cfg.precision.fp8.value == "rowwise":
            fp8 = rowwise_scale(fp8, self.rowwise)
        return make_plan(
            with_hardware(
                cfg,
                efficiency=0.0,
                efficiency_scale=self.scale,
                compile_factor=self.factor,
                microbatch_overhead_us=self.overhead,
                efficiency_scale_fp8=fp8,
            )
        )


def fit_engine(runs) -> EngineFit:
    """efficiency_scale to the eager run, compile_factor to the compiled one, the overhead per
    micro-batch to the pair (each depends a little on the others, so three rounds); then, with
    those, efficiency_scale_fp8 to the FP8 run and the rowwise factor to the rowwise one."""

    def one(key: tuple[str, str]) -> list:
        return [(cfg, row["tokens_per_s"]) for d, row, cfg in runs if (d, row["job"]) == key]

    eager, compiled = one(ENGINE_SCALE_RUN), one(ENGINE_COMPILE_RUN)
    scale, factor, overhead = 1.0, 1.0, 0.0
    for _ in range(3):
        scale = fit_to(eager, lambda c, x, f=factor, o=overhead: part_speed(c, x, f, o), 0.1, 2.0)
        factor = fit_to(
            compiled, lambda c, f, s=scale, o=overhead: part_speed(c, s, f, o), 0.5, 3.0
        )
        overhead = fit_overhead(scale, factor)
    fp8 = fit_to(
        one(ENGINE_FP8_RUN), lambda c, x: part_speed(c, scale, factor, overhead, x), 0.1, 2.0
    )
    rowwise = fit_to(
        one(ENGINE_ROWWISE_RUN),
        lambda c, r: part_speed(c, scale, factor, overhead, rowwise_scale(fp8, r)),
        0.1,
        2.0,
    )
    return EngineFit(scale, factor, overhead, fp8, rowwise)


def calibrate_engine() -> None:
    """Fit the GH100 presets' efficiency_scale and compile_factor to this engine's runs and
    print every run's residual (tokens/s, and peak memory without the CUDA reserve)."""
    runs = engine_runs()
    fit = fit_engine(runs)
    uses = ", ".join(
        f"{p} {in_use(p)[0]} x {in_use(p)[1]} + {in_use(p)[2]:g} us, fp8 {in_use(p)[3]}"
        for p in ENGINE_PRESETS
    )
    table = Table(
        title=f"this engine on the GH100 die ({', '.join(ENGINE_PRESETS)}): efficiency_scale "
        f"{fit.scale:.3f} fitted to {'/'.join(ENGINE_SCALE_RUN)}, compile_factor "
        f"{fit.factor:.3f} to {'/'.join(ENGINE_COMPILE_RUN)}, microbatch_overhead_us "
        f"{fit.overhead:,.0f} to {'/'.join(ENGINE_MICROBATCH_RUNS[:2])} and "
        f"{ENGINE_MICROBATCH_RUNS[2]}, efficiency_scale_fp8 {fit.fp8_scale:.3f} to "
        f"{'/'.join(ENGINE_FP8_RUN)}, FP8_ROWWISE {fit.rowwise:.3f} to "
        f"{'/'.join(ENGINE_ROWWISE_RUN)} (in use: {uses}; FP8_ROWWISE {kernels.FP8_ROWWISE})",
        title_justify="left",
    )
    cols = ("run", "part", "point", "fits", "measured tok/s", "predicted", "residual")
    for col in (*cols, "memory GiB", "predicted GiB"):
        table.add_column(col, justify="left" if col in ("run", "part", "point") else "right")
    uses, residual = engine_uses(runs), {}
    for d, row, cfg in runs:
        plan = fit.plan(cfg)
        pred, got = plan.estimate.tokens_per_s_per_device, row["tokens_per_s"]
        memory = plan.memory.total - plan.context.reserve
        peak = row["peak_allocated_gib"]
        fits = uses[f"{d}/{row['job']}"].split(" of ")[0].split(" by ")[0]
        residual[f"{d}/{row['job']}"] = pred / got - 1
        table.add_row(
            f"{d}/{row['job']}",
            cfg.hardware.name,
            f"{cfg.model.name}, seq {cfg.train.seq_len}, micro-batch "
            f"{cfg.train.micro_batch_size}"
            + (", compiled" if cfg.train.compile else ", eager")
            + (f", fp8 {cfg.precision.fp8.value}" if is_fp8(cfg) else "")
            + (
                f", recompute={cfg.recompute.mode.value}"
                if cfg.recompute.mode.value != "none"
                else ""
            ),
            fits,
            f"{got:,.0f}",
            f"{pred:,.0f}",
            f"{pred / got - 1:+.1%}",
            f"{peak:.2f}",
            f"{memory / 2**30:.2f} ({memory / 2**30 / peak - 1:+.0%})",
        )
    Console(width=170).print(table)
    copied = sorted({(u.split(" of ")[1], run) for run, u in uses.items() if u.startswith("copy")})
    print(
        "copy: a fit run's workload (calibrate.workload), shown, never held out: "
        + "; ".join(f"{run} of {fit}" for fit, run in copied)
    )
    print(
        "superseded: a run of code since replaced, shown, never held out: "
        + "; ".join(f"{old} by {new}" for old, new in SUPERSEDED.items())
    )
    kinds = (("fitted", lambda u: u in ENGINE_FITS.values()), ("held-out", lambda u: u == "-"))
    for kind, picked in kinds:
        res = [abs(r) for run, r in residual.items() if picked(uses[run])]
        print(
            f"{kind} runs: {len(res)}, mean absolute tokens/s residual "
            f"{sum(res) / len(res):.1%}, worst {max(res):.1%}"
        )


# What each GPU preset's efficiency_scale and compile_factor were fitted on (the tables above).
FITTED_ON = {
    "h100_hbm2e": "torchtitan's runs on that part (first table)",
    "a100_80g": "torchtitan's 8B run on 64 A100s (first table); compile_factor h100_hbm2e's",
    "h100_80g": "this engine's runs on H100 and H200 (second table)",
    "h200": "this engine's runs on H100 and H200 (second table)",
    "h800": "h100_80g's: the same die and HBM",
    "b200": "h100_80g's: an assumption, nothing measured on B200",
}


def presets_table() -> Table:
    table = Table(title="the GPU presets", title_justify="left")
    cols = (
        "efficiency_scale",
        "compile_factor",
        "microbatch_overhead_us",
        "efficiency_scale_fp8",
        "attention_efficiency",
    )
    for col in ("preset", "part", "memory GB/s", *cols, "from"):
        table.add_column(col, justify="right" if "GB/s" in col or "_" in col else "left")
    for preset, source in FITTED_ON.items():
        hw = compose([f"hardware={preset}"]).hardware
        table.add_row(
            preset,
            hw.part,
            f"{hw.memory_gbps:,.0f}",
            f"{hw.efficiency_scale}",
            f"{hw.compile_factor}",
            f"{hw.microbatch_overhead_us:g}",
            f"{hw.efficiency_scale_fp8:g}",
            f"{hw.attention_efficiency:g}" if hw.attention_efficiency else "as GEMMs",
            source,
        )
    return table


def hopper_scale_in_use() -> float:
    return compose(["hardware=h100_80g"]).hardware.efficiency_scale


def calibrate_from(sweep_dir: str) -> None:
    runs = measured_runs(sweep_dir)
    if not runs:
        fail(f"{sweep_dir} has no completed job with a measured speed (see its summary.jsonl)")
    console = Console(width=160)
    # One set of constants per hardware preset and compile setting: a refitted
    # hardware.efficiency is the measured rate of the kernels as configured.
    by_hw: dict[tuple[str, bool], list] = {}
    for row, cfg in runs:
        by_hw.setdefault((cfg.hardware.name, cfg.train.compile), []).append((row, cfg))
    for (name, compiled), group in by_hw.items():
        setting = f"hardware={name}" + (" train.compile=true" if compiled else "")
        cfgs = [cfg for _, cfg in group]
        measured = [row["tokens_per_s"] for row, _ in group]
        before = [make_plan(cfg) for cfg in cfgs]
        serial = before[0].context.host_serial
        knobs = [k for k in KNOBS if determined(k, before, serial)]
        knobs, values = fewest_knobs(cfgs, measured, knobs)
        after = [make_plan(with_hardware(cfg, **values)) for cfg in cfgs]
        fitted = ", ".join(
            f"{k.field} {getattr(cfgs[0].hardware, k.field) or before[0].context.efficiency:.4g}"
            f" -> {values[k.field]:.4g}"
            for k in knobs
        )
        table = Table(
            title=f"{setting}: {len(group)} measured run(s) in {sweep_dir}; refitted {fitted}",
            title_justify="left",
        )
        names = list(dict.fromkeys(t.name for p in after for t in p.estimate.time.terms))
        cols = [
            "job",
            "point",
            "measured tok/s/dev",
            "predicted",
            "residual",
            "refitted",
            "residual",
        ]
        for col in (*cols, *(f"{n} s" for n in names)):
            table.add_column(col, justify="left" if col in ("job", "point") else "right")
        res_before, res_after = [], []
        for (row, _), b, a, m in zip(group, before, after, measured, strict=True):
            pb, pa = b.estimate.tokens_per_s_per_device, a.estimate.tokens_per_s_per_device
            res_before.append((pb - m) / m)
            res_after.append((pa - m) / m)
            table.add_row(
                row["job"],
                row.get("layout") or " ".join(row["overrides"]),
                f"{m:,.0f}",
                f"{pb:,.0f}",
                f"{res_before[-1]:+.1%}",
                f"{pa:,.0f}",
                f"{res_after[-1]:+.1%}",
                *(f"{a.estimate.time[n]:.3g}" for n in names),
            )
        console.print(table)
        print(term_residuals(after, measured, names))
        overrides = " ".join(f"hardware.{f}={v:.4g}" for f, v in values.items())
        print(
            f"RMS relative residual {rms(res_before):.1%} before, {rms(res_after):.1%} after; "
            f"use it with {setting} {overrides}"
        )


def term_residuals(plans, measured: list[float], names: list[str]) -> str:
    """Per term, the RMS residual of the runs it weighs most in (its share of the predicted
    step above the median share): where the remaining error sits."""
    lines = []
    for n in names:
        shares = [p.estimate.time[n] / p.estimate.time.step for p in plans]
        if max(shares) < 0.05:
            continue
        cut = sorted(shares)[len(shares) // 2]
        picked = [
            (p.estimate.tokens_per_s_per_device - m) / m
            for p, m, sh in zip(plans, measured, shares, strict=True)
            if sh >= cut
        ]
        lines.append(f"{n} ({max(shares):.0%} of a step at most): RMS residual {rms(picked):.1%}")
    return "residual by term, over the runs where it weighs most: " + "; ".join(lines)


@lru_cache(maxsize=1)
def published_plans() -> tuple[list[tuple], dict[str, float], dict[str, float]]:
    """(Run, Config, Plan) of every published run (launcher/plan/published.py), each fused
    stack's efficiency_scale fitted to its own bf16 "fit" runs first, then its
    efficiency_scale_fp8 to its FP8 "fit" run where it published FP8 runs; and those scales."""
    runs = megatron_runs(megatron_flops, compose) + RUNS
    cfgs = {run.name: compose(run.overrides.split()) for run in runs}
    scales, fp8_scales = {}, {}
    for stack in STACKS[1:]:
        own = [r for r in runs if r.stack == stack]
        fit_runs = [r for r in own if r.use == "fit" and not is_fp8(cfgs[r.name])]
        scales[stack] = fit_to(
            [(cfgs[r.name], r.tokens_per_s) for r in fit_runs], scaled_speed, 0.1, 2.0
        )
        for r in own:
            cfgs[r.name] = with_hardware(cfgs[r.name], efficiency_scale=scales[stack])
        fp8 = [r for r in own if is_fp8(cfgs[r.name])]
        fp8_fit = [(cfgs[r.name], r.tokens_per_s) for r in fp8 if r.use == "fit"]
        if fp8_fit:
            fp8_scales[stack] = fit_to(fp8_fit, fp8_speed, 0.1, 2.0)
            for r in fp8:
                cfgs[r.name] = with_hardware(cfgs[r.name], efficiency_scale_fp8=fp8_scales[stack])
    rows = [(run, cfgs[run.name], make_plan(cfgs[run.name])) for run in runs]
    return rows, scales, fp8_scales


def cp_slowdown_speed(cfg, slowdown: float) -> float:
    """tokens/s per device planned for `cfg` with kernels.CP_ATTENTION_SLOWDOWN = slowdown."""
    saved = kernels.CP_ATTENTION_SLOWDOWN
    kernels.CP_ATTENTION_SLOWDOWN = slowdown
    try:
        return make_plan(cfg).estimate.tokens_per_s_per_device
    finally:
        kernels.CP_ATTENTION_SLOWDOWN = saved


def fit_cp_slowdown() -> float:
    """kernels.CP_ATTENTION_SLOWDOWN fitted to the published runs that set it (fits="cp")."""
    runs = [(cfg, r.tokens_per_s) for r, cfg, _ in published_plans()[0] if r.fits == "cp"]
    return fit_to(runs, cp_slowdown_speed, 1.0, 4.0)


def calibrate_published() -> None:
    """Predict every published run (launcher/plan/published.py) and print the errors."""
    planned, scales, fp8_scales = published_plans()
    runs = [run for run, _, _ in planned]
    cfgs = {run.name: cfg for run, cfg, _ in planned}
    tt = compose(["hardware=h100_hbm2e"]).hardware
    print(
        f"stack scales (efficiency_scale on H100): torchtitan {tt.efficiency_scale} "
        f"(h100_hbm2e's), "
        + ", ".join(f"{k} {v:.3f} (fitted to its fit run)" for k, v in scales.items())
        + f"; FP8 (efficiency_scale_fp8): torchtitan {tt.efficiency_scale_fp8} (h100_hbm2e's)"
        + "".join(f", {k} {v:.3f} (fitted to its FP8 fit run)" for k, v in fp8_scales.items())
        + f"; the attention core over cp >= {kernels.CP_SLOW_FROM} ranks "
        f"{fit_cp_slowdown():.3f} times slower (CP_ATTENTION_SLOWDOWN, fitted to the CP 4 run; "
        f"in use: {kernels.CP_ATTENTION_SLOWDOWN})"
    )
    table = Table(title="published runs: predicted against published", title_justify="left")
    cols = ("run", "engine", "use", "tok/s/GPU", "predicted", "error", "MFU", "predicted MFU")
    for col in (*cols, "points", "memory GiB", "predicted GiB"):
        table.add_column(col, justify="left" if col in ("run", "engine", "use") else "right")
    rows = []
    for run, _, plan in planned:
        est = plan.estimate
        rel = est.tokens_per_s_per_device / run.tokens_per_s - 1
        mfu = (
            run.mfu
            if run.mfu is not None
            else est.mfu * run.tokens_per_s / est.tokens_per_s_per_device
        )
        points = 100 * mfu * rel
        mem = plan.memory.total / 2**30
        mem_err = mem / run.memory_gib - 1 if run.memory_gib else None
        rows.append((run, rel, points, mem_err))
        table.add_row(
            run.name,
            run.engine,
            f"{run.use}: {run.lacks}" if run.use == "shown" else run.use,
            f"{run.tokens_per_s:,.0f}",
            f"{est.tokens_per_s_per_device:,.0f}",
            f"{rel:+.1%}",
            f"{mfu:.1%}",
            f"{mfu * (1 + rel):.1%}",
            f"{points:+.1f}",
            f"{run.memory_gib:g}" if run.memory_gib else "-",
            f"{mem:.1f}" + (f" ({mem_err:+.0%})" if mem_err is not None else ""),
        )
    Console(width=190).print(table)
    copies = [f"{r.name} ({r.lacks})" for r in runs if r.use == "copy"]
    print(
        "copy: a fit row's workload (calibrate.workload), shown, never held out: "
        + "; ".join(copies)
    )
    for precision in ("bf16", "fp8"):
        held = [
            r
            for r in rows
            if r[0].use == "held-out" and is_fp8(cfgs[r[0].name]) == (precision == "fp8")
        ]
        mfu_err = [abs(p) for _, _, p, _ in held]
        print(
            f"held-out MFU, {precision}: mean absolute error "
            f"{sum(mfu_err) / len(mfu_err):.1f} points, worst {max(mfu_err):.1f} "
            f"({len(held)} runs)"
        )
        for engine in ("fsdp2", "megatron", "meta"):
            errs = [abs(rel) for run, rel, _, _ in held if run.engine == engine]
            if errs:
                print(
                    f"held-out tokens/s, {engine} {precision}: mean absolute error "
                    f"{sum(errs) / len(errs):.1%} ({len(errs)} runs)"
                )
    mems = [abs(m) for _, _, _, m in rows if m is not None]
    print(f"peak memory: worst error {max(mems):.0%} ({len(mems)} runs with a published figure)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launcher.plan.calibrate", description=__doc__)
    parser.add_argument(
        "--from",
        dest="sweep_dir",
        help="refit from this sweep's measured runs, or from the one-device benchmarks "
        "(python -m launcher.bench.gpu --json FILE) in this directory",
    )
    parser.add_argument(
        "--hopper",
        action="store_true",
        help="fit each GPU preset's efficiency_scale and compile_factor to runs on its own "
        "part: torchtitan's (h100_hbm2e, a100_80g) and this engine's (h100_80g, h200)",
    )
    parser.add_argument(
        "--published", action="store_true", help="the errors on every published run"
    )
    args = parser.parse_args(argv)
    if args.published:
        return calibrate_published()
    if args.hopper:
        return calibrate_hopper()
    if args.sweep_dir:
        if not Path(args.sweep_dir).is_dir():
            fail(f"--from {args.sweep_dir}: no such directory (a sweep's, or benchmarks')")
        return calibrate_from(args.sweep_dir)
    # Megatron's fused kernels as compiled blocks; the even rows fit, the odd ones check.
    cfgs = [
        compose([f"recipe={name}", *FUSED.split(), *MEGATRON_KERNELS.split()])
        for name, _ in MEGATRON
    ]
    reported = [r for _, r in MEGATRON]
    fitted = [i % 2 == 0 for i in range(len(MEGATRON))]
    eff_max, eff_dim, _ = fit(
        [c for c, f in zip(cfgs, fitted, strict=True) if f],
        [r for r, f in zip(reported, fitted, strict=True) if f],
    )
    pred = predicted_tflops(cfgs, eff_max, eff_dim)
    table = Table(
        title=f"calibration: a GEMM of narrowest dimension w at {eff_max:.3f} x w / (w + "
        f"{eff_dim:.0f}) of peak (in use: {kernels.EFFICIENCY_MAX} x w / (w + "
        f"{kernels.EFFICIENCY_DIM:.0f}))",
        title_justify="left",
    )
    for col in ("recipe", "TP", "PP", "GPUs", "fits", "reported TFLOP/s", "predicted", "residual"):
        table.add_column(col, justify="right" if col != "recipe" else "left")
    for (name, rep), cfg, p, f in zip(MEGATRON, cfgs, pred, fitted, strict=True):
        table.add_row(
            name,
            str(cfg.parallel.tp),
            str(cfg.parallel.pp),
            str(cfg.hardware.nodes * cfg.hardware.devices_per_node),
            "yes" if f else "-",
            str(rep),
            f"{p:.1f}",
            f"{(p - rep) / rep:+.1%}",
        )
    Console(width=120).print(table)
    held = [(p - r) / r for p, r, f in zip(pred, reported, fitted, strict=True) if not f]
    every = [(p - r) / r for p, r in zip(pred, reported, strict=True)]
    print(f"RMS relative residual {rms(every):.1%}; on the rows not fitted {rms(held):.1%}")


if __name__ == "__main__":
    main()
