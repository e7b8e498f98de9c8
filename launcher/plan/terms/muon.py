"""muon: optimizer=muon's Newton-Schulz iterations and the exchanges that bring each matrix whole
to its one owner and its update back (launcher/training/spread.py), after the last micro-batch;
nothing runs beside them.

The bottleneck rank's blocks' matrices (each expert of a stack alone), in two kinds: the dense
ones and the routed experts (held by the ranks holding the same experts, ep apart). For each
kind a `Share`: the ranks that split its Newton-Schulz work (`workers`: owners spread so that
each gets its share of the FLOPs, no less than the largest matrix), and of the ranks holding a
matrix (`holders`, H) the ones of one copy (`sources`, S) that send their pieces to the owner.
A rank with L bytes of pieces sends, on average, L (S - 1) / H to owners and gets L (H - 1) / H
of updates back (each an all-to-all over those ranks, comm.all_to_all), in the iteration's
dtype. Under ZeRO-1 a matrix's owner (ZeRO-1's) steps it and broadcasts it (the dp term): only
its tensor-parallel slices are exchanged, and each dp_replicate copy steps its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.models import families, shapes
from launcher.plan import comm
from launcher.plan.memory import BYTES
from launcher.plan.terms.base import Step, Term
from launcher.plan.terms.compute import gemm_seconds


def ns_flops(shape, steps: int) -> float:
    """Newton-Schulz's multiply-add FLOPs for one A x B matrix: each iteration X X^T (2 m^2 n),
    its square (2 m^3) and that times X (2 m^2 n), m <= n (launcher/training/spread.py's)."""
    m, n = sorted(shape[-2:])
    return steps * (4 * m * m * n + 2 * m**3)


@dataclass(frozen=True)
class Share:
    """One kind of the bottleneck rank's Muon matrices: see the module docstring."""

    workers: int
    holders: int
    sources: int
    stride: int  # ranks apart: the group of the exchanges
    local: float  # bytes of this rank's pieces, in the iteration's dtype
    flops: float  # Newton-Schulz FLOPs of all of them (whole)
    largest_flops: float  # of the largest one
    seconds: float  # of all of them, on one rank
    largest: float  # of the largest one

    @property
    def load(self) -> float:
        """Seconds on the most-loaded owner: its share, no less than the largest matrix."""
        return max(self.seconds / self.workers, self.largest)

    @property
    def out(self) -> float:
        """Bytes a rank sends to the owners, on average."""
        return self.local * (self.sources - 1) / self.holders

    @property
    def back(self) -> float:
        """Bytes of updates a rank gets back (and, owners spread, sends), on average."""
        return self.local * (self.holders - 1) / self.holders

    @property
    def sent(self) -> float:
        return self.out + self.back


def layouts(lay) -> dict[str, tuple[int, int, int, int, float]]:
    """For the dense matrices and the experts: (workers, holders, sources, stride, the share
    of their whole bytes this rank holds); the experts' whole is the rank's own (E / ep)."""
    shard = lay.dp_shard * lay.cp
    edp = shard * lay.tp // lay.ep  # the ranks holding the same experts, in one replica
    r = lay.dp_replicate
    if lay.zero1_enabled:
        # ZeRO-1's owners split the matrices over dp_shard x cp; a tp slice is exchanged.
        return {
            "dense": (shard * lay.tp, lay.tp, lay.tp, 1, 1 / (shard * lay.tp)),
            "experts": (edp, 1, 1, lay.ep, 1 / edp),
        }
    if lay.fsdp_enabled:
        return {
            "dense": (r * shard * lay.tp, r * shard * lay.tp, shard * lay.tp, 1,
                      1 / (shard * lay.tp)),
            # FSDP splits a stack by its experts where each rank gets some (widest_when_few):
            # then each is whole on one rank of a copy.
            "experts": (r * edp, r * edp, edp, lay.ep, 1 / edp),
        }  # fmt: skip
    # DDP (or one rank): every data-parallel rank a copy; the experts' whole on each of theirs.
    return {
        "dense": (r * shard * lay.tp, r * shard * lay.tp, lay.tp, 1, 1 / lay.tp),
        "experts": (r * edp, r * edp, 1, lay.ep, 1.0),
    }


def shares(step: Step) -> list[Share]:
    """The bottleneck rank's Muon matrices, the dense blocks' and the experts' (module
    docstring)."""
    ctx, lay = step.ctx, step.lay
    m, opt = ctx.model, ctx.cfg.optimizer
    fam, steps = families.of(m), opt.ns_steps
    width = BYTES[opt.ns_dtype.value]
    kinds: dict[str, list] = {"dense": [], "experts": []}
    for moe, count in ((False, step.dense), (True, step.moe)):
        for name, shape in fam.block(m, moe).items():
            if count and shapes.muon_steps(name, len(shape)):
                routed = len(shape) == 3
                n = count * (shape[0] // lay.ep if routed else 1)
                kinds["experts" if routed else "dense"].append((n, shape[-2:]))
    out = []
    for kind, matrices in kinds.items():
        if not matrices:
            continue
        workers, holders, sources, stride, held = layouts(lay)[kind]
        if kind == "experts" and lay.fsdp_enabled and m.n_routed_experts // lay.ep >= sources:
            # Each expert whole on one rank of each copy: only the copies get its update.
            holders, sources = lay.dp_replicate, 1
        each = [(n, gemm_seconds(ctx, ns_flops(s, steps), min(s)), s) for n, s in matrices]
        out.append(
            Share(
                workers=workers,
                holders=holders,
                sources=sources,
                stride=stride,
                local=sum(n * math.prod(s) for n, _, s in each) * width * held,
                flops=sum(n * ns_flops(s, steps) for n, s in matrices),
                largest_flops=max(ns_flops(s, steps) for _, s in matrices),
                seconds=sum(n * t for n, t, _ in each),
                largest=max(t for _, t, _ in each),
            )
        )
    return out


def muon(step: Step) -> Term | None:
    if step.ctx.cfg.optimizer.name.value != "muon":
        return None
    links, seconds = step.ctx.links, 0.0
    for share in shares(step):
        seconds += share.load
        # comm.all_to_all takes each rank's bytes of which (n - 1) / n leave it.
        s, h = share.sources, share.holders
        if s > 1:
            seconds += comm.all_to_all(comm.group(links, s, share.stride), share.out * s / (s - 1))
        if h > 1:
            seconds += comm.all_to_all(comm.group(links, h, share.stride), share.back * h / (h - 1))
    return Term("muon", seconds, seconds)
