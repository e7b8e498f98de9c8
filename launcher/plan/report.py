"""The plan as a table (rich) and its problems as one clear message."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from launcher.plan import AXES, Plan
from launcher.plan.memory import GIB


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f} GiB"


def plan_table(plan: Plan) -> Table:
    cfg, t = plan.cfg, plan.cfg.train
    table = Table(title="plan", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    hw = cfg.hardware
    table.add_row("model", f"{cfg.model.name} ({cfg.model.family})")
    table.add_row(
        "hardware",
        f"{hw.name}: {hw.nodes} node(s) x {hw.devices_per_node} {hw.device_type.value} "
        f"= {plan.world_size} ranks, {hw.memory_gib:g} GiB each",
    )
    table.add_row("degrees", "  ".join(f"{a}={plan.degrees[a]}" for a in AXES))
    table.add_row("data parallel", plan.data_parallel_strategy)
    table.add_row(
        "precision",
        f"{cfg.precision.name} (compute {cfg.precision.compute_dtype.value},"
        f" master {cfg.precision.master_dtype.value})",
    )
    table.add_row(
        "batch",
        f"global {t.global_batch_size} seqs = micro {t.micro_batch_size} x accumulation "
        f"{plan.grad_accum} x dp {plan.dp}; seq_len {t.seq_len}; "
        f"{t.global_batch_size * t.seq_len:,} tokens/step",
    )
    if plan.counts is not None:
        table.add_row("parameters", f"{plan.counts.total:,} ({plan.counts.total / 1e9:.3f} B)")
        table.add_row("FLOPs/token", f"{plan.flops_per_token:.4g} (6N + causal attention)")
    if plan.memory is not None:
        m = plan.memory
        table.add_row(
            "memory/rank",
            f"params {_gib(m.params)}, grads {_gib(m.grads)}, optimizer {_gib(m.optimizer)}, "
            f"activations {_gib(m.activations)}, other {_gib(m.other)}",
        )
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        table.add_row("total/rank", f"{_gib(m.total)} of {hw.memory_gib:g} GiB: {verdict}")
    for w in plan.warnings:
        table.add_row("warning", str(w), style="yellow")
    return table


def print_plan(plan: Plan, console: Console | None = None) -> None:
    (console or Console()).print(plan_table(plan))


def problems_message(plan: Plan) -> str:
    n = len(plan.errors)
    lines = [f"the plan has {n} problem{'s' if n > 1 else ''}:"]
    lines += [f"  - {p}" for p in plan.errors]
    return "\n".join(lines)
