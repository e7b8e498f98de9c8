"""The self-test's report: a table on standard output, RUN_DIR/selftest.md for people and
RUN_DIR/selftest.json for tools (one record per row, its figures and what it compared)."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from launcher.plan import make_plan
from launcher.runtime.sweep_files import write_json
from launcher.selftest import fabric, preset, speed
from launcher.selftest.compare import GRAD_RTOL, LOSS_RTOL, PARAM_RTOL
from launcher.selftest.fabric import KIB, MIB

REPORT_MD, REPORT_JSON = "selftest.md", "selftest.json"


def figure(x: float | None) -> str:
    if x is None:
        return "-"
    return "inf" if not math.isfinite(x) else f"{x:.1e}"


def records(results) -> list[dict]:
    out = []
    for r in results:
        v = r.verdict
        out.append(
            {
                "row": r.row.name,
                "axes": list(r.row.axes),
                "overrides": [*r.row.reference, *r.row.layout],
                "status": r.status,
                "seconds": round(r.seconds, 2),
                "loss_rel": None if v is None or not math.isfinite(v.loss) else v.loss,
                "grad_norm_rel": None
                if v is None or not math.isfinite(v.grad_norm)
                else v.grad_norm,
                "params_abs": None if v is None or not math.isfinite(v.params) else v.params,
                "reason": r.reason,
            }
        )
    return out


def markdown(rows: list[dict], head: str) -> str:
    lines = [
        head,
        "",
        "| row | axes | result | loss (rel) | grad norm (rel) | parameters (abs) | s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']} | {' '.join(r['axes'])} | {r['status']} | {figure(r['loss_rel'])} | "
            f"{figure(r['grad_norm_rel'])} | {figure(r['params_abs'])} | {r['seconds']:.1f} |"
        )
    reasons = [f"- {r['row']}: {r['reason']}" for r in rows if r["reason"]]
    return "\n".join([*lines, *([""] if reasons else []), *reasons]) + "\n"


def fabric_records(timings, links, fitted_links) -> list[dict]:
    return [
        {
            "group": t.spot.name,
            "ranks": t.spot.size,
            "collective": t.kind,
            "bytes": t.nbytes,
            "seconds": t.seconds,
            "bus_gbps": round(t.bus_gbps, 4),
            "predicted_s": fabric.predicted(links, t),
            "fitted_s": fabric.predicted(fitted_links, t),
        }
        for t in timings
    ]


def size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def fabric_markdown(rows: list[dict], hw_name: str, fitted: dict, preset: str) -> str:
    lines = [
        f"Fabric: each collective's slowest rank, median of its repeats, against the planner's "
        f"collective model with {hw_name}'s figures and with the fitted ones.",
        "",
        "| group | ranks | collective | size | ms | bus GB/s | preset ms | x preset | fitted ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["seconds"] / r["predicted_s"] if r["predicted_s"] else math.inf
        lines.append(
            f"| {r['group']} | {r['ranks']} | {r['collective']} | {size(r['bytes'])} | "
            f"{r['seconds'] * 1e3:.3g} | {r['bus_gbps']:.3g} | {r['predicted_s'] * 1e3:.3g} | "
            f"{ratio:.2f} | {r['fitted_s'] * 1e3:.3g} |"
        )
    shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(fitted.items()))
    lines += ["", f"Fitted: {shown}; written as the preset {preset}."]
    return "\n".join(lines) + "\n"


def speed_record(timed, fitted: dict) -> tuple[dict | None, str]:
    """The speed row's record and its lines; `fitted` gains the efficiency fitted to it."""
    if timed is None:
        return None, ""
    if timed.reason:
        return {"overrides": timed.overrides, "reason": timed.reason}, (
            f"\nSpeed: the cut is refused by the planner: {timed.reason}\n"
        )
    efficiency, after = speed.fit_efficiency(timed.cfg, fitted, timed.measured_s, make_plan)
    fitted["efficiency"] = efficiency
    record = {
        "overrides": timed.overrides,
        "measured_s": timed.measured_s,
        "predicted_s": timed.predicted_s,
        "fitted_s": after,
        "efficiency": efficiency,
    }
    lines = (
        f"\nSpeed: `{' '.join(timed.overrides)}`: measured {timed.measured_s:.3g} s a step "
        f"(median after a warm-up), the planner {timed.predicted_s:.3g} s with the preset's "
        f"figures ({timed.predicted_s / timed.measured_s:.2f} x), {after:.3g} s with the "
        f"fitted ones (hardware.efficiency={efficiency:.4g}).\n"
    )
    if abs(after - timed.measured_s) > 0.01 * timed.measured_s:
        lines += (
            "The planner cannot reach the measured step by the efficiency alone (it stops at "
            f"{efficiency:g}): its other terms (host overhead, collectives) "
            f"{'exceed' if after > timed.measured_s else 'fall short of'} it.\n"
        )
    return record, lines


def write_report(results, timings, timed, cfg, run_dir: Path) -> int:
    """Print and write the report, and the fitted preset; the number of rows that failed."""
    import torch

    hw = cfg.hardware
    world = hw.nodes * hw.devices_per_node
    backend = "nccl" if hw.device_type.value == "cuda" else "gloo"
    rows = records(results)
    failed = sum(r["status"] == "FAIL" for r in rows)
    passed = sum(r["status"] == "pass" for r in rows)
    head = (
        f"self-test on {world} rank(s) ({hw.nodes} node(s) x {hw.devices_per_node}, "
        f"{hw.device_type.value}, {backend}), torch {torch.__version__}: {passed} of {len(rows)} "
        f"rows pass, {failed} fail. Each row against one process of the same model and batch "
        f"over {cfg.selftest.steps} steps, fp32: losses within {LOSS_RTOL:g} relative, gradient "
        f"norms within {GRAD_RTOL:g}, final parameters within 1e-4 (2e-4 with cp) + "
        f"{PARAM_RTOL:g} x |reference|."
    )
    text = markdown(rows, head)
    links = fabric.links_of(hw)
    fitted = fabric.fit(links, timings) if timings else {}
    speed_row, speed_lines = speed_record(timed, fitted)  # fitted gains the efficiency
    wire, written = [], None
    if fitted:
        on = (
            f"launcher.selftest {time.strftime('%Y-%m-%d')}: {world} x {hw.name} "
            f"({hw.device_type.value}, {backend}), torch {torch.__version__}"
        )
        written, searched = preset.write(cfg, fitted, on, run_dir)
        name = preset.preset_name(cfg)
        use = (
            f"hardware={name}"
            if searched
            else f"--config-dir {written.parent.parent} hardware={name}"
        )
        where = f"{written} (plan with: {use})"
        if timings:
            fitted_hw = dataclasses.replace(hw, **fitted)
            wire = fabric_records(timings, links, fabric.links_of(fitted_hw))
            text += "\n" + fabric_markdown(wire, hw.name, fitted, where)
        else:
            text += f"\nFitted: efficiency={fitted['efficiency']:.4g}; the preset {where}.\n"
    elif cfg.selftest.fabric and world > 1:
        text += f"\nFabric: not run (selftest.budget_s={cfg.selftest.budget_s:g} spent).\n"
    text += speed_lines
    print(text, end="", flush=True)
    (run_dir / REPORT_MD).write_text(text)
    write_json(
        run_dir / REPORT_JSON,
        {
            "world": world,
            "nodes": hw.nodes,
            "devices_per_node": hw.devices_per_node,
            "device_type": hw.device_type.value,
            "backend": backend,
            "torch": torch.__version__,
            "steps": cfg.selftest.steps,
            "fault": cfg.selftest.fault.value,
            "passed": passed,
            "failed": failed,
            "rows": rows,
            "fabric": wire,
            "fitted": fitted,
            "speed": speed_row,
            "preset": str(written) if written else None,
        },
    )
    print(f"report: {run_dir / REPORT_MD} and {REPORT_JSON}", flush=True)
    return failed
