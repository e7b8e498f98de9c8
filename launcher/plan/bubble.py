"""Pipeline arithmetic: layer split, stage placement, bubble and in-flight micro-batches.

Costs are in units where a (virtual) stage's forward F, input-gradient backward B and
weight-gradient backward W of one micro-batch each take the same time (F = B = W), so one
micro-batch is 3 units of work per stage. Bubble fractions are idle time over useful time.
"""

from __future__ import annotations

from launcher.layout import SINGLE


def bubble_fraction(schedule: str, p: int, v: int, m: int) -> float:
    """Idle over useful time of a pipeline of p ranks, v stages per rank, m micro-batches.

    Each rank does 3 v m units of work (F = B = W per stage); the idle units per rank are
    those of the schedules' own action lists replayed on that clock (launcher/plan/timeline.py,
    checked against these formulas by tests/plan/test_timeline.py):
    gpipe, 1f1b: 3(p-1), so (p-1)/m; interleaved_1f1b: 3(p-1) over v times the work,
    (p-1)/(v m) (Narayanan et al. 2021). The zero-bubble schedules fill the warm-up with W
    and leave p-1 units (ZB-H1, Qi et al. 2023): interleaved_zb (p-1)/(3 v m), zbv and
    dualpipev (p-1)/(6 m). torch's zbv fills its V only from 2p-1 micro-batches on; below that
    it idles 2(2p-1-m) units. DualPipeV's own gain, all-to-alls hidden behind the other
    chunk's compute, is counted in the EP time, not here.
    """
    if p == 1:
        return 0.0
    if schedule in SINGLE:
        return (p - 1) / m
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m)
    if schedule == "interleaved_zb":
        return (p - 1) / (3 * v * m)
    if schedule == "zbv":
        return max(p - 1, 2 * (2 * p - 1 - m)) / (6 * m)
    if schedule == "dualpipev":
        return (p - 1) / (6 * m)
    raise ValueError(f"unknown pipeline schedule {schedule}")


def inflight_microbatches(schedule: str, p: int, v: int, m: int, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, counted over
    that rank's own layers (a virtual stage holds 1/v of them); they are freed by the full
    backward, or by W for the split schedules (torch keeps the graph from I to W).

    GPipe holds all m. 1F1B: rank r runs p - r forwards before its first backward (Korthikanti
    et al. 2022). Interleaved 1F1B: p + (p-1-2r)/v, rank 0's being 1F1B's p times
    (1 + (p-1)/(p v)) (Narayanan et al. 2021). interleaved_zb holds p on every rank, zbv
    (m+1+r)/2 up to p, dualpipev p + 1/2. Every figure is capped by m.
    """
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        held = float(m)
    elif schedule == "1f1b":
        held = float(p - rank)
    elif schedule == "interleaved_1f1b":
        held = p + (p - 1 - 2 * rank) / v
    elif schedule == "interleaved_zb":
        held = float(p)
    elif schedule == "zbv":
        held = min(p, (m + 1 + rank) / 2)
    elif schedule == "dualpipev":
        held = p + 0.5
    else:
        raise ValueError(f"unknown pipeline schedule {schedule}")
    return min(held, float(m))
