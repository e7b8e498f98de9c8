"""Replay a pipeline schedule's action lists on an idealised clock: the blocks a drawing shows,
the bubble it has and the activations each rank holds.

The action lists are the ones the engine runs. The multi-stage schedules (interleaved_1f1b,
interleaved_zb, zbv, dualpipev) compute theirs in torch at construction time; they are read
from torch's own classes, built around stand-in stages (only the attributes those
constructors read). gpipe and 1f1b run a hand-written loop in torch (`_step_microbatches`)
whose order is rebuilt here, since torch's descriptive `pipeline_order` for them does not
match what runs (in torch 2.13 it shifts the last rank's forwards by one micro-batch).

Clock: every (virtual) stage's forward F, input-gradient backward I and weight-gradient
backward W of one micro-batch take one unit; a full backward B takes two. Communication is
free. Each rank runs its list in order; an action starts once the rank is free and its input
is there: F(s, i) after F(s-1, i); B or I(s, i) after F(s, i) and the backward of s+1; W(s, i)
after I(s, i). An overlapped forward-and-backward pair (DualPipeV) runs its halves back to back.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

from launcher.layout import SINGLE, rank_stages

COST = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}


@dataclass(frozen=True)
class Block:
    rank: int
    stage: int
    microbatch: int
    kind: str  # F, B (full backward), I (input gradient) or W (weight gradient)
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    schedule: str
    pp: int
    stages_per_rank: int
    microbatches: int
    blocks: tuple[Block, ...]

    @property
    def makespan(self) -> float:
        return max(b.end for b in self.blocks)

    @property
    def bubble_fraction(self) -> float:
        """Idle over useful time, summed over ranks (the planner's definition)."""
        busy = sum(b.end - b.start for b in self.blocks)
        return (self.pp * self.makespan - busy) / busy

    def idle(self, rank: int) -> list[tuple[float, float]]:
        """The (start, end) gaps in this rank's row, up to the makespan."""
        gaps, t = [], 0.0
        for b in sorted((b for b in self.blocks if b.rank == rank), key=lambda b: b.start):
            if b.start > t + 1e-9:
                gaps.append((t, b.start))
            t = max(t, b.end)
        if self.makespan > t + 1e-9:
            gaps.append((t, self.makespan))
        return gaps

    def peak_inflight(self, rank: int) -> float:
        """Most micro-batches whose activations this rank holds at once, counted over all its
        layers (a virtual stage holds 1/v of them): a forward adds its stage's share, the full
        backward B frees it, or for the split schedules W (torch keeps the autograd graph from
        the input-gradient I until the weight gradient W)."""
        events = []
        for b in self.blocks:
            if b.rank == rank and b.kind == "F":
                events.append((b.end, 1))
            elif b.rank == rank and b.kind in ("B", "W"):
                events.append((b.end, -1))
        held = peak = 0
        for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # frees first at a tie
            held += delta
            peak = max(peak, held)
        return peak / self.stages_per_rank


def _single_stage_order(schedule: str, rank: int, p: int, m: int) -> list[tuple[str, int, int]]:
    """torch's ScheduleGPipe / Schedule1F1B loop for the stage on `rank`."""
    if schedule == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    warmup = min(m, p - rank)  # torch 2.13: num_stages - stage_index forwards first
    ops = [("F", rank, i) for i in range(warmup)]
    fwd = warmup
    for bwd in range(m):
        ops.append(("B", rank, bwd))
        if fwd < m:
            ops.append(("F", rank, fwd))
            fwd += 1
    return ops


def _torch_orders(schedule: str, p: int, v: int, m: int) -> dict[int, list]:
    """pipeline_order of torch's multi-stage schedule class, built around stand-in stages."""
    from launcher.parallel.pipeline_parallel import SCHEDULE_CLASSES  # torch.distributed.pipelining

    n = p * v
    stages = [
        SimpleNamespace(
            num_stages=n,
            group_size=p,
            group_rank=0,
            stage_index=s,
            is_last=s == n - 1,
            submod=None,
            stage_index_to_group_rank=None,
        )
        for s in sorted(rank_stages(0, p, v, schedule))
    ]
    return SCHEDULE_CLASSES[schedule](stages, n_microbatches=m).pipeline_order


@lru_cache(maxsize=64)
def actions(schedule: str, p: int, v: int, m: int) -> dict[int, tuple[tuple[str, int, int], ...]]:
    """rank -> the (kind, stage, micro-batch) compute actions it runs, in order."""
    if schedule in SINGLE:
        return {r: tuple(_single_stage_order(schedule, r, p, m)) for r in range(p)}
    out = {}
    for rank, acts in _torch_orders(schedule, p, v, m).items():
        flat = []
        for a in acts:
            if a is None:
                continue
            for sub in a.sub_actions or (a,):
                kind = sub.computation_type.value
                if kind in COST:
                    flat.append((kind, sub.stage_index, sub.microbatch_index))
        out[rank] = tuple(flat)
    return out


def simulate(schedule: str, p: int, v: int, m: int) -> Timeline:
    """Run every rank's action list against the others' on the unit clock."""
    orders = actions(schedule, p, v, m)
    n = p * v
    done: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(orders, 0.0)
    pos = dict.fromkeys(orders, 0)
    blocks = []

    def ready(kind: str, s: int, i: int) -> float | None:
        if kind == "F":
            needs = [("F", s - 1, i)] if s > 0 else []
        elif kind == "W":
            needs = [("I", s, i)]
        else:
            needs = [("F", s, i)]
            if s < n - 1:
                needs.append(("I", s + 1, i) if ("I", s + 1, i) in done else ("B", s + 1, i))
        times = [done.get(k) for k in needs]
        return None if None in times else max(times, default=0.0)

    remaining = sum(len(a) for a in orders.values())
    while remaining:
        progressed = False
        for r, acts in orders.items():
            while pos[r] < len(acts):
                kind, s, i = acts[pos[r]]
                t = ready(kind, s, i)
                if t is None:
                    break
                start = max(clock[r], t)
                end = start + COST[kind]
                done[(kind, s, i)] = end
                blocks.append(Block(r, s, i, kind, start, end))
                clock[r], pos[r] = end, pos[r] + 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: acts[pos[r]] for r, acts in orders.items() if pos[r] < len(acts)}
            raise RuntimeError(f"{schedule} p={p} v={v} m={m} deadlocks at {stuck}")
    return Timeline(schedule, p, v, m, tuple(blocks))
