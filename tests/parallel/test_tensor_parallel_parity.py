"""Tensor + sequence parallelism, 2-D and 3-D meshes, recompute and compile: each layout trains
like one process (fp32, 4 steps, same global batch): losses within 1e-5 relative, gradient
norms within 5e-4 relative, final parameters within 1e-4 absolute + 1e-4 relative.

Why 1e-4 absolute for parameters: over 4 steps they move by about 1e-2 (lr 3e-3 with warmup),
and Adam divides each gradient by its running RMS, so where a gradient is close to zero the
fp32 rounding differences of another summation order reach the update at the scale of lr.
A wrong shard or a missed reduction is off by the whole update, two orders of magnitude more.
"""

from __future__ import annotations

import pytest
from parity import assert_row, rows

pytestmark = pytest.mark.dist

MODELS = {
    "llama3_debug": ["model=llama3_debug"],
    "gpt_debug": ["model=gpt_debug", "model.dropout=0.0"],
}
TP1 = ["parallel.dp_shard=1"]
LAYOUTS = {
    "tp=2": ["hardware.devices_per_node=2", "parallel.tp=2", *TP1],
    "tp=4": ["hardware.devices_per_node=4", "parallel.tp=4", *TP1],
    "tp=2 sp+loss parallel": [
        "hardware.devices_per_node=2",
        "parallel.tp=2",
        *TP1,
        "tensor=sequence_parallel",
    ],
    "dp_shard=2 x tp=2": [
        "hardware.devices_per_node=4",
        "parallel.tp=2",
        "tensor=sequence_parallel",
    ],
    "dp_replicate=2 x dp_shard=2 x tp=2": [
        "hardware.devices_per_node=8",
        "parallel.tp=2",
        "parallel.dp_replicate=2",
        "parallel.dp_shard=2",
        "tensor=sequence_parallel",
    ],
    # Megatron's layouts: TP beside DDP or ZeRO-1 (the trainer averages the TP shards' gradients
    # over dp; ZeRO-1 steps each rank's share of them).
    "ddp dp=2 x tp=2": ["hardware.devices_per_node=4", "parallel.tp=2", "data_parallel=ddp"],
    "zero1 dp=2 x tp=2 sp": [
        "hardware.devices_per_node=4",
        "parallel.tp=2",
        "data_parallel=zero1",
        "tensor=sequence_parallel",
    ],
    # Per-op recompute on blocks 0 and 2; blocks 1 and 3 keep their gathered inputs' shards.
    "dp_shard=2 x tp=2 sp recompute=op every=2": [
        "hardware.devices_per_node=4",
        "parallel.tp=2",
        "tensor=sequence_parallel",
        "recompute=op",
        "recompute.every=2",
    ],
    # torchtitan's per-op policy: every other matmul's output kept, the others recomputed (the
    # row-parallel partial sums count in the order too).
    "dp_shard=2 x tp=2 sp recompute=op alternate": [
        "hardware.devices_per_node=4",
        "parallel.tp=2",
        "tensor=sequence_parallel",
        "recompute=op",
        "recompute.matmuls=alternate",
    ],
    "tp=2 recompute=full": ["hardware.devices_per_node=2", "parallel.tp=2", *TP1, "recompute=full"],
    # Unfused attention (in the model's overrides below, the reference's too), so that the
    # recomputed core really holds score matrices.
    "tp=2 recompute=selective": [
        "hardware.devices_per_node=2",
        "parallel.tp=2",
        *TP1,
        "recompute=selective",
    ],
}
TABLE = {
    f"{m} {lay}": (MODELS[m] + (["model.flash_attention=false"] if "selective" in lay else []), o)
    for m in MODELS
    for lay, o in LAYOUTS.items()
}
TABLE["llama3_debug fsdp compile"] = (
    MODELS["llama3_debug"],
    ["hardware.devices_per_node=2", "train.compile=true"],
)
# Compiled blocks under TP: the first takes the embedding's output as a plain tensor
# (tensor_parallel.waited_output); with SP, a sequence shard of it.
TABLE["llama3_debug tp=2 compile"] = (
    MODELS["llama3_debug"],
    ["hardware.devices_per_node=2", "parallel.tp=2", *TP1, "train.compile=true"],
)
# Qwen3's per-head q and k norms: each tp rank norms its own heads with the whole gains, whose
# gradients are then summed over tp (families.HEADS); one missed sum trains them apart.
TABLE["qwen3_debug tp=2"] = (["model=qwen3_debug"], LAYOUTS["tp=2"])
TABLE["qwen3_debug dp_shard=2 x tp=2 sp"] = (["model=qwen3_debug"], LAYOUTS["dp_shard=2 x tp=2"])
TABLE["gpt_debug tp=2 sp compile"] = (
    MODELS["gpt_debug"],
    ["hardware.devices_per_node=2", "parallel.tp=2", *TP1, "tensor=sequence_parallel",
     "train.compile=true"],
)  # fmt: skip


@pytest.mark.parametrize("row", rows(TABLE))
def test_matches_single_process(row, group):
    """Every layout; the `compile` rows: Inductor-compiled blocks under FSDP and under TP."""
    assert_row(group, row)
