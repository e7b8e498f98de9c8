"""`python -m launcher.plan.compare OVERRIDES... --rows ROW... [--columns C,...] [--comment]`:
the planner's figures for one configuration and its variants, as a Markdown table.

Each row is the base overrides plus the row's (a quoted, space-separated list; "" is the base as
written). The docs and the recipes' headers show planner figures only through this command, in
blocks `make docs` regenerates and the docs test compares (launcher/docs.py), so no figure is
copied by hand and none drifts when the planner changes.

    python -m launcher.plan.compare recipe=kimi_k2_h800 --rows "" recompute=none recompute=op
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass

from hydra.errors import HydraException

from launcher import configs
from launcher.cli import compose, fail
from launcher.plan import Plan, engine_plan
from launcher.plan import bubble as pl
from launcher.plan.memory import GIB
from launcher.plan.report import time_sum
from launcher.plan.rules import NOT_AVAILABLE


@dataclass(frozen=True)
class Column:
    header: str
    value: Callable[[Plan], str]


def _pipeline_shape(plan: Plan) -> tuple | None:
    lay = plan.layout
    if lay is None or lay.pp == 1:
        return None
    return (lay.schedule, lay.pp, lay.stages_per_rank, lay.microbatches)


def _bubble(plan: Plan) -> str:
    shape = _pipeline_shape(plan)
    return f"{pl.bubble_fraction(*shape):.1%}" if shape else "-"


def _in_flight(plan: Plan) -> str:
    shape = _pipeline_shape(plan)
    return f"{pl.inflight_microbatches(*shape):g}" if shape else "-"


def three_digits(x: float) -> str:
    """12.0, 127, 4.91: three significant digits, the trailing zeros kept."""
    if not x:
        return "0"
    rounded = float(f"{x:.3g}")
    return f"{rounded:.{max(0, 2 - math.floor(math.log10(abs(rounded))))}f}"


def checkpoint_minutes(plan: Plan) -> float | None:
    """Minutes between two saves at the planned step time (None: no saves, or no estimate)."""
    interval = plan.cfg.checkpoint.interval
    if not interval or plan.estimate is None:
        return None
    return interval * plan.estimate.time.step / 60


def verdict(plan: Plan) -> str:
    """fits, or what stops the layout: its memory (its high figure where only that is over), the
    rules it breaks, the engine."""
    rules = {p.rule for p in plan.errors} - {"memory", NOT_AVAILABLE}
    parts = [] if plan.fits or plan.memory is None else ["does not fit"]
    if parts and plan.memory.total <= plan.cfg.hardware.memory_gib * GIB:
        parts = [f"does not fit: its band reaches {plan.estimate.memory_high / GIB:.1f}"]
    parts += [f"refused ({', '.join(sorted(rules))})"] if rules else []
    parts += (
        ["the engine cannot run it yet"] if NOT_AVAILABLE in {p.rule for p in plan.errors} else []
    )
    return "; ".join(parts) or "fits"


def _gib(size: Callable[[Plan], float]) -> Callable[[Plan], str]:
    return lambda plan: f"{size(plan) / GIB:.1f}" if plan.memory else "-"


def _timed(figure: Callable[[Plan], str]) -> Callable[[Plan], str]:
    return lambda plan: figure(plan) if plan.estimate else "-"


COLUMNS = {
    "memory": Column("memory GiB", _gib(lambda p: max(p.memory.total, p.memory.start))),
    "activations": Column("activations GiB", _gib(lambda p: p.memory.activations)),
    "step": Column("step s", _timed(lambda p: three_digits(p.estimate.time.step))),
    "mfu": Column("MFU", _timed(lambda p: f"{p.estimate.mfu:.1%}")),
    "tokens": Column("tok/s/dev", _timed(lambda p: f"{p.estimate.tokens_per_s_per_device:,.0f}")),
    "terms": Column("step's terms, s", _timed(lambda p: time_sum(p.estimate.time))),
    "bubble": Column("bubble (of compute)", _bubble),
    "in_flight": Column("rank 0's peak in-flight micro-batches", _in_flight),
    "verdict": Column("verdict", verdict),
}
DEFAULT_COLUMNS = "memory,step,mfu,verdict"


def plans(base: list[str], rows: list[str]) -> list[Plan]:

    return [engine_plan(compose([*base, *shlex.split(row)])) for row in rows]


def table(rows: list[str], plans: list[Plan], columns: list[str]) -> str:
    """The Markdown table: one line per row, the row's overrides first."""
    capacity = None
    lines = []
    for row, plan in zip(rows, plans, strict=True):
        capacity = capacity or plan.cfg.hardware.memory_gib
        cells = [f"`{row}`" if row else "as written", *(COLUMNS[c].value(plan) for c in columns)]
        lines.append("| " + " | ".join(cells) + " |")
    headers = [COLUMNS[c].header for c in columns]
    if "memory" in columns and capacity:
        headers[columns.index("memory")] += f" (of {capacity:g})"
    head = ["| overrides | " + " | ".join(headers) + " |", "|---" * (len(columns) + 1) + "|"]
    return "\n".join([*head, *lines]) + "\n"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.plan.compare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("overrides", nargs="*", help="the base configuration (as for plan)")
    parser.add_argument(
        "--rows", nargs="+", default=[""], help='each row\'s own overrides ("" = the base)'
    )
    parser.add_argument(
        "--columns",
        default=DEFAULT_COLUMNS,
        help=f"comma-separated, of {', '.join(COLUMNS)} (default {DEFAULT_COLUMNS})",
    )
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="add how often the first row saves a checkpoint at its planned step time",
    )
    parser.add_argument("--comment", action="store_true", help='each line as a YAML comment ("# ")')
    args = parser.parse_args(argv)
    args.columns = args.columns.split(",")
    unknown = [c for c in args.columns if c not in COLUMNS]
    if unknown:
        parser.error(f"--columns {','.join(unknown)}: no such column (of {', '.join(COLUMNS)})")
    return args


def generate(argv: list[str]) -> str:
    """What the command prints (launcher.docs calls this in its own process)."""
    args = parse(argv)
    found = plans(args.overrides, args.rows)
    text = table(args.rows, found, args.columns)
    minutes = checkpoint_minutes(found[0])
    if args.checkpoint and minutes is not None:
        interval = found[0].cfg.checkpoint.interval
        text += f"\ncheckpoint.interval={interval}: a save every {minutes:.1f} min\n"
    if args.comment:
        text = "".join(f"# {line}".rstrip() + "\n" for line in text.splitlines())
    return text


def main(argv: list[str]) -> None:
    """Print the table; an override Hydra or the checks refuse ends with its message, exit 2.
    The user's config directories (--config-dir DIR, launcher/configs.py) are found too."""
    try:
        sys.stdout.write(generate(configs.adopt(argv)))
    except (ValueError, HydraException) as e:
        fail(str(e))


if __name__ == "__main__":
    main(sys.argv[1:])
