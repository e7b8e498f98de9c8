"""Every data-parallel layout trains exactly like one process (fp32, same global batch)."""

from __future__ import annotations

import pytest
from parity import assert_parity, read_layout, run_layout

pytestmark = pytest.mark.dist

LAYOUTS = {
    "fsdp dp_shard=2": ["hardware.devices_per_node=2"],
    "fsdp dp_shard=4": ["hardware.devices_per_node=4"],
    "hsdp 2x2": ["hardware.devices_per_node=4", "parallel.dp_replicate=2", "parallel.dp_shard=2"],
    "ddp 2x1": ["hardware.devices_per_node=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"],
    "zero1 dp_shard=2": ["hardware.devices_per_node=2", "data_parallel=zero1"],
    "zero2 dp_shard=2": ["hardware.devices_per_node=2", "data_parallel=zero2"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    losses = run_layout(run_dir, ["hardware.devices_per_node=1"])
    assert losses[-1] < losses[0], "the reference run does not learn: parity would prove little"
    return run_dir, losses


# fsdp dp_shard=4: dp_shard=2 and HSDP's 4 ranks cover it (the `slow` tier: make test-all).
SLOW = ("fsdp dp_shard=4",)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in LAYOUTS]
)
def test_matches_single_process(name, reference, tmp_path):
    ref_dir, ref_losses = reference
    assert_parity(ref_losses, run_layout(tmp_path, LAYOUTS[name]), rtol=1e-5, label=name)
    # The clipping norm is global: a norm over one rank's shard alone would be off by ~sqrt(dp).
    assert_parity(
        read_layout(ref_dir, "grad_norm"),
        read_layout(tmp_path, "grad_norm"),
        rtol=1e-4,
        label=f"{name} grad_norm",
    )


@pytest.mark.slow  # the expert-parallel row with fewer experts than ranks covers the placement
def test_mixtral_fsdp_with_fewer_experts_than_ranks(tmp_path):
    """2 experts over 4 FSDP ranks: the stacked expert weights are sharded on their widest
    dimension instead of the expert dimension (which would leave two ranks empty)."""
    model = ["model=mixtral_debug", "model.n_routed_experts=2"]
    ref = run_layout(tmp_path / "ref", [*model, "hardware.devices_per_node=1"])
    got = run_layout(tmp_path / "fsdp", [*model, "hardware.devices_per_node=4"])
    assert ref[-1] < ref[0]
    assert_parity(ref, got, rtol=1e-5, label="mixtral fsdp dp_shard=4")
