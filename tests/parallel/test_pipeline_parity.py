"""Pipeline parallelism, every schedule and its compositions, against one process (fp32,
4 steps, same global batch): losses within 1e-5 relative, gradient norms (summed over the
stages) within 5e-4, final parameters gathered from every stage within 1e-4."""

from __future__ import annotations

import pytest
from parity import assert_row, rows

pytestmark = pytest.mark.dist

MODELS = {
    "llama3_debug": ["model=llama3_debug"],
    "llama3_debug 6 layers": ["model=llama3_debug", "model.n_layers=6"],
    "gpt_debug": ["model=gpt_debug", "model.dropout=0.0", "model.tie_embeddings=false"],
    # Tied: the first stage's embedding and the last stage's copy sum their gradients.
    "gpt_debug tied": ["model=gpt_debug", "model.dropout=0.0"],
    "llama3_debug tied": ["model=llama3_debug", "model.tie_embeddings=true"],
}
PP2 = ["hardware.devices_per_node=2", "parallel.pp=2", "parallel.dp_shard=1"]
ROWS = {
    **{
        f"pp=2 {s}": ("llama3_debug", [*PP2, f"pipeline={s}"])
        for s in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
    },
    "pp=4 1f1b uneven (6 layers: 1, 2, 2, 1)": (
        "llama3_debug 6 layers",
        ["hardware.devices_per_node=4", "parallel.pp=4", "parallel.dp_shard=1"],
    ),
    "pp=2 1f1b first_stage_layers=3 (3, 1)": (
        "llama3_debug",
        [*PP2, "pipeline.first_stage_layers=3"],
    ),
    "pp=2 x dp_shard=2": ("llama3_debug", ["hardware.devices_per_node=4", "parallel.pp=2"]),
    # The split schedules under FSDP (their weight pass runs after FSDP's backward hooks: the
    # stage keeps its parameters gathered through the step), ZeRO-2 and context parallelism.
    "pp=2 interleaved_zb x dp_shard=2": (
        "llama3_debug",
        ["hardware.devices_per_node=4", "parallel.pp=2", "pipeline=interleaved_zb"],
    ),
    "pp=2 zbv x zero2 dp_shard=2": (
        "llama3_debug",
        ["hardware.devices_per_node=4", "parallel.pp=2", "pipeline=zbv", "data_parallel=zero2"],
    ),
    "pp=2 dualpipev x dp_shard=2": (
        "llama3_debug",
        [
            "hardware.devices_per_node=4",
            "parallel.pp=2",
            "pipeline=dualpipev",
            "train.micro_batch_size=1",
        ],
    ),
    "pp=2 zbv x cp=2 (FSDP over cp)": (
        "llama3_debug",
        [
            "hardware.devices_per_node=4",
            "parallel.pp=2",
            "parallel.dp_shard=1",
            "parallel.cp=2",
            "pipeline=zbv",
        ],
    ),
    "pp=2 interleaved_zb x cp=2 ddp": (
        "llama3_debug",
        [
            "hardware.devices_per_node=4",
            "parallel.pp=2",
            "parallel.dp_shard=1",
            "parallel.cp=2",
            "pipeline=interleaved_zb",
            "data_parallel=ddp",
        ],
    ),
    "pp=2 x tp=2": (
        "llama3_debug",
        [
            "hardware.devices_per_node=4",
            "parallel.pp=2",
            "parallel.tp=2",
            "parallel.dp_shard=1",
            "tensor=sequence_parallel",
        ],
    ),
    # Megatron's 3-D layout, scaled down: pp x tp x ZeRO-1 (the distributed optimizer).
    "pp=2 x tp=2 x zero1 dp=2": (
        "llama3_debug",
        [
            "hardware.devices_per_node=8",
            "parallel.pp=2",
            "parallel.tp=2",
            "data_parallel=zero1",
            "tensor=sequence_parallel",
        ],
    ),
    "interleaved_1f1b pp=2 v=2 x dp_shard=2": (
        "llama3_debug",
        [
            "hardware.devices_per_node=4",
            "parallel.pp=2",
            "pipeline=interleaved_1f1b",
            "pipeline.stages_per_rank=2",
        ],
    ),
    "gpt_debug pp=2 1f1b": ("gpt_debug", PP2),
    # Tied embeddings: on two pipeline ranks (their own group), on one (the V schedules put
    # the first and last stage on rank 0), under FSDP, and under TP x ZeRO-1.
    "gpt_debug tied pp=2 1f1b": ("gpt_debug tied", PP2),
    "llama3_debug tied pp=2 zbv": ("llama3_debug tied", [*PP2, "pipeline=zbv"]),
    "llama3_debug tied pp=2 x dp_shard=2": (
        "llama3_debug tied",
        ["hardware.devices_per_node=4", "parallel.pp=2"],
    ),
    "gpt_debug tied pp=2 x tp=2 x zero1 dp=2": (
        "gpt_debug tied",
        [
            "hardware.devices_per_node=8",
            "parallel.pp=2",
            "parallel.tp=2",
            "data_parallel=zero1",
            "tensor=sequence_parallel",
        ],
    ),
    "pp=2 x dp_shard=2 resharding every micro-batch": (
        "llama3_debug",
        ["hardware.devices_per_node=4", "parallel.pp=2", "pipeline.reshard_each_microbatch=true"],
    ),
    "interleaved_1f1b pp=2 v=2 x dp_shard=2 resharding every micro-batch": (
        "llama3_debug",
        [
            "hardware.devices_per_node=4",
            "parallel.pp=2",
            "pipeline=interleaved_1f1b",
            "pipeline.stages_per_rank=2",
            "pipeline.reshard_each_microbatch=true",
        ],
    ),
}


@pytest.mark.parametrize(
    "row", rows({label: (MODELS[model], layout) for label, (model, layout) in ROWS.items()})
)
def test_matches_single_process(row, group):
    assert_row(group, row)
