"""Muon's matrices spread over the ranks that share them: each orthogonalised whole, once a step.

A matrix split over ranks (FSDP's rows, a tensor-parallel slice, both) or held whole by several
(HSDP's replicas, DDP's) is a *unit* with one *owner*, a rank holding a piece of it: the pieces
of one copy (the owner's: its `sources`) are sent to the owner, which assembles the matrix,
orthogonalises it and sends every holder its piece of the result. A stack of experts (E, A, B) is
E units, each expert alone (Muon orthogonalises each alone). A rank that holds a unit whole is
its owner where it can be (its copy needs no gather). Owners are chosen greedily, costliest
unit first, to the least-loaded holder (the load: the units' Newton-Schulz FLOPs), separately for
each set of ranks that hold the same parameters (the dense blocks' and each expert group's): every
rank of a set holds the same parameters in the same order, so each computes the same owners
without asking anyone.

The exchanges are point-to-point messages over the default group between global ranks (one
message per pair and phase, the pieces of its units in order): no process group is created, so
pipeline stages that hold different parameters never wait on each other.

Pure planning (`holdings`, `plan`) is testable without processes (tests/test_muon.py).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

Box = tuple[slice, ...]


class Unit(NamedTuple):
    """One matrix to orthogonalise: parameter `param` (its position in the stepped list),
    expert `index` of a stack (None for a matrix), its `owner` (a global rank), the ranks whose
    pieces the owner assembles (`sources`: rank -> its box of the matrix) and every rank holding
    a piece of any copy (`holders`), which gets its piece of the result."""

    param: int
    index: int | None
    shape: tuple[int, int]
    owner: int
    sources: dict[int, Box]
    holders: dict[int, Box]


def ns_flops(shape, steps: int) -> float:
    """Newton-Schulz's multiply-add FLOPs for one A x B matrix: each iteration X X^T (2 m^2 n),
    its square (2 m^3) and that times X (2 m^2 n), m <= n."""
    m, n = sorted(shape[-2:])
    return steps * (4 * m * m * n + 2 * m**3)


def holdings(p: torch.Tensor, replicas: list[int], me: int) -> dict[int, tuple[Box, tuple]]:
    """Each global rank holding a piece of p -> (its box of p's whole shape, the copy it
    belongs to). A DTensor's pieces come from its mesh and placements (a Replicate dimension is
    another copy); `replicas` (the ranks holding copies outside the DTensor's mesh: DDP's, this
    rank among them) multiply them: a replica's ranks are this rank's shifted by the replica's
    offset (init_device_mesh numbers ranks row-major, so a coordinate adds a fixed offset)."""
    if isinstance(p, DTensor):
        ranks = p.device_mesh.mesh
        mine = {}
        for coord in itertools.product(*(range(n) for n in ranks.shape)):
            shape, offset = _compute_local_shape_and_global_offset(
                p.shape, ranks.shape, list(coord), p.placements
            )
            copy = tuple(c for c, pl in zip(coord, p.placements, strict=True) if pl.is_replicate())
            box = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
            mine[int(ranks[coord])] = (box, copy)
    else:
        mine = {me: (tuple(slice(0, n) for n in p.shape), ())}
    return {
        rank + shift: (box, (i, copy))
        for i, shift in enumerate(r - me for r in replicas)
        for rank, (box, copy) in mine.items()
    }


def _units_of(shape, held: dict[int, tuple[Box, tuple]]):
    """(expert index or None, {rank: (its box of the matrix, its copy)}) for each matrix of a
    parameter of `shape`: the parameter itself, or each expert of a stack."""
    if len(shape) == 2:
        yield None, {r: (box, copy) for r, (box, copy) in held.items() if _volume(box)}
        return
    for e in range(shape[0]):
        yield (
            e,
            {
                rank: (box[1:], copy)
                for rank, (box, copy) in held.items()
                if box[0].start <= e < box[0].stop and all(s.stop > s.start for s in box[1:])
            },
        )


def plan(params: list[tuple[tuple, dict]], steps: int) -> list[Unit]:
    """The units of `params` ((shape, holdings) each, in the optimizer's order) with their
    owners, in that order (parameter, then expert)."""
    units = []
    for i, (shape, held) in enumerate(params):
        area = math.prod(shape[-2:])
        for e, pieces in _units_of(shape, held):
            whole = [r for r, (b, _) in pieces.items() if _volume(b) == area]
            units.append((i, e, tuple(shape[-2:]), pieces, whole))
    load: dict[tuple, dict[int, float]] = {}
    owners = {}
    for i, e, shape, pieces, whole in sorted(units, key=lambda u: -ns_flops(u[2], steps)):
        # Loads per set of holders of the parameter: ranks of one set hold the same parameters.
        ranks = load.setdefault(tuple(sorted(params[i][1])), {})
        owner = min(whole or sorted(pieces), key=lambda r: (ranks.get(r, 0.0), r))
        ranks[owner] = ranks.get(owner, 0.0) + ns_flops(shape, steps)
        owners[i, e] = owner
    out = []
    for i, e, shape, pieces, _ in units:
        owner = owners[i, e]
        copy = pieces[owner][1]
        sources = {r: b for r, (b, c) in pieces.items() if c == copy}
        if sum(_volume(b) for b in sources.values()) != math.prod(shape):
            raise ValueError(
                f"the pieces of a {list(params[i][0])} matrix on ranks {sorted(sources)} do not "
                "tile it (Muon needs each copy's pieces to be disjoint boxes)"
            )
        out.append(Unit(i, e, shape, owner, sources, {r: b for r, (b, _) in pieces.items()}))
    return out


def _volume(box: Box) -> int:
    return math.prod(s.stop - s.start for s in box)


def _exchange(sends: dict[int, torch.Tensor], sizes: dict[int, int], like: torch.Tensor):
    """One message to each rank of `sends` and one from each rank of `sizes` (its numel),
    over the default group; returns the received, by rank."""
    got = {r: like.new_empty(n) for r, n in sizes.items()}
    ops = [dist.P2POp(dist.irecv, buf, r) for r, buf in got.items()]
    ops += [dist.P2POp(dist.isend, buf, r) for r, buf in sends.items()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return got


def _piece(local: torch.Tensor, unit: Unit, offset: int) -> torch.Tensor:
    """This rank's piece of `unit` within its local tensor (a stack's expert, or all of it)."""
    return local if unit.index is None else local[unit.index - offset]


def orthogonalised(
    units: list[Unit], directions: list[torch.Tensor], offsets: list[int], me: int, orthogonalise
) -> list[torch.Tensor]:
    """Each parameter's local piece of its orthogonalised update. `directions`: this rank's
    local pieces (in the dtype to orthogonalise in), `offsets`: where each local stack starts
    among its experts, `orthogonalise(x)`: Newton-Schulz over a matrix or a stack."""
    mine = [u for u in units if me in u.holders]
    wholes = _assembled(mine, directions, offsets, me)
    results: dict[tuple, torch.Tensor] = {}
    for i, owned in wholes.items():  # a stack's owned experts in one batched iteration
        if owned[0][0].index is None:
            results[i, None] = orthogonalise(owned[0][1])
        else:
            done = orthogonalise(torch.stack([full for _, full in owned]))
            results.update({(i, u.index): o for (u, _), o in zip(owned, done, strict=True)})
    return _returned(mine, results, directions, offsets, me)


def _assembled(mine: list[Unit], directions, offsets, me: int) -> dict[int, list]:
    """The first exchange: each source's piece to its unit's owner; the owned units' whole
    matrices, by parameter: {param: [(unit, matrix)]}."""
    gather: dict[int, list] = {}
    sizes: dict[int, int] = {}
    for u in mine:
        if u.owner != me and me in u.sources:
            gather.setdefault(u.owner, []).append(_piece(directions[u.param], u, offsets[u.param]))
        if u.owner == me:
            for r, box in u.sources.items():
                if r != me:
                    sizes[r] = sizes.get(r, 0) + _volume(box)
    got = _exchange({r: _flat(ps) for r, ps in gather.items()}, sizes, directions[0])
    read = dict.fromkeys(got, 0)
    wholes: dict[int, list] = {}
    for u in (u for u in mine if u.owner == me):
        full = directions[0].new_empty(u.shape)
        for r, box in u.sources.items():
            if r == me:
                full[box] = _piece(directions[u.param], u, offsets[u.param])
            else:
                n = _volume(box)
                full[box] = got[r][read[r] : read[r] + n].view(full[box].shape)
                read[r] += n
        wholes.setdefault(u.param, []).append((u, full))
    return wholes


def _returned(mine: list[Unit], results: dict, directions, offsets, me: int) -> list:
    """The second exchange: each owner sends every holder its piece of the update; this
    rank's pieces, laid out as its directions."""
    scatter: dict[int, list] = {}
    sizes: dict[int, int] = {}
    for u in mine:
        if u.owner == me:
            for r, box in u.holders.items():
                if r != me:
                    scatter.setdefault(r, []).append(results[u.param, u.index][box])
        else:
            sizes[u.owner] = sizes.get(u.owner, 0) + _volume(u.holders[me])
    got = _exchange({r: _flat(ps) for r, ps in scatter.items()}, sizes, directions[0])
    read = dict.fromkeys(got, 0)
    out = [torch.empty_like(d) for d in directions]
    for u in mine:
        target = _piece(out[u.param], u, offsets[u.param])
        if u.owner == me:
            target.copy_(results[u.param, u.index][u.holders[me]])
        else:
            n = _volume(u.holders[me])
            target.copy_(got[u.owner][read[u.owner] : read[u.owner] + n].view(target.shape))
            read[u.owner] += n
    return out


def _flat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in pieces])
