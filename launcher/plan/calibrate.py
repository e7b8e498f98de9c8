"""`python -m launcher.plan.calibrate`: fit the compute efficiency to the Megatron-LM table;
`--from SWEEP_DIR`: refit it from this engine's own measured runs.

Each row of Narayanan et al. 2021, Table 1 is a recipe (recipes/megatron_gpt_*.yaml). For a
candidate efficiency the planner predicts each row's step time; the achieved TFLOP/s per GPU
follows with Megatron's own FLOP count, 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration
(full recomputation, attention counted without the causal mask). The efficiency minimising the
squared relative error (efficiency = max x dim / (dim + d0)) is printed with each
row's residual; EFFICIENCY_MAX and EFFICIENCY_DIM in launcher/plan/estimate.py hold the fit.

`--hopper` fits `hardware.efficiency_scale` of the Hopper presets (the share of the A100 fit
that H100 reaches) to torchtitan's published eager bf16 runs on H100, and prints those runs'
residuals with the runs that check it: torchtitan's compiled runs (EFFICIENCY_COMPILED) and
Llama 3 405B's own run.

`--from SWEEP_DIR` reads a sweep's completed jobs (launcher/sweep.py: each job's overrides and
its measured tokens/s per device, the median step after the first) and fits, per hardware
preset and train.compile, the one constant efficiency (a fraction of peak_tflops) whose
predictions come closest, in squared relative error. It prints every job's residual before
(the efficiency its config used) and after, and the override to use: `hardware.efficiency=X`,
the efficiency of runs as configured (the compile factor does not rescale it). The Megatron
fit stays the default.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from launcher.cli import compose, fail
from launcher.plan import estimate, make_plan

# (recipe, reported TFLOP/s per GPU) from docs/sources.md, published layouts.
MEGATRON = [
    ("megatron_gpt_1_7b", 137),
    ("megatron_gpt_3_6b", 138),
    ("megatron_gpt_7_5b", 142),
    ("megatron_gpt_18_4b", 135),
    ("megatron_gpt_39_1b", 138),
    ("megatron_gpt_76_1b", 140),
    ("megatron_gpt_145_6b", 148),
    ("megatron_gpt_310_1b", 155),
    ("megatron_gpt_529_6b", 163),
    ("megatron_gpt_1008b", 163),
]


# Published bf16 runs on H100 SXM (peak 989 TFLOP/s), tokens/s per GPU: (run, its overrides,
# published, fitted). torchtitan's rows: Llama 3.1 on H100s capped at 500 W (their footnote: the
# real peak lies between SXM's and NVL's, so these understate a 700 W H100), seq 8192; the 8B rows
# from benchmarks/llama3_h100_202412_torchtitan.md Tables 1 and 3 (selective op AC), the 405B
# row from docs/performance.md (mid-2024, "Optimizations: None", compile off in its toml).
# The eager rows are this engine's kind of stack (FSDP2, DTensor TP, plain PyTorch blocks) and
# are fitted; the compiled rows check EFFICIENCY_COMPILED. Llama 3 405B (Dubey et al. 2024,
# Table 4: 430 TFLOP/s per GPU, 43% MFU, on docs/sources.md's 8,192-GPU layout without
# activation checkpointing) is Meta's own tuned stack, shown for contrast: 430e12 / 2.524e12
# model FLOPs per token (the planner's count; Meta does not give its own) = 170 tokens/s.
TT_8B = "model=llama3_8b train.seq_len=8192 train.micro_batch_size=2 recompute=selective"
ON_8, ON_128 = "train.global_batch_size=16", "hardware.nodes=16 train.global_batch_size=256"
TT_405B = (
    "model=llama3_405b hardware.nodes=16 parallel.tp=8 tensor=sequence_parallel "
    "train.seq_len=8192 train.micro_batch_size=2 train.global_batch_size=32 recompute=full"
)
HOPPER = [
    ("torchtitan 8B, FSDP 8", f"{TT_8B} {ON_8}", 5762, True),
    ("torchtitan 8B, FSDP 128", f"{TT_8B} {ON_128}", 5605, True),
    ("torchtitan 405B, FSDP 16 x TP 8, full AC", TT_405B, 109, True),
    ("torchtitan 8B, FSDP 8, compiled", f"{TT_8B} {ON_8} train.compile=true", 6667, False),
    ("torchtitan 8B, FSDP 128, compiled", f"{TT_8B} {ON_128} train.compile=true", 6514, False),
    (
        "Llama 3 405B (Meta), 8,192 GPUs, no AC",
        "recipe=llama3_405b_8192gpu recompute=none",
        170,
        False,
    ),
]


def megatron_flops(cfg) -> float:
    m, t = cfg.model, cfg.train
    b, s, layers, h, v = t.global_batch_size, t.seq_len, m.n_layers, m.dim, m.vocab_size
    return 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))


def predicted_tflops(cfgs, eff_max: float, eff_dim: float) -> list[float]:
    saved = estimate.EFFICIENCY_MAX, estimate.EFFICIENCY_DIM
    estimate.EFFICIENCY_MAX, estimate.EFFICIENCY_DIM = eff_max, eff_dim
    try:
        out = []
        for cfg in cfgs:
            plan = make_plan(cfg)
            out.append(megatron_flops(cfg) / plan.estimate.time.step / plan.world_size / 1e12)
        return out
    finally:
        estimate.EFFICIENCY_MAX, estimate.EFFICIENCY_DIM = saved


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


def measured_runs(sweep_dir: str) -> list[tuple[dict, object]]:
    """(summary row, Config) of every completed job of the sweep with a measured speed."""
    from launcher import sweep
    from launcher.plan.search import candidate_overrides, with_overrides

    out = []
    for row in sweep.summarize(sweep_dir):
        if row["status"] != "completed" or not row.get("tokens_per_s"):
            continue
        cfg = compose(row["overrides"])
        if cfg.plan.candidate >= 0:  # the layout that job trained
            cfg = compose(with_overrides(row["overrides"], candidate_overrides(cfg)[0]))
        out.append((row, cfg))
    return out


def predicted_speed(cfg, efficiency: float) -> float:
    """tokens/s per device the planner predicts for `cfg` at `efficiency` of peak."""
    hw = replace(cfg.hardware, efficiency=efficiency)
    return make_plan(replace(cfg, hardware=hw)).estimate.tokens_per_s_per_device


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


def fit_efficiency(cfgs, measured: list[float]) -> float:
    """The efficiency (0.1% to 100% of peak) whose predicted speeds come closest."""
    return best_factor(predicted_speed, cfgs, measured, 1e-3, 1.0)


def calibrate_hopper() -> None:
    """Fit hardware.efficiency_scale for H100 to the HOPPER rows marked fitted."""
    cfgs = [compose(["hardware=h100_80g", *overrides.split()]) for _, overrides, _, _ in HOPPER]
    fitted = [(c, row[2]) for c, row in zip(cfgs, HOPPER, strict=True) if row[3]]
    scale = best_factor(scaled_speed, [c for c, _ in fitted], [m for _, m in fitted], 0.1, 2.0)
    table = Table(
        title=f"h100_80g: efficiency_scale {scale:.3f} fitted to torchtitan's eager rows "
        f"(in use: {cfgs[0].hardware.efficiency_scale})",
        title_justify="left",
    )
    for col in ("run", "fitted", "published tok/s/GPU", "predicted", "residual"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for (name, _, published, used), cfg in zip(HOPPER, cfgs, strict=True):
        p = scaled_speed(cfg, scale)
        table.add_row(
            name,
            "yes" if used else "-",
            f"{published:,}",
            f"{p:,.0f}",
            f"{(p - published) / published:+.1%}",
        )
    Console(width=120).print(table)


def calibrate_from(sweep_dir: str) -> None:
    runs = measured_runs(sweep_dir)
    if not runs:
        fail(f"{sweep_dir} has no completed job with a measured speed (see its summary.jsonl)")
    console = Console(width=140)
    # One efficiency per hardware preset and compile setting: a refitted hardware.efficiency
    # is the measured one of runs as configured, which the compile factor does not rescale.
    by_hw: dict[tuple[str, bool], list] = {}
    for row, cfg in runs:
        by_hw.setdefault((cfg.hardware.name, cfg.train.compile), []).append((row, cfg))
    for (name, compiled), group in by_hw.items():
        setting = f"hardware={name}" + (" train.compile=true" if compiled else "")
        cfgs = [cfg for _, cfg in group]
        measured = [row["tokens_per_s"] for row, _ in group]
        before = [make_plan(cfg) for cfg in cfgs]
        eff = fit_efficiency(cfgs, measured)
        after = [predicted_speed(cfg, eff) for cfg in cfgs]
        table = Table(
            title=f"{setting}: {len(group)} measured run(s) in {sweep_dir}; refitted "
            f"efficiency {eff:.4f} of peak_tflops={cfgs[0].hardware.peak_tflops:g}",
            title_justify="left",
        )
        cols = ("job", "point", "measured tok/s/dev", "efficiency in use", "predicted")
        for col in (*cols, "residual", "refitted", "residual"):
            table.add_column(col, justify="left" if col in ("job", "point") else "right")
        res_before, res_after = [], []
        for (row, _), plan, m, a in zip(group, before, measured, after, strict=True):
            b = plan.estimate.tokens_per_s_per_device
            res_before.append((b - m) / m)
            res_after.append((a - m) / m)
            table.add_row(
                row["job"],
                row.get("layout") or " ".join(row["overrides"]),
                f"{m:,.0f}",
                f"{plan.context.efficiency:.4f}",
                f"{b:,.0f}",
                f"{res_before[-1]:+.1%}",
                f"{a:,.0f}",
                f"{res_after[-1]:+.1%}",
            )
        console.print(table)
        rms = lambda r: math.sqrt(sum(x * x for x in r) / len(r))  # noqa: E731
        print(
            f"RMS relative residual {rms(res_before):.1%} before, {rms(res_after):.1%} after; "
            f"use it with {setting} hardware.efficiency={eff:.4f}"
            + ("" if compiled else f" (or put efficiency: {eff:.4f} in conf/hardware/{name}.yaml)")
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launcher.plan.calibrate", description=__doc__)
    parser.add_argument("--from", dest="sweep_dir", help="refit from this sweep's measured runs")
    parser.add_argument(
        "--hopper", action="store_true", help="fit the Hopper presets' efficiency_scale"
    )
    args = parser.parse_args(argv)
    if args.hopper:
        return calibrate_hopper()
    if args.sweep_dir:
        if not Path(args.sweep_dir).is_dir():
            fail(f"--from {args.sweep_dir}: no such sweep directory")
        return calibrate_from(args.sweep_dir)
    cfgs = [compose([f"recipe={name}"]) for name, _ in MEGATRON]
    reported = [r for _, r in MEGATRON]
    eff_max, eff_dim, pred = fit(cfgs, reported)
    table = Table(
        title=f"calibration: efficiency {eff_max:.3f} x dim / (dim + {eff_dim:.0f}) "
        f"(in use: {estimate.EFFICIENCY_MAX} x dim / (dim + {estimate.EFFICIENCY_DIM:.0f}))",
        title_justify="left",
    )
    for col in ("recipe", "TP", "PP", "GPUs", "reported TFLOP/s", "predicted", "residual"):
        table.add_column(col, justify="right" if col != "recipe" else "left")
    for (name, rep), cfg, p in zip(MEGATRON, cfgs, pred, strict=True):
        table.add_row(
            name,
            str(cfg.parallel.tp),
            str(cfg.parallel.pp),
            str(cfg.hardware.nodes * cfg.hardware.devices_per_node),
            str(rep),
            f"{p:.1f}",
            f"{(p - rep) / rep:+.1%}",
        )
    rms = (sum(((p - r) / r) ** 2 for p, r in zip(pred, reported, strict=True)) / len(pred)) ** 0.5
    Console(width=120).print(table)
    print(f"RMS relative residual {rms:.1%}")


if __name__ == "__main__":
    main()
