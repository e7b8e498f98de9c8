"""Context parallelism in the engine: each layout trains like one process (fp32, 4 steps, same
global batch): losses within 1e-5 relative, gradient norms within 5e-4 relative, final
parameters within 2e-4 absolute + 1e-4 relative.

Why 2e-4 (`parity.default_param_atol`, for every row with cp > 1, here and in the composition
test) rather than the harness's 1e-4: attention sums in another order (blocks merged by
their log-sum-exp, or one masked kernel over gathered keys), and Adam carries that rounding
into the update wherever a gradient is near zero. Measured on gpt_debug cp=2: 12 of 940,800
parameters differ by more than 5e-5 (at most 1.04e-4 ring, 0.89e-4 allgather), the median by
1.3e-7. A wrong position or a missed reduction moves every parameter by up to the whole update
(lr 3e-3), 15x the tolerance.

A rank that attended only to its own chunks, a RoPE angle or learned position taken at the local
index instead of the global one, or gradients not averaged over the cp ranks each move the
first step's loss or gradient norm by far more than that.
"""

from __future__ import annotations

import pytest
from parity import (
    assert_params_match,
    assert_parity,
    assert_row,
    read_layout,
    reference,
    reference_job,
    rows,
    run_job,
)

pytestmark = pytest.mark.dist

MODELS = {
    "llama3_debug": ["model=llama3_debug"],
    "gpt_debug": ["model=gpt_debug", "model.dropout=0.0"],
    "deepseek_debug": ["model=deepseek_debug"],
}
CP2 = ["hardware.devices_per_node=2", "parallel.cp=2", "parallel.dp_shard=1"]
ROWS = {
    "llama3_debug cp=2 allgather": ("llama3_debug", [*CP2, "context=allgather"]),
    "llama3_debug cp=2 ring": ("llama3_debug", [*CP2, "context=ring"]),
    "llama3_debug cp=4 ring": (
        "llama3_debug",
        ["hardware.devices_per_node=4", "parallel.cp=4", "parallel.dp_shard=1", "context=ring"],
    ),
    "llama3_debug cp=2 x dp_shard=2": (
        "llama3_debug",
        ["hardware.devices_per_node=4", "parallel.cp=2", "parallel.dp_shard=2", "context=ring"],
    ),
    # The 128K Llama 3 recipe's combination: blocks 0 and 2 per-op recompute, 1 and 3 none.
    "llama3_debug cp=2 x tp=2 sp recompute=op every=2": (
        "llama3_debug",
        [
            "hardware.devices_per_node=4",
            "parallel.cp=2",
            "parallel.tp=2",
            "parallel.dp_shard=1",
            "tensor=sequence_parallel",
            "context=allgather",
            "recompute=op",
            "recompute.every=2",
        ],
    ),
    "llama3_debug cp=2 x pp=2 1f1b": (
        "llama3_debug",
        [
            "hardware.devices_per_node=4",
            "parallel.cp=2",
            "parallel.pp=2",
            "parallel.dp_shard=1",
            "pipeline=1f1b",
            "context=ring",
        ],
    ),
    "llama3_debug cp=2 recompute=full": ("llama3_debug", [*CP2, "recompute=full", "context=ring"]),
    "gpt_debug cp=2 ring": ("gpt_debug", [*CP2, "context=ring"]),
    # MLA: values narrower than queries and keys (the matmul blocks); its routed experts over
    # the cp pair.
    "deepseek_debug cp=2 allgather": ("deepseek_debug", [*CP2, "context=allgather"]),
    "deepseek_debug cp=2 ring x ep=2": ("deepseek_debug", [*CP2, "context=ring", "parallel.ep=2"]),
    # HSDP's 2-D mesh over a flattened dp_shard x cp, ZeRO-1 over dp_shard x cp, DDP over dp x cp.
    "llama3_debug dp_replicate=2 x cp=2": (
        "llama3_debug",
        ["hardware.devices_per_node=4", "parallel.dp_replicate=2", "parallel.dp_shard=1",
         "parallel.cp=2", "context=ring"],
    ),
    "llama3_debug zero1 dp_shard=2 x cp=2": (
        "llama3_debug",
        ["hardware.devices_per_node=4", "parallel.dp_shard=2", "parallel.cp=2",
         "data_parallel=zero1"],
    ),
    "llama3_debug ddp 2 x cp=2": (
        "llama3_debug",
        ["hardware.devices_per_node=4", "parallel.dp_replicate=2", "parallel.dp_shard=1",
         "parallel.cp=2", "data_parallel=ddp"],
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "row",
    rows({label: (MODELS[model], layout) for label, (model, layout) in ROWS.items()}),
)
def test_matches_single_process(row, group):
    assert_row(group, row)


# Attention dropout under CP: other masks than one process draws, so no parity with it; the
# masks are a function of the seed each call draws, which a recomputed forward draws again.
DROPOUT = ["model=gpt_debug", "model.dropout=0.1", *CP2, "context=ring"]
DROPOUT_JOBS = {
    mode: run_job([*DROPOUT, f"recompute={mode}"], f"gpt_debug dropout=0.1 cp=2 recompute={mode}")
    for mode in ("none", "full")
}
DROPOUT_ONE = reference_job(["model=gpt_debug", "model.dropout=0.1"])


@pytest.mark.jobs(*DROPOUT_JOBS.values(), DROPOUT_ONE)
def test_attention_dropout_under_cp_replays_its_masks_in_recompute(group):
    """gpt_debug with dropout 0.1 under cp=2: full recompute trains exactly as no recompute
    (the recomputed attention drops what its forward dropped), and the losses stay within 1%
    of one process's with dropout (its own masks: measured 0.2% apart at most)."""
    plain, full = (group.result(j) for j in DROPOUT_JOBS.values())
    for key in ("loss", "grad_norm"):
        assert read_layout(full, key) == read_layout(plain, key), key
    assert_params_match(plain, full, rtol=0.0, atol=0.0, label="recompute=full vs none")
    _, one = reference(group, DROPOUT_ONE)
    assert_parity(one, read_layout(plain, "loss"), rtol=1e-2, label="dropout cp=2")
