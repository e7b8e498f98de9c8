"""A sweep directory's files, and one row per point read from them (launcher/sweep.py prints
the rows as the sweep's summary; launcher.plan.calibrate --from fits the planner to them).

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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OVERRIDES, REJECTED, PLAN, METRICS, STATUS = (
    "overrides.json",
    "rejected.json",
    "plan.json",
    "metrics.jsonl",
    "status.json",
)
SUMMARY = "summary.jsonl"


def _read(path: Path, kind: type = dict) -> Any:
    """The file's JSON value when it is a `kind`; None when it is missing or damaged (cut
    short, not JSON, another shape): the job's row then says what the rest of its files say."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, kind) else None


def _rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows; a line that is not a JSON object (cut short by a kill) is left
    out."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            out.append(row)
    return out


def write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value) + "\n")
    tmp.replace(path)


def job_row(job_dir: Path) -> dict:
    """One point of the sweep: its overrides, status and measured vs predicted figures."""
    row: dict = {"job": job_dir.name, "overrides": _read(job_dir / OVERRIDES, list) or []}
    rejected = _read(job_dir / REJECTED)
    if rejected is not None:
        return {**row, "status": "rejected", "reason": _one_line(str(rejected.get("problems")))}
    queue = _read(job_dir / STATUS) or {}
    plan = _read(job_dir / PLAN) or {}
    predicted = plan.get("predicted") or {}
    memory = plan.get("memory_gib") or {}
    rows = _rows(job_dir / METRICS)
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


def job_rows(sweep_dir: str | Path) -> list[dict]:
    """Every job directory's row, in job order."""
    sweep = Path(sweep_dir)
    jobs = sorted((p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=_num)
    return [job_row(p) for p in jobs]


def summarize(sweep_dir: str | Path) -> list[dict]:
    """job_rows, also written to SWEEP_DIR/summary.jsonl."""
    rows = job_rows(sweep_dir)
    (Path(sweep_dir) / SUMMARY).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _one_line(problems: str) -> str:
    """problems_message's lines ("the plan has 2 problems:", "  - [rule] text") as one."""
    lines = [x.strip().removeprefix("- ") for x in problems.splitlines()]
    return "; ".join(x for x in lines if x and not x.startswith("the plan has"))


def _num(p: Path) -> int:
    return int(p.name)
