"""Every data-parallel layout trains exactly like one process (fp32, same global batch): losses
within 1e-5 relative, gradient norms within 1e-4 (the clipping norm is global: a norm over one
rank's shard alone would be off by ~sqrt(dp)), final parameters within 1e-4."""

from __future__ import annotations

import pytest
from parity import assert_row, rows

pytestmark = pytest.mark.dist

LLAMA = ["model=llama3_debug"]
# 2 experts over 4 FSDP ranks: the stacked expert weights are sharded on their widest dimension
# instead of the expert dimension (which would leave two ranks empty).
MIXTRAL_2 = ["model=mixtral_debug", "model.n_routed_experts=2"]
TABLE = {
    "fsdp dp_shard=2": (LLAMA, ["hardware.devices_per_node=2"]),
    "fsdp dp_shard=4": (LLAMA, ["hardware.devices_per_node=4"]),
    "hsdp 2x2": (
        LLAMA,
        ["hardware.devices_per_node=4", "parallel.dp_replicate=2", "parallel.dp_shard=2"],
    ),
    "ddp 2x1": (
        LLAMA,
        ["hardware.devices_per_node=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"],
    ),
    "zero1 dp_shard=2": (LLAMA, ["hardware.devices_per_node=2", "data_parallel=zero1"]),
    "zero2 dp_shard=2": (LLAMA, ["hardware.devices_per_node=2", "data_parallel=zero2"]),
    "mixtral 2 experts fsdp dp_shard=4": (MIXTRAL_2, ["hardware.devices_per_node=4"]),
}


@pytest.mark.parametrize("row", rows(TABLE, grad_rtol=1e-4))
def test_matches_single_process(row, group):
    assert_row(group, row)
