"""The held-out residuals the plan's bands read (launcher/plan/bands.py): measured over predicted
for every published run held out (launcher/plan/published.py) and every held-out run of this
engine (docs/measured; calibrate.engine_uses), as the planner predicts them with the presets in
use. `python -m launcher.plan.held_out` prints each held-out run's band from the others'
residuals (leave one out) and how many measured figures their bands hold, and says whether
launcher/plan/residuals.py holds these residuals; with `--write` it writes them there."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launcher.plan import bands, calibrate, make_plan
from launcher.plan.bands import Residual

FILE = Path(__file__).with_name("residuals.py")
HEAD = '''"""The held-out residuals of the plan's bands (launcher/plan/bands.py): one row per
held-out run, (name, part, engine, moe, compiled, measured / predicted tokens/s, measured /
predicted memory without the reserve or None). Written by `python -m launcher.plan.held_out
--write`; do not edit (tests/plan/test_bands.py checks it against the runs and the
planner)."""

ROWS = (
'''


def residual(name: str, engine: str, cfg, plan, tokens_per_s: float, memory_gib) -> Residual:
    probe = bands.class_of(cfg)
    reserve = plan.context.reserve / 2**30
    memory = None
    if memory_gib is not None:
        memory = (memory_gib - reserve) / (plan.memory.total / 2**30 - reserve)
    speed = tokens_per_s / plan.estimate.tokens_per_s_per_device
    return Residual(name, probe.part, engine, probe.moe, probe.compiled, speed, memory)


# This engine's runs on this 2-core machine (launcher.train sweeps: their overrides, plans and
# metrics): the cpu preset fitted to `fit` (its header), the other sweeps held out.
CPU = calibrate.MEASURED / "cpu-2026-12-03"
CPU_FIT, CPU_HELD_OUT = "fit", ("families", "layouts")


def cpu_runs() -> list[tuple[str, str, dict, object]]:
    """(name, use, summary row, Config) of the CPU runs; a held-out one that shares a fit run's
    workload (calibrate.near_copies) is a "copy"."""
    runs = [
        (f"{CPU.name}/{sweep}/{row['job']}", "fit" if sweep == CPU_FIT else "held-out", row, cfg)
        for sweep in (CPU_FIT, *CPU_HELD_OUT)
        for row, cfg in calibrate.measured_runs(str(CPU / sweep))
    ]
    copies = calibrate.near_copies([(name, use, cfg) for name, use, _, cfg in runs])
    return [(n, "copy" if n in copies else use, row, cfg) for n, use, row, cfg in runs]


def residual_rows() -> list[Residual]:
    """Every held-out run's residual: the published ones, then this engine's on the GH100 die
    (its peak allocated memory held to the plan's total without the reserve: that includes
    none), then on this CPU (speed only: a CPU process's resident set is mostly the
    interpreter's and torch's, which the plan's reserve stands for)."""
    rows = [
        residual(run.name, run.engine, cfg, plan, run.tokens_per_s, run.memory_gib)
        for run, cfg, plan in calibrate.published_plans()[0]
        if run.use == "held-out"
    ]
    runs = calibrate.engine_runs()
    uses = calibrate.engine_uses(runs)
    for d, row, cfg in runs:
        name = f"{d}/{row['job']}"
        if uses[name] == "-":
            plan = make_plan(cfg)
            peak = row["peak_allocated_gib"] + plan.context.reserve / 2**30
            rows.append(residual(name, "fsdp2", cfg, plan, row["tokens_per_s"], peak))
    for name, use, row, cfg in cpu_runs():
        if use == "held-out":
            rows.append(residual(name, "fsdp2", cfg, make_plan(cfg), row["tokens_per_s"], None))
    return rows


def source(rows: list[Residual]) -> str:
    """launcher/plan/residuals.py's text for `rows`."""
    lines = []
    for r in rows:
        memory = f"{r.memory:.4f}" if r.memory is not None else "None"
        cells = [json.dumps(r.name), json.dumps(r.part), json.dumps(r.engine), str(r.moe)]
        cells += [str(r.compiled), f"{r.speed:.4f}", memory]
        line = f"    ({', '.join(cells)}),"
        if len(line) > 100:  # as ruff format writes it
            line = "    (\n" + "".join(f"        {c},\n" for c in cells) + "    ),"
        lines.append(line)
    return HEAD + "\n".join(lines) + "\n)\n"


def coverage(rows: list[Residual], kind: str) -> list[tuple[Residual, bands.Spread, bool]]:
    """Each row's band of `kind` from the other rows (leave one out), and whether it holds the
    row's measured figure."""
    out = []
    for r in rows:
        value = getattr(r, kind)
        if value is None:
            continue
        s = bands.spread(r, kind, rows)
        out.append((r, s, min(1.0, s.low) <= value <= max(1.0, s.high)))
    return out


def markdown(rows: list[Residual]) -> str:
    """Each held-out run's residuals beside the band of the others (leave one out), and how
    many measured figures those bands hold."""
    speed = {r.name: (s, ok) for r, s, ok in coverage(rows, "speed")}
    memory = {r.name: (s, ok) for r, s, ok in coverage(rows, "memory")}

    def cells(value, entry) -> list[str]:
        if entry is None:
            return ["-", "-"]
        s, ok = entry
        band = f"{min(1, s.low):.3f}-{max(1, s.high):.3f}"
        return [f"{value:.3f}", band if ok else f"{band} **out**"]

    out = [
        "| held-out run | class | tok/s measured / planned | band of the others | memory "
        "measured / planned | band of the others | bands from |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        used = [speed[r.name][0].of] + ([memory[r.name][0].of] if r.name in memory else [])
        row = [r.name, bands.describe(r, bands.FIELDS)]
        row += cells(r.speed, speed.get(r.name)) + cells(r.memory, memory.get(r.name))
        out.append("| " + " | ".join([*row, "; ".join(dict.fromkeys(used))]) + " |")
    out.append("")
    for kind, got in (("tokens/s", speed), ("memory", memory)):
        inside = sum(ok for _, ok in got.values())
        out.append(
            f"{kind}: {inside} of {len(got)} measured figures inside the band of the others "
            f"({inside / len(got):.0%})  "
        )
    return "\n".join(out).rstrip() + "\n"


def generate(argv: list[str]) -> str:
    """docs/planner.md's block: `python -m launcher.plan.held_out`."""
    if argv:
        raise SystemExit(f"python -m launcher.plan.held_out: no arguments in a block, not {argv}")
    return markdown(residual_rows())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launcher.plan.held_out", description=__doc__)
    parser.add_argument(
        "--write", action="store_true", help="write the residuals to launcher/plan/residuals.py"
    )
    args = parser.parse_args(argv)
    rows = residual_rows()
    print(markdown(rows), end="")
    name = FILE.relative_to(FILE.parents[2])
    if args.write:
        FILE.write_text(source(rows))
        print(f"written: {name} ({len(rows)} held-out runs)")
    elif source(rows) != FILE.read_text():
        print(f"{name} is not what these runs give now: --write writes it")


if __name__ == "__main__":
    main()
