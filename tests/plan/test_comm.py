"""The one collective model every term prices its traffic with (launcher/plan/comm.py):
start-up latency, one hop per algorithm step at the level it crosses, bytes over the slowest
level's bandwidth."""

from __future__ import annotations

import pytest

from launcher.plan import comm

LINKS = comm.Links(
    devices_per_node=8,
    intra_bandwidth=450e9,
    inter_bandwidth=50e9,
    base_latency=8.4e-6,
    intra_hop=3.4e-6,
    inter_hop=9.6e-6,
)


def test_where_a_group_lies():
    assert comm.group(LINKS, 8, 1).nodes == 1  # tp=8: one node
    assert comm.group(LINKS, 8, 1).bandwidth == 450e9
    assert comm.group(LINKS, 16, 8).nodes == 16  # dp ranks 8 apart: one per node
    assert comm.group(LINKS, 4, 4).nodes == 2  # 4 ranks 4 apart: 2 nodes of 2
    assert comm.group(LINKS, 4, 4).bandwidth == 50e9


def test_ring_all_gather_inside_a_node():
    g = comm.group(LINKS, 8, 1)
    nbytes = 64e6
    expected = 8.4e-6 + 7 * 3.4e-6 + nbytes * 7 / 8 / 450e9
    assert comm.all_gather(g, nbytes) == pytest.approx(expected)
    assert comm.reduce_scatter(g, nbytes) == comm.all_gather(g, nbytes)


def test_a_ring_across_nodes_runs_through_each_members_port():
    """NCCL runs one ring channel per network port: a group with k members on each node moves
    its bytes through k ports at once (up to NVLink); an all-to-all or a send through one."""
    full = comm.group(LINKS, 64, 1)  # 8 nodes, all 8 devices of each
    assert (full.nodes, full.per_node) == (8, 8)
    assert full.ring_bandwidth == 400e9  # min(450, 8 x 50)
    half = comm.group(LINKS, 32, 2)  # FSDP beside cp=2: 4 members on each of 8 nodes
    assert half.ring_bandwidth == 200e9
    assert comm.group(LINKS, 16, 8).ring_bandwidth == 50e9  # one member per node
    assert comm.group(LINKS, 8, 1).ring_bandwidth == 450e9  # inside a node: NVLink
    nbytes = 1e9
    assert comm.all_gather(full, nbytes) == pytest.approx(
        8.4e-6 + 56 * 3.4e-6 + 7 * 9.6e-6 + nbytes * 63 / 64 / 400e9
    )
    # Each rank's own share of an all-to-all leaves through its own port.
    assert comm.all_to_all(full, nbytes) == pytest.approx(
        8.4e-6 + 56 * 3.4e-6 + 7 * 9.6e-6 + nbytes * 63 / 64 / 50e9
    )
    # Twice the ports for twice the share: about twice as fast, less the extra hops' latency.
    assert comm.all_gather(full, nbytes) < comm.all_gather(half, nbytes) / 1.8


def test_all_reduce_is_a_ring_for_large_messages_and_a_tree_for_small_ones_across_nodes():
    eight = comm.group(LINKS, 8, 8)  # one rank per node on 8 nodes
    big = 1e9
    ring = 8.4e-6 + 2 * 7 * 9.6e-6 + 2 * big * 7 / 8 / 50e9
    assert comm.all_reduce(eight, big) == pytest.approx(ring)  # the tree would move 2 GB
    many = comm.group(LINKS, 1024, 8)  # on 1,024 nodes the ring's 2,046 steps dominate
    small = 1e3
    tree = 8.4e-6 + 2 * 10 * 9.6e-6 + 2 * small / 50e9  # log2(1024) = 10 levels
    assert comm.all_reduce(many, small) == pytest.approx(tree)
    assert tree < 8.4e-6 + 2 * 1023 * 9.6e-6  # the ring's latency alone


def test_latency_dominates_small_messages_and_bandwidth_large_ones():
    g = comm.group(LINKS, 16, 8)
    tiny = comm.all_to_all(g, 1e3)
    assert tiny == pytest.approx(8.4e-6 + 15 * 9.6e-6, rel=0.01)
    huge = comm.all_to_all(g, 1e10)
    assert huge == pytest.approx(1e10 * 15 / 16 / 50e9, rel=0.01)


def test_one_rank_or_nothing_to_send_costs_nothing():
    assert comm.all_reduce(comm.group(LINKS, 1, 1), 1e9) == 0.0
    assert comm.send(comm.group(LINKS, 2, 8), 0) == 0.0
    assert comm.send(comm.group(LINKS, 2, 8), 1e6) == pytest.approx(8.4e-6 + 9.6e-6 + 1e6 / 50e9)
