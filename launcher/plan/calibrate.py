"""`python -m launcher.plan.calibrate`: fit the compute efficiency to the Megatron-LM table.

Each row of Narayanan et al. 2021, Table 1 is a recipe (recipes/megatron_gpt_*.yaml). For a
candidate efficiency the planner predicts each row's step time; the achieved TFLOP/s per GPU
follows with Megatron's own FLOP count, 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration
(full recomputation, attention counted without the causal mask). The efficiency minimising the
squared relative error (efficiency = max x dim / (dim + d0)) is printed with each
row's residual; EFFICIENCY_MAX and EFFICIENCY_DIM in launcher/plan/estimate.py hold the fit.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from launcher.cli import compose
from launcher.plan import estimate, make_plan

# (recipe, reported TFLOP/s per GPU) from REFERENCE.md section 2.
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


def main() -> None:
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
