"""Expert parallelism trains exactly like one process (fp32, same global batch, balance loss on).

The experts of each MoE layer are split over ep ranks and every token copy travels to its
expert's rank and back by all-to-all; the reference is one process holding every expert.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import torchrun
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


# DeepSeek-V3 style (deepseek_debug): MLA, sigmoid routing over groups with the bias update and
# the sequence-wise balance loss on, a shared expert, the first layer dense.
DEEPSEEK = ["model=deepseek_debug"]
DEEPSEEK_LAYOUTS = {
    "ep=2": ["hardware.devices_per_node=2", "parallel.ep=2"],
    "tp=2 x ep=2": ["hardware.devices_per_node=4", "parallel.tp=2", "parallel.ep=2"],
    # DeepSeek-V3's own combination, scaled down: DualPipe(V) x EP x ZeRO-1.
    "pp=2 dualpipev x ep=2 x zero1": [
        "hardware.devices_per_node=4",
        "parallel.pp=2",
        "parallel.ep=2",
        "pipeline=dualpipev",
        "data_parallel=zero1",
        "train.micro_batch_size=1",
    ],
}


@pytest.fixture(scope="module")
def deepseek_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("deepseek_ref")
    losses = run_layout(run_dir, [*DEEPSEEK, "hardware.devices_per_node=1"])
    assert losses[-1] < losses[0]
    return run_dir, losses


@pytest.mark.parametrize("name", list(DEEPSEEK_LAYOUTS))
def test_deepseek_matches_single_process(name, deepseek_reference, tmp_path):
    ref_dir, ref_losses = deepseek_reference
    overrides = [*DEEPSEEK, *DEEPSEEK_LAYOUTS[name]]
    assert_layout_matches(ref_dir, ref_losses, tmp_path, overrides, f"deepseek {name}")


BIAS = Path(__file__).with_name("expert_bias.py")


def test_bias_update_is_the_same_on_every_rank_and_as_one_process(tmp_path):
    """V3's auxiliary-loss-free balance: after 4 steps each rank holding a layer holds the same
    bias as every other and as one process, whose loads are the whole batch's."""
    steps = ["4", *DEEPSEEK]
    one = torchrun(BIAS, 1, tmp_path / "one", *steps, "hardware.devices_per_node=1")[0]["bias"]
    layout = ["hardware.devices_per_node=4", "parallel.pp=2", "parallel.ep=2"]
    ranks = torchrun(BIAS, 4, tmp_path / "pp_ep", *steps, *layout)
    assert one and any(any(b) for b in one.values()), "no bias moved: the test would prove little"
    held = {}
    for rank, out in ranks.items():
        for layer, bias in out["bias"].items():
            held.setdefault(layer, []).append((rank, bias))
    assert held.keys() == one.keys()
    for layer, copies in held.items():
        for rank, bias in copies:
            assert bias == one[layer], (
                f"layer {layer}: rank {rank} {bias} vs one process {one[layer]}"
            )
