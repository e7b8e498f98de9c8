"""Where runs stand, and how they went: `python -m launcher.runs`.

    python -m launcher.runs [DIR ...]                 a table of the runs under DIR (default:
                                                      outputs and multirun)
    python -m launcher.runs plot RUN ... --out F.png  loss, eval loss, lr, gradient norm and
                                                      tokens/s against step, one line per run

A run is a directory with a metrics.jsonl. Everything comes from its files: plan.json (model,
steps to train, layout, the command's overrides: runs of one model show the ones that set each
apart), metrics.jsonl (steps done, last loss, the layout each step ran on),
checkpoints/ (the newest complete one), run.lock (held while it runs), stopped.json and
exit.json (how it ended). Nothing is imported from torch: the table is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import yaml

from launcher.checkpoint.store import newest_complete
from launcher.runtime.failures import EXIT_FILE, STOPPED_FILE
from launcher.runtime.rundir import LOCK, record_of
from launcher.runtime.scratch import output_problem, writing

METRICS, PLAN = "metrics.jsonl", "plan.json"
ROOTS = ("outputs", "multirun")
DEPTH = 4  # outputs/<run>, multirun/<sweep>/<n>: run directories sit a few levels down
RECENT_S = 600.0
# What `plot` draws: (metrics.jsonl key, panel title).
PANELS = (
    ("loss", "training loss"),
    ("eval_loss", "eval loss"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm"),
    ("tokens_per_s", "tokens/s per device"),
)


def find(roots: list[Path]) -> list[Path]:
    """Every run directory under `roots` (a root that is itself a run counts), in path order."""
    found = []
    for root in roots:
        for here, dirs, files in os.walk(root):
            depth = Path(here).relative_to(root).parts
            if METRICS in files:
                found.append(Path(here))
            dirs[:] = [] if len(depth) >= DEPTH else [d for d in dirs if d != "checkpoints"]
    return sorted(set(found))


def rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl's whole rows (a row cut short by a crash is skipped)."""
    return [row for row in parsed(run_dir) if row is not None]


def parsed(run_dir: Path) -> list[dict | None]:
    """Each line of metrics.jsonl as its row, or None where it is not one."""
    if not (run_dir / METRICS).is_file():  # a device or a link to one is read without end
        return []
    out = []
    # Bytes that are not UTF-8 (a damaged or foreign file) spoil only their own lines.
    for line in (run_dir / METRICS).read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        ok = isinstance(row, dict) and isinstance(row.get("step"), int)
        out.append(row if ok else None)
    return out


def foreign_line(run_dir: Path) -> int | None:
    """The first line of metrics.jsonl, counted from 1, that is not a row: only the last line
    of a run's own file can be (cut short by a crash)."""
    lines = parsed(run_dir)
    return next((i + 1 for i, row in enumerate(lines[:-1]) if row is None), None)


def running(run_dir: Path) -> str | None:
    """ "running" while a process holds the run's lock (launcher/runtime/rundir.py), read from
    /proc/locks rather than by taking it (a probe holding it, even briefly, would refuse the
    run's own start). A run on another host of a shared file system shows as "running on
    HOST" while its lock names that host and metrics.jsonl changed in the last RECENT_S."""
    path = run_dir / LOCK
    try:
        st = path.stat()
        me = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        held = any(
            line.split()[1:2] == ["FLOCK"] and line.split()[5] == me
            for line in Path("/proc/locks").read_text().splitlines()
        )
    except (OSError, IndexError):
        return None
    if held:
        return "running"
    host = record_of(path).get("host")
    try:
        recent = time.time() - (run_dir / METRICS).stat().st_mtime < RECENT_S
    except OSError:
        recent = False
    return f"running on {host}" if host and host != socket.gethostname() and recent else None


def summary(run_dir: Path) -> dict:
    """One run: model, layout, steps done / total, last loss, status, newest checkpoint."""
    plan, done = record_of(run_dir / PLAN), rows(run_dir)
    last = done[-1] if done else {}
    steps, step = plan.get("train_steps"), last.get("step", 0)
    if now := running(run_dir):
        status = now
    elif steps is not None and step >= steps:
        status = "finished"
    elif (run_dir / EXIT_FILE).exists():
        status = f"ended (exit {record_of(run_dir / EXIT_FILE).get('status', '?')})"
    elif (run_dir / STOPPED_FILE).exists():
        status = "stopped"
    else:
        status = "failed"  # not running, not at its last step, and no stop recorded
    newest = (
        newest_complete(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else None
    )
    layouts = list(dict.fromkeys(r["layout"] for r in done if r.get("layout")))
    evals = [r["eval_loss"] for r in done if isinstance(r.get("eval_loss"), float)]
    return {
        "run": str(run_dir),
        "overrides": overrides_of(run_dir, plan),
        "model": plan.get("model") or run_dir.name.split("-")[0],
        "layout": layouts[-1].split(": ", 1)[-1] if layouts else "",
        "step": step,
        "steps": steps,
        "loss": last.get("loss"),
        "eval_loss": evals[-1] if evals else None,
        "status": status,
        "checkpoint": newest.path.name if newest else None,
    }


def overrides_of(run_dir: Path, plan: dict) -> list[str] | None:
    """The command's overrides: plan.json's, or Hydra's record of them in runs from before
    plan.json held them (None: neither)."""
    if isinstance(plan.get("overrides"), list):
        return [str(o) for o in plan["overrides"]]
    hydra = run_dir / ".hydra" / "overrides.yaml"
    if not hydra.is_file():  # missing, or a device read without end
        return None
    try:
        listed = yaml.safe_load(hydra.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return [str(o) for o in listed] if isinstance(listed, list) else None


def differences(runs: list[dict]) -> dict[str, str]:
    """Run -> the overrides that set it apart from the other runs of its model (those not
    common to them all), where a model has several runs."""
    by_model: dict[str, list[dict]] = {}
    for r in runs:
        if r["overrides"] is not None:
            by_model.setdefault(r["model"], []).append(r)
    out = {}
    for group in by_model.values():
        if len(group) < 2:
            continue
        common = set.intersection(*(set(r["overrides"]) for r in group))
        for r in group:
            out[r["run"]] = " ".join(o for o in r["overrides"] if o not in common) or "-"
    return out


def table(runs: list[dict]):
    from rich.table import Table

    differs = differences(runs)
    t = Table(title=f"{len(runs)} run(s)", title_justify="left")
    columns = ("run", "model", *(["differs"] if differs else []), "layout", "steps", "loss")
    for col in (*columns, "eval", "status", "checkpoint"):
        t.add_column(col, justify="right" if col in ("steps", "loss", "eval") else "left")
    for r in runs:
        t.add_row(
            r["run"],
            r["model"],
            *([differs.get(r["run"], "")] if differs else []),
            r["layout"],
            f"{r['step']} / {r['steps'] if r['steps'] is not None else '?'}",
            "" if r["loss"] is None else f"{r['loss']:.4f}",
            "" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}",
            r["status"],
            r["checkpoint"] or "",
        )
    return t


def plot(run_dirs: list[Path], out: Path, fmt: str) -> None:
    """PANELS against step, one line per run, to `out` in format `fmt` (png, svg, pdf)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), 1, figsize=(8, 2.4 * len(PANELS)), sharex=True)
    for run_dir in run_dirs:
        done = rows(run_dir)
        for ax, (key, _) in zip(axes, PANELS, strict=True):
            points = [(r["step"], r[key]) for r in done if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points, strict=True), marker="." if len(points) < 30 else None,
                        label=run_dir.name)  # fmt: skip
    for ax, (_, title) in zip(axes, PANELS, strict=True):
        ax.set_title(title, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
    if axes[0].lines:  # none where no run has a whole row yet
        axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, format=fmt)
    plt.close(fig)


def fail(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        parser = argparse.ArgumentParser(
            prog="python -m launcher.runs plot",
            description="Loss, eval loss, lr, gradient norm and tokens/s against step.",
        )
        parser.add_argument("runs", nargs="+", type=Path, help="run directories")
        parser.add_argument("--out", type=Path, required=True, help="FILE.png, .svg or .pdf")
        args = parser.parse_args(argv[1:])
        missing = [str(r) for r in args.runs if not (r / METRICS).is_file()]
        if missing:
            fail(f"not a run directory (no {METRICS}): {', '.join(missing)}")
        for run in args.runs:
            if line := foreign_line(run):
                fail(f"{run / METRICS}:{line} is not a metrics row of this launcher: a damaged "
                     "or foreign file")  # fmt: skip
        if args.out.suffix.lower() not in (".png", ".svg", ".pdf"):
            fail(f"--out {args.out}: the file name must end in .png, .svg or .pdf")
        if not args.out.parent.is_dir():
            fail(f"--out {args.out}: no such directory {args.out.parent}")
        if problem := output_problem(args.out, "--out"):
            fail(problem)
        # Drawn beside it, then renamed over it: a disk that fills keeps the old file whole.
        with writing(args.out, f"--out {args.out}") as partial:
            plot(args.runs, partial, args.out.suffix[1:].lower())
            os.replace(partial, args.out)
        print(f"wrote {args.out}: {len(args.runs)} run(s)")
        return
    parser = argparse.ArgumentParser(
        prog="python -m launcher.runs",
        description="The runs under DIR (default: outputs and multirun): model, layout, steps "
        "done / total, last loss and eval loss, status (running, finished, stopped, failed), "
        "newest checkpoint. `python -m launcher.runs plot RUN ... --out F.png` draws them.",
    )
    parser.add_argument("dirs", nargs="*", type=Path, help="where to look for runs")
    args = parser.parse_args(argv)
    roots = args.dirs or [Path(r) for r in ROOTS if Path(r).is_dir()]
    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing:
        fail(f"no such directory: {', '.join(missing)}")
    from rich.console import Console

    Console(width=200).print(table([summary(r) for r in find(roots)]))


if __name__ == "__main__":
    main()
