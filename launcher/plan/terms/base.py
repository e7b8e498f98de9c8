"""What every cost term shares: the bottleneck rank of a layout (`Step`) and a term's answer
(`Term`); `Time` is the list of them."""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.layout import Layout
from launcher.plan.context import Context


@dataclass(frozen=True)
class Term:
    """Seconds per step one cause adds to the bottleneck rank's step."""

    name: str  # short, as reports and JSON name it: "compute", "tp", ...
    exposed: float  # seconds it adds to the step
    work: float = 0.0  # seconds of the work itself, before overlap (== exposed if none)
    overlaps: str = ""  # what hides the rest of it ("" when nothing does)

    @property
    def hidden(self) -> float:
        return max(0.0, self.work - self.exposed)


@dataclass(frozen=True)
class Time:
    """A step's predicted time on the bottleneck rank, term by term."""

    terms: tuple[Term, ...]
    bubble_fraction: float = 0.0

    @property
    def step(self) -> float:
        return sum(t.exposed for t in self.terms)

    def __getitem__(self, name: str) -> float:
        """Exposed seconds of the term `name` (0 for a term this layout does not have)."""
        return next((t.exposed for t in self.terms if t.name == name), 0.0)

    def term(self, name: str) -> Term | None:
        return next((t for t in self.terms if t.name == name), None)


@dataclass
class Step:
    """One layout's bottleneck pipeline rank: what it holds and runs per micro-batch. Terms
    read it and the terms computed before them (`done`, by name)."""

    ctx: Context
    lay: Layout
    rank: int  # pipeline rank
    layers: int
    dense: int
    rc_dense: int  # recomputed dense layers
    rc_moe: int  # recomputed MoE layers
    holds_head: bool
    holds_embedding: bool
    mb_tokens: float  # tokens of one micro-batch on this rank (the sequence split over cp)
    costs: tuple  # (dense, MoE or None) LayerCost of one layer and micro-batch (compute.py)
    device: float  # seconds of one micro-batch's forward + backward kernels, no reruns
    host: float  # seconds the host spends launching them
    done: dict[str, Term] = field(default_factory=dict)

    @property
    def moe(self) -> int:
        return self.layers - self.dense

    @property
    def recomputed(self) -> int:
        return self.rc_dense + self.rc_moe

    @property
    def microbatches(self) -> int:
        return self.lay.microbatches

    def exposed(self, *names: str) -> float:
        return sum(self.done[n].exposed for n in names if n in self.done)
