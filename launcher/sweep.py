"""A sweep's summary: every point's status and figures next to the planner's, from its files.

Each job of a sweep (`python -m launcher.train -m ...`, local or `hydra/launcher=slurm`) writes
into SWEEP_DIR/<job number>:
- `overrides.json`: the point's overrides (written by the task, or by the SLURM launcher for a
  point it never submitted);
- `rejected.json`: the rules the point broke (it never ran);
- `plan.json`: the plan it ran under (the planner's predictions, and train_steps);
- `metrics.jsonl`: one row per step (loss, eval loss, tokens/s per device, MFU, peak memory,
  the layout it ran on);
- `status.json`: written by the SLURM launcher: how the queue saw the job end (completed,
  failed with the reason, requeued N times).

The summary reads only those files, so it is the same for a local and a SLURM sweep, and it can
be rebuilt at any time: `python -m launcher.sweep SWEEP_DIR`.

Beside it, the other Hydra callback (conf/config.yaml): a run's or sweep's directory checked
before Hydra writes into it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from launcher.cli import fail
from launcher.runtime import rundir

OVERRIDES, REJECTED, PLAN, METRICS, STATUS = (
    "overrides.json",
    "rejected.json",
    "plan.json",
    "metrics.jsonl",
    "status.json",
)
SUMMARY = "summary.jsonl"


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value) + "\n")
    tmp.replace(path)


def job_row(job_dir: Path) -> dict:
    """One point of the sweep: its overrides, status and measured vs predicted figures."""
    row: dict = {"job": job_dir.name, "overrides": _read(job_dir / OVERRIDES) or []}
    rejected = _read(job_dir / REJECTED)
    if rejected is not None:
        return {**row, "status": "rejected", "reason": _one_line(rejected["problems"])}
    queue = _read(job_dir / STATUS) or {}
    plan = _read(job_dir / PLAN) or {}
    predicted = plan.get("predicted") or {}
    memory = plan.get("memory_gib") or {}
    rows = []
    if (job_dir / METRICS).exists():
        rows = [json.loads(x) for x in (job_dir / METRICS).read_text().splitlines() if x.strip()]
    steps = plan.get("train_steps")
    last = rows[-1] if rows else {}
    if queue.get("status") == "failed":
        status = "failed"
    elif rows and steps is not None and last.get("step") == steps:
        status = "completed"
    else:
        # Stopped before its last step with no word from the queue: a local job that was
        # interrupted, or one still running when the summary was made.
        status = queue.get("status") or ("incomplete" if rows else "failed")
    # Each layout the point ran on, in order: a parallel.auto run re-plans when it is requeued
    # onto another number of nodes (metrics.jsonl rows say which).
    layouts = list(dict.fromkeys(r["layout"] for r in rows if r.get("layout")))
    evals = [r["eval_loss"] for r in rows if isinstance(r.get("eval_loss"), float)]
    row.update(
        layout=_layout(plan) if len(layouts) < 2 else " -> ".join(layouts),
        layouts=layouts,
        status=status,
        reason=queue.get("reason"),
        requeued=queue.get("requeued", 0),
        step=last.get("step"),
        loss=last.get("loss"),
        eval_loss=evals[-1] if evals else None,
        tokens_per_s=_best(rows, "tokens_per_s"),
        predicted_tokens_per_s=predicted.get("tokens_per_s_per_device"),
        mfu=_best(rows, "mfu"),
        predicted_mfu=predicted.get("mfu"),
        peak_memory_gib=max((r.get("peak_memory_gib") or 0 for r in rows), default=None),
        predicted_memory_gib=memory.get("total"),
    )
    return row


def _layout(plan: dict) -> str:
    """The plan's degrees and settings in a few words: "dp 1x2 tp 2 pp 2 1f1b/1 zero 1 mb 2"."""
    deg, lay = plan.get("degrees"), plan.get("layout")
    if not deg or not lay:
        return ""
    out = [f"dp {deg['dp_replicate']}x{deg['dp_shard']}"]
    out += [f"{a} {deg[a]}" for a in ("tp", "cp", "pp", "ep") if deg.get(a, 1) > 1]
    if deg.get("pp", 1) > 1:
        out.append(f"{lay['schedule']}/{lay['stages_per_rank']}")
    out.append(f"zero {lay['zero_stage']} mb {lay['micro_batch_size']}")
    if lay["recompute"] != "none":
        out.append(f"recompute {lay['recompute']}")
    return " ".join(out)


def _best(rows: list[dict], key: str) -> float | None:
    """A step's figure after the first (which includes start-up): the median of the rest."""
    values = sorted(r[key] for r in rows[1:] if r.get(key) is not None)
    return values[len(values) // 2] if values else None


def summarize(sweep_dir: str | Path) -> list[dict]:
    """Every job directory's row, in job order; also written to SWEEP_DIR/summary.jsonl."""
    sweep = Path(sweep_dir)
    jobs = sorted((p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=_num)
    rows = [job_row(p) for p in jobs]
    (sweep / SUMMARY).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _one_line(problems: str) -> str:
    """problems_message's lines ("the plan has 2 problems:", "  - [rule] text") as one."""
    lines = [x.strip().removeprefix("- ") for x in problems.splitlines()]
    return "; ".join(x for x in lines if x and not x.startswith("the plan has"))


def _num(p: Path) -> int:
    return int(p.name)


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
