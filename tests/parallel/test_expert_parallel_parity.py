"""Expert parallelism trains exactly like one process (fp32, same global batch, balance loss on).

The experts of each MoE layer are split over ep ranks and every token copy travels to its
expert's rank and back by all-to-all; the reference is one process holding every expert.
"""

from __future__ import annotations

import pytest
from parity import assert_layout_matches, run_layout

pytestmark = pytest.mark.dist

MIXTRAL = ["model=mixtral_debug"]
LAYOUTS = {
    "ep=2": ["hardware.devices_per_node=2", "parallel.ep=2"],
    "ep=4": ["hardware.devices_per_node=4", "parallel.ep=4"],
    "dp_shard=4 x ep=2": ["hardware.devices_per_node=4", "parallel.ep=2"],
    "pp=2 x ep=2": ["hardware.devices_per_node=4", "parallel.pp=2", "parallel.ep=2"],
    # ep=2 borrows the tp pair: attention is tp-sharded, each tp rank routes half the tokens.
    "tp=2 x ep=2": ["hardware.devices_per_node=4", "parallel.tp=2", "parallel.ep=2"],
    "tp=2 sp x ep=2": [
        "hardware.devices_per_node=4",
        "parallel.tp=2",
        "parallel.ep=2",
        "tensor.sequence_parallel=true",
    ],
    # Experts replicated over the tp ranks, no FSDP: their gradients are reduced by hand.
    "tp=2 alone": ["hardware.devices_per_node=2", "parallel.tp=2", "parallel.dp_shard=1"],
    "zero1 x ep=2": ["hardware.devices_per_node=2", "parallel.ep=2", "data_parallel=zero1"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    losses = run_layout(run_dir, [*MIXTRAL, "hardware.devices_per_node=1"])
    assert losses[-1] < losses[0], "the reference run does not learn: parity would prove little"
    return run_dir, losses


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_matches_single_process(name, reference, tmp_path):
    ref_dir, ref_losses = reference
    assert_layout_matches(
        ref_dir, ref_losses, tmp_path, [*MIXTRAL, *LAYOUTS[name]], f"mixtral {name}"
    )
