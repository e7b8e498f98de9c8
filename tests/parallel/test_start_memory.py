"""A model far larger than one rank's share starts on 8 ranks without any rank holding it whole.

Each rank builds on the meta device and materialises only what it holds (launcher.parallel.build),
so its resident memory from start to the first forward grows by its share, not by the model:
asserted below a quarter of the whole model's fp32 size above the same layout with one layer
(per pipeline stage), whose start pays the same fixed costs (meshes, data, the embedding and
head). Over the whole run (one step and its checkpoint) a rank stays within the planner's figure
for it (states, activations and the transients it counts: the gathered blocks, FSDP's prefetch of
the next one, which a one-layer model never does, and the loss's logits; not its reserve) plus
that baseline's run. The model is llama-shaped at ~115 MB in fp32 (~150 MB with the pipeline's
four layers; 8x a rank's share and more), and a Mixtral-shaped one of ~160 MB whose routed
experts hold most of it.
"""

from __future__ import annotations

import pytest
import torch
from group import Job, per_rank

from launcher import models
from launcher.cli import compose

pytestmark = pytest.mark.dist

BASE = (
    "hardware.devices_per_node=8 logging.wandb.mode=disabled precision=fp32 train.steps=1 "
    "train.warmup_steps=0 train.eval_interval=0 train.seq_len=64 train.global_batch_size=8 "
    "train.micro_batch_size=1 "
)
LLAMA = "model=llama3_debug model.dim=768 model.n_heads=8 model.n_kv_heads=8 model.ffn_dim=3072"
MIXTRAL = (
    "model=mixtral_debug model.dim=512 model.n_heads=8 model.n_kv_heads=8 model.ffn_dim=2048 "
    "model.moe_ffn_dim=1024 model.n_routed_experts=8"
)
# case: (model and layout overrides, layers, layers of its baseline)
CASES = {
    "dp_shard=8": (f"{LLAMA} parallel.dp_shard=8", 3, 1),
    "tp=2 x dp_shard=4": (f"{LLAMA} parallel.tp=2 parallel.dp_shard=4", 3, 1),
    "pp=2 x dp_shard=4": (f"{LLAMA} parallel.pp=2 parallel.dp_shard=4 pipeline=1f1b", 4, 2),
    "mixtral ep=4 x dp_shard=8": (f"{MIXTRAL} parallel.ep=4 parallel.dp_shard=8", 3, 1),
}


def overrides(case: str, baseline: bool) -> str:
    layout, layers, base_layers = CASES[case]
    return f"{BASE}{layout} model.n_layers={base_layers if baseline else layers}"


JOB = Job(
    "parallel.start_memory:job",
    8,
    tuple(overrides(c, b) for c in CASES for b in (True, False)),
)


def fp32_bytes(case: str) -> int:
    cfg = compose(overrides(case, baseline=False).split())
    with torch.device("meta"):
        model = models.build(cfg.model.family, vars(cfg.model))
    return 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.jobs(JOB)
@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_starts_with_its_share(case, group):
    whole = fp32_bytes(case)
    # The peaks of one rank's repeated runs differ by a few MB (start_memory's mallopt).
    assert whole > 100 * 2**20, f"{case}: the model ({whole / 2**20:.0f} MiB) is too small to tell"
    mib = 2**20
    for rank, cases in per_rank(group, JOB).items():
        full, base = cases[overrides(case, False)], cases[overrides(case, True)]
        grown = full["start"] - base["start"]
        assert grown < whole / 4, (
            f"{case} rank {rank}: {grown / mib:.0f} MiB more than the one-layer start, "
            f"not below a quarter of the model's {whole / mib:.0f} MiB"
        )
        limit = full["planned"] + base["run"]
        assert full["run"] <= limit, (
            f"{case} rank {rank}: peak {full['run'] / mib:.0f} MiB over the run, above the "
            f"planned states and activations ({full['planned'] / mib:.0f} MiB) plus the "
            f"baseline's run ({base['run'] / mib:.0f} MiB)"
        )
