"""A self-test row against its one-process reference: per-step losses and gradient norms, and
the final parameters gathered from every shard, each with its tolerance and its worst figure.

The tolerances are the parity suite's (tests/parity.py), measured on CPU over gloo in fp32:
losses within 1e-5 relative; gradient norms within 5e-4 (a vocabulary-parallel loss sums its
softmax in another order, and the norm squares and adds every gradient); final parameters
within 1e-4 relative plus 1e-4 absolute, 2e-4 with context parallelism (Adam divides by each
gradient's running RMS, so a near-zero gradient carries rounding into its update at the scale
of the learning rate; CP's blockwise softmax rounds other than one process's kernel).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

LOSS_RTOL = 1e-5
GRAD_RTOL = 5e-4
PARAM_RTOL = 1e-4


def param_atol(cp: int) -> float:
    return 2e-4 if cp > 1 else 1e-4


@dataclass
class Verdict:
    """What a row's comparison found: pass or fail, the worst figure of each kind (relative
    for losses and gradient norms, absolute for parameters) and, for a failure, what differed."""

    passed: bool
    loss: float
    grad_norm: float
    params: float
    detail: str = ""


def metrics(run_dir: Path, key: str) -> list[float]:
    """One metric of a run, per step, from its metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [float("nan") if r.get(key) is None else float(r[key]) for r in rows]


def worst_relative(ref: list[float], got: list[float], what: str) -> tuple[float, str]:
    """The largest relative difference over the steps, and where it is."""
    if len(got) != len(ref):
        return math.inf, f"{what}: {len(got)} steps against the reference's {len(ref)}"
    worst, where = 0.0, ""
    for step, (r, g) in enumerate(zip(ref, got, strict=True), 1):
        rel = abs(g - r) / abs(r) if r else abs(g - r)
        if not math.isfinite(rel):
            rel = math.inf
        if rel > worst or not where:
            worst, where = rel, f"{what} at step {step}: {g:.8f} against {r:.8f}"
    return worst, where


def worst_parameter(ref_path: Path, got_path: Path, atol: float) -> tuple[float, bool, str]:
    """The largest absolute difference of any final parameter, whether every element is within
    atol + PARAM_RTOL x |reference|, and the parameter that is furthest out."""
    import torch

    ref = torch.load(ref_path, weights_only=True)
    got = torch.load(got_path, weights_only=True)
    if ref.keys() != got.keys():
        names = sorted(ref.keys() ^ got.keys())
        return math.inf, False, f"parameter names differ from the reference's: {names[:4]}"
    worst, inside, where, excess = 0.0, True, "", -math.inf
    for name, r in ref.items():
        g = got[name].to(r.dtype)
        if g.shape != r.shape:
            return math.inf, False, f"{name}: shape {tuple(g.shape)} against {tuple(r.shape)}"
        diff = (g - r).abs()
        worst = max(worst, float(diff.max()))
        over = float((diff - (atol + PARAM_RTOL * r.abs())).max())
        if over > excess:
            excess, where = over, f"{name}: max difference {float(diff.max()):.3g}"
        inside = inside and over <= 0
    return worst, inside, where


def compare(reference: Path, run: Path, cp: int) -> Verdict:
    """A row's run directory against its reference's."""
    loss, loss_at = worst_relative(metrics(reference, "loss"), metrics(run, "loss"), "loss")
    grad, grad_at = worst_relative(
        metrics(reference, "grad_norm"), metrics(run, "grad_norm"), "grad_norm"
    )
    atol = param_atol(cp)
    params, inside, param_at = worst_parameter(
        reference / "final_model.pt", run / "final_model.pt", atol
    )
    failed = []
    if not loss <= LOSS_RTOL:
        failed.append(f"{loss_at} (relative {loss:.2e} > {LOSS_RTOL:g})")
    if not grad <= GRAD_RTOL:
        failed.append(f"{grad_at} (relative {grad:.2e} > {GRAD_RTOL:g})")
    if not inside:
        failed.append(f"final parameters, {param_at} (> {atol:g} + {PARAM_RTOL:g} x |reference|)")
    return Verdict(not failed, loss, grad, params, "; ".join(failed))
