"""A sweep's summary: every point's status and figures next to the planner's, from its files
(launcher/runtime/sweep_files.py), so it is the same for a local and a SLURM sweep, and it can
be rebuilt at any time: `python -m launcher.sweep SWEEP_DIR`.

Beside it, the other Hydra callback (conf/config.yaml): a run's or sweep's directory checked
before Hydra writes into it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from launcher.cli import fail
from launcher.runtime import rundir
from launcher.runtime.sweep_files import SUMMARY, summarize


def _pair(measured, predicted, fmt: str) -> str:
    if measured is None and predicted is None:
        return ""
    got = "-" if measured is None else format(measured, fmt)
    want = "-" if predicted is None else format(predicted, fmt)
    return f"{got} / {want}"


def summary_table(rows: list[dict], title: str) -> Table:
    """One line per point: the overrides that vary across the sweep (the shared ones go in
    the title), status, final loss, and each figure as measured / planned."""
    shared = set.intersection(*(set(r["overrides"]) for r in rows)) if rows else set()
    if shared:
        title += "\nevery point: " + " ".join(o for o in rows[0]["overrides"] if o in shared)
    t = Table(title=escape(title), title_justify="left")
    for col in ("#", "point", "layout", "status", "final loss", "eval loss"):
        t.add_column(col)
    for col in ("tokens/s/dev", "MFU %", "peak GiB"):
        t.add_column(f"{col}\nmeasured / planned", justify="right")
    for r in rows:
        status = r["status"]
        if r.get("requeued"):
            status += f" (requeued {r['requeued']}x)"
        if r.get("reason") and status == "rejected":
            status += " (below)"  # the rules it broke, under the table: they are long
        elif r.get("reason"):
            status += f": {r['reason']}"
        t.add_row(
            r["job"],
            escape(" ".join(o for o in r["overrides"] if o not in shared)),
            escape(r.get("layout", "").replace(" -> ", "\n-> ")),  # a layout per line
            escape(status),
            "" if r.get("loss") is None else f"{r['loss']:.4f}",
            "" if r.get("eval_loss") is None else f"{r['eval_loss']:.4f}",
            _pair(r.get("tokens_per_s"), r.get("predicted_tokens_per_s"), ",.0f"),
            _pair(
                None if r.get("mfu") is None else r["mfu"] * 100,
                None if r.get("predicted_mfu") is None else r["predicted_mfu"] * 100,
                ".2f",
            ),
            _pair(r.get("peak_memory_gib"), r.get("predicted_memory_gib"), ".2f"),
        )
    return t


def rejected_lines(rows: list[dict]) -> list[str]:
    """One line per rejected point: its number, overrides and the rules it broke."""
    return [
        f"#{r['job']} rejected ({' '.join(r['overrides'])}): {r['reason']}"
        for r in rows
        if r["status"] == "rejected"
    ]


def print_summary(sweep_dir: str | Path) -> list[dict]:
    rows = summarize(sweep_dir)
    console = Console(width=160)
    console.print(summary_table(rows, f"sweep {sweep_dir} ({SUMMARY} beside it)"))
    for line in rejected_lines(rows):
        console.print(escape(line), soft_wrap=True)
    return rows


class SweepSummary(Callback):
    """Hydra callback (conf/config.yaml): the summary once every job of a sweep has ended."""

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        if sweep.is_dir():
            print_summary(sweep)


class OutputDirCheck(Callback):
    """Hydra callback (conf/config.yaml): the run's or the sweep's directory can be written,
    with room, checked before Hydra creates it and writes .hydra/ there (a read-only or full
    disk otherwise ends in Hydra's traceback)."""

    def on_run_start(self, config, **kwargs) -> None:
        # launcher.plan writes nothing into its directory (".", hydra.output_subdir=null)
        if config.hydra.output_subdir is not None or not Path(config.hydra.run.dir).is_dir():
            checked_dir(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config, **kwargs) -> None:
        checked_dir(config.hydra.sweep.dir, "hydra.sweep.dir")


def checked_dir(path: str, what: str) -> None:
    try:
        rundir.writable(Path(str(path)), what)
    except rundir.DirectoryProblem as e:
        fail(str(e))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.stderr.write("usage: python -m launcher.sweep SWEEP_DIR\n")
        sys.exit(2)
    print_summary(sys.argv[1])
