"""The fabric: each collective the engine runs, timed over the groups its meshes form, at
message sizes the planner prices, against the planner's collective model
(launcher/plan/comm.py) with the preset's constants; and those constants fitted to what was
measured.

Groups, as the engine's mesh lays them (consecutive ranks fill a node first): neighbouring
pairs (tp, cp, pp and ep groups of 2), the whole node (data parallelism), and, on several
nodes, one rank per node (the dimensions that cross nodes). Each timing is the slowest rank's
median over a few repetitions after a warm-up.

The fit is the model's own form, linear in its constants: a collective's seconds are
base_latency + intra_steps x intra_hop + bytes / bandwidth, for the intra-node level from the
groups inside a node (least squares over every collective and size, non-negative); across
nodes the same with the intra-node constants fixed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from launcher.plan import comm

KIB, MIB = 1024, 1024 * 1024
SIZES = {"cpu": (64 * KIB, 1 * MIB, 8 * MIB), "cuda": (1 * MIB, 16 * MIB, 128 * MIB)}
REPEATS = {"cpu": 3, "cuda": 20}
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


@dataclass(frozen=True)
class Spot:
    """A group of `size` ranks `stride` apart, as the report names it."""

    name: str
    size: int
    stride: int


@dataclass
class Timing:
    spot: Spot
    kind: str
    nbytes: int  # the whole tensor: gathered, reduced, exchanged by each rank, or sent
    seconds: float
    predicted: float = 0.0

    @property
    def bus_gbps(self) -> float:
        """NCCL-tests' bus bandwidth: the bytes each rank's link carries per second."""
        n = self.spot.size
        factor = {"all_reduce": 2 * (n - 1) / n, "send": 1.0}.get(self.kind, (n - 1) / n)
        return self.nbytes * factor / self.seconds / 1e9


def spots(world: int, per_node: int) -> list[Spot]:
    nodes = world // per_node
    out = [Spot("pairs", 2, 1)]
    if min(world, per_node) > 2:
        out.append(Spot("node", min(world, per_node), 1))
    if nodes > 1:
        out.append(Spot("across nodes", nodes, per_node))
    return out


def members(world: int, spot: Spot) -> list[list[int]]:
    """Every rank in one group of the spot's shape: blocks of size x stride ranks, each split
    into `stride` groups of ranks `stride` apart."""
    span = spot.size * spot.stride
    return [
        [start + offset + i * spot.stride for i in range(spot.size)]
        for start in range(0, world, span)
        for offset in range(spot.stride)
    ]


# torch 2.13's names (the older ones warn there); torch 2.11's (the GPU image's) before them
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def run_once(kind: str, group, nbytes: int, device, me: int, size: int) -> None:
    numel = max(size, nbytes // 4 // size * size)  # fp32, a multiple of the group's size
    if kind == "all_reduce":
        dist.all_reduce(torch.ones(numel, device=device), group=group)
    elif kind == "all_gather":
        out = torch.empty(numel, device=device)
        ALL_GATHER(out, torch.ones(numel // size, device=device), group=group)
    elif kind == "reduce_scatter":
        out = torch.empty(numel // size, device=device)
        REDUCE_SCATTER(out, torch.ones(numel, device=device), group=group)
    elif kind == "all_to_all":
        dist.all_to_all_single(
            torch.empty(numel, device=device), torch.ones(numel, device=device), group=group
        )
    else:  # send: the group's first rank to its second, as one pipeline stage to the next
        buf = torch.ones(numel, device=device)
        if me == 0:
            dist.send(buf, group_dst=1, group=group)
        elif me == 1:
            dist.recv(buf, group_src=0, group=group)


def measure(device: torch.device, world: int, per_node: int) -> list[Timing]:
    """Every collective over every spot at every size, on every rank; the slowest rank's
    median seconds (the same list on every rank)."""
    kind_of = device.type
    sizes, repeats = SIZES[kind_of], REPEATS[kind_of]
    out = []
    for spot in spots(world, per_node):
        mine, _ = dist.new_subgroups_by_enumeration(members(world, spot))
        me = dist.get_rank(mine)
        for kind in KINDS:
            for nbytes in sizes:
                seconds = []
                for i in range(repeats + 1):
                    dist.barrier()
                    start = time.perf_counter()
                    run_once(kind, mine, nbytes, device, me, spot.size)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if i:  # the first is the warm-up
                        seconds.append(time.perf_counter() - start)
                slowest = torch.tensor([statistics.median(seconds)], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                out.append(Timing(spot, kind, nbytes, float(slowest.item())))
        dist.barrier()
    return out


def links_of(hw) -> comm.Links:
    """The planner's link constants of a hardware preset (launcher/plan/context.py's)."""
    return comm.Links(
        devices_per_node=hw.devices_per_node,
        intra_bandwidth=hw.intra_node_gbps * 1e9,
        inter_bandwidth=hw.inter_node_gbps * 1e9,
        base_latency=hw.collective_latency_us * 1e-6,
        intra_hop=hw.intra_node_hop_us * 1e-6,
        inter_hop=hw.inter_node_hop_us * 1e-6,
    )


def predicted(links: comm.Links, t: Timing) -> float:
    g = comm.group(links, t.spot.size, t.spot.stride)
    return getattr(comm, t.kind)(g, t.nbytes)


def terms(links: comm.Links, t: Timing) -> tuple[float, float, float, float]:
    """(base latencies, intra-node hops, inter-node hops, bytes over the link) of a timing in
    the model's form, read from the model itself: each constant probed alone."""
    g = comm.group(links, t.spot.size, t.spot.stride)
    far = 1e30  # bytes/s: no time on the wire

    def probe(bandwidth: float, intra_bandwidth: float, **latencies) -> float:
        probed = comm.Links(links.devices_per_node, intra_bandwidth, far, 0.0, 0.0, 0.0)
        probed = comm.Links(**{**probed.__dict__, **latencies})
        return getattr(comm, t.kind)(comm.Group(g.size, g.nodes, bandwidth, probed), t.nbytes)

    base = probe(far, far, base_latency=1.0)
    intra = probe(far, far, intra_hop=1.0)
    inter = probe(far, far, inter_hop=1.0)
    # 1 byte/s on the level it crosses (inside a node the ring's is the node's own link)
    data = probe(1.0, 1.0 if g.nodes == 1 else far)
    return base, intra, inter, data


def fit(links: comm.Links, timings: list[Timing]) -> dict[str, float]:
    """The preset's collective constants fitted to the timings inside a node (and across
    nodes where there were any): hardware fields -> values. The intra-node hop and the base
    latency are told apart by the groups' sizes (a pair's ring has one step, the node's
    more)."""
    inside = [t for t in timings if t.spot.stride == 1 and t.spot.size <= links.devices_per_node]
    rows = [terms(links, t) for t in inside]
    a = torch.tensor([[b, i, d] for b, i, _, d in rows], dtype=torch.float64)
    y = torch.tensor([t.seconds for t in inside], dtype=torch.float64)
    base, hop, inv_bw = nonnegative_lstsq(a, y)
    out = {
        "collective_latency_us": base * 1e6,
        "intra_node_hop_us": hop * 1e6,
        "intra_node_gbps": 1 / inv_bw / 1e9 if inv_bw > 0 else 0.0,
    }
    # Across nodes NCCL's all-reduce is a ring or a tree, whichever is faster (not linear in
    # the constants): the other collectives fit that level.
    across = [t for t in timings if t.spot.name == "across nodes" and t.kind != "all_reduce"]
    if across:
        rows = [terms(links, t) for t in across]
        a = torch.tensor([[x, d] for _, _, x, d in rows], dtype=torch.float64)
        known = torch.tensor([b * base + i * hop for b, i, _, _ in rows], dtype=torch.float64)
        y = torch.tensor([t.seconds for t in across], dtype=torch.float64) - known
        inter_hop, inv_inter = nonnegative_lstsq(a, y)
        out["inter_node_hop_us"] = inter_hop * 1e6
        out["inter_node_gbps"] = 1 / inv_inter / 1e9 if inv_inter > 0 else 0.0
    return out


def nonnegative_lstsq(a: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Least squares with every coefficient >= 0: a negative one is set to 0 and the rest
    fitted again (the few columns here make that exact). Relative residuals: each timing
    weighs by its own size, so the small messages' latency counts as much as the bandwidth."""
    w = 1 / y.clamp_min(1e-9)
    free = list(range(a.shape[1]))
    while True:
        coef = torch.zeros(a.shape[1], dtype=torch.float64)
        sol = torch.linalg.lstsq(a[:, free] * w[:, None], (y * w)[:, None]).solution[:, 0]
        coef[free] = sol
        negative = [f for f, c in zip(free, sol.tolist(), strict=True) if c < 0]
        if not negative:
            return coef.tolist()
        free = [f for f in free if f not in negative]
        if not free:
            return coef.tolist()
