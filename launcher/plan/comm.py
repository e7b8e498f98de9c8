"""One model for every collective the engine runs: latency plus bytes over bandwidth.

A collective over a group of ranks costs a fixed start-up latency, one hop latency per step of
its algorithm (a step inside a node costs an intra-node hop, one that crosses nodes an
inter-node hop), and its bytes over the bandwidth of the slowest link level it crosses. The
shape is NCCL's own cost model (`ncclTopoTuneModel` in NCCL's
src/graph/tuning.cc: base latency + intra steps x intra hop + inter steps x inter hop +
bytes / bandwidth); the hardware presets carry the constants and say where they come from.

Bandwidth across nodes: each device has its own network port (inter_bandwidth). A ring or tree
over a group with k members on each node runs one channel per port (NCCL's rings and trees,
`nChannels` x `bwInter` in tuning.cc), so the group's bytes leave each node through k ports at
once: k x inter_bandwidth per device's share, capped by the link inside the node (a node's
8 x 400 Gb/s ports give a full-node ring 400 GB/s of bus bandwidth). An all-to-all or a
send/recv moves each rank's own bytes through its own port: one port's bandwidth.

Algorithms, as the engine's collectives run them (NCCL on CUDA, gloo on CPU):
- all-gather, reduce-scatter: a ring, n - 1 steps, (n - 1) / n of the full tensor per rank;
- all-reduce: a ring (2 (n - 1) steps, 2 (n - 1) / n of the tensor), or, across nodes, NCCL's
  tree when it is faster (2 (ranks per node - 1) intra and 2 log2(nodes) inter steps, twice
  the tensor): the tree wins for small messages on many nodes;
- all-to-all: n - 1 pairwise exchanges, (n - 1) / n of the tensor;
- send/recv (pipeline stages): one hop, the whole message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Links:
    """The link levels of one machine type, per device and one direction."""

    devices_per_node: int
    intra_bandwidth: float  # bytes/s inside a node
    inter_bandwidth: float  # bytes/s across nodes
    base_latency: float  # seconds per collective
    intra_hop: float  # seconds per algorithm step inside a node
    inter_hop: float  # seconds per algorithm step across nodes


@dataclass(frozen=True)
class Group:
    """Where a group of `size` ranks, `stride` ranks apart, lies on the machine."""

    size: int
    nodes: int  # nodes its members are spread over
    bandwidth: float  # bytes/s per device of the slowest level it crosses
    links: Links

    @property
    def per_node(self) -> int:
        return max(1, self.size // self.nodes)

    @property
    def ring_bandwidth(self) -> float:
        """Bytes/s of a ring or tree over the group: across nodes, its members' ports on each
        node carry one channel each, up to the link inside the node."""
        if self.nodes == 1:
            return self.bandwidth
        return min(self.links.intra_bandwidth, self.per_node * self.bandwidth)


def group(links: Links, size: int, stride: int = 1) -> Group:
    """The group of `size` ranks `stride` apart (the engine's mesh: consecutive ranks fill a
    node first)."""
    span = size * stride
    if span <= links.devices_per_node:
        nodes = 1
    elif stride >= links.devices_per_node:
        nodes = size
    else:
        nodes = -(-span // links.devices_per_node)
    bandwidth = links.intra_bandwidth if nodes == 1 else links.inter_bandwidth
    return Group(size, nodes, bandwidth, links)


def _ring(g: Group, steps: int, inter_steps: int, data: float) -> float:
    lat = g.links.base_latency + (steps - inter_steps) * g.links.intra_hop
    return lat + inter_steps * g.links.inter_hop + data / g.ring_bandwidth


def all_gather(g: Group, nbytes: float) -> float:
    """Seconds to gather `nbytes` (the whole gathered tensor) onto every rank of `g`."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    return _ring(g, g.size - 1, g.nodes - 1, nbytes * (g.size - 1) / g.size)


reduce_scatter = all_gather  # the same ring, the same bytes


def all_reduce(g: Group, nbytes: float) -> float:
    """Seconds to all-reduce an `nbytes` tensor over `g`: ring, or tree across nodes."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    ring = _ring(g, 2 * (g.size - 1), 2 * (g.nodes - 1), 2 * nbytes * (g.size - 1) / g.size)
    if g.nodes == 1:
        return ring
    links = g.links
    tree = (
        links.base_latency
        + 2 * (g.per_node - 1) * links.intra_hop
        + 2 * math.log2(g.nodes) * links.inter_hop
        + 2 * nbytes / g.ring_bandwidth
    )
    return min(ring, tree)


def all_to_all(g: Group, nbytes: float) -> float:
    """Seconds for each rank of `g` to exchange its `nbytes` (of which (n-1)/n leave it)."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    lat = g.links.base_latency + (g.size - g.nodes) * g.links.intra_hop
    return lat + (g.nodes - 1) * g.links.inter_hop + nbytes * (g.size - 1) / g.size / g.bandwidth


def send(g: Group, nbytes: float) -> float:
    """Seconds for one point-to-point message between neighbours of `g`."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    hop = g.links.intra_hop if g.nodes == 1 else g.links.inter_hop
    return g.links.base_latency + hop + nbytes / g.bandwidth
