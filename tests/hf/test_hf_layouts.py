"""A run started from a Hugging Face directory (checkpoint.initial_load_format=hf) on each
layout computes transformers' logits, and each rank reads only the slices it holds.

The engine's own Trainer loads the weights (tests/hf/hf_logits.py, a job of tests/group.py); the
reference is transformers' LlamaForCausalLM / MixtralForCausalLM / Qwen2ForCausalLM /
Qwen3ForCausalLM / Qwen3MoeForCausalLM / DeepseekV3ForCausalLM / DeepseekV2ForCausalLM on the
same batch.
"""

from __future__ import annotations

import json

import pytest
import torch
from group import Job, per_rank
from jobs import devices

from hf import hf_models

pytestmark = pytest.mark.dist

ONE = ["hardware.devices_per_node=1"]
TWO = ["hardware.devices_per_node=2"]
LAYOUTS = {
    "one process": ONE,
    "dp_shard=2": TWO,
    "tp=2": [*TWO, "parallel.tp=2", "parallel.dp_shard=1"],
    "pp=2": [*TWO, "parallel.pp=2", "parallel.dp_shard=1"],
    # FSDP over a TP-sharded dim 0: a strided placement, still one box per rank.
    "dp_shard=2 x tp=2": ["hardware.devices_per_node=4", "parallel.tp=2"],
    "ep=2": [*TWO, "parallel.ep=2"],
}
# Every Hugging Face model type a family's record maps to (hf_models.RUN: test_hf_mapping.py
# holds it to the records) on one process, and the layouts that split what each adds.
CASES = [(kind, "one process") for kind in hf_models.RUN] + [
    *(("llama", name) for name in LAYOUTS if name not in ("one process", "ep=2")),
    ("mixtral", "dp_shard=2"),
    ("mixtral", "pp=2"),
    ("qwen2", "tp=2"),  # the q/k biases' rows permuted and sharded as their weights'
    ("qwen3", "tp=2"),  # each rank's heads normed with the whole gains
    ("qwen3", "dp_shard=2 x tp=2"),
    ("qwen3_moe", "tp=2"),
    ("qwen3_moe", "dp_shard=2 x tp=2"),
    ("qwen3_moe", "ep=2"),
    ("deepseek_v3", "dp_shard=2"),
    ("deepseek_v3", "pp=2"),
]


def saved(family: str) -> Job:
    return Job("hf.hf_logits:save_job", 1, (family,), f"save {family}")


def logits_job(family: str, layout: str) -> Job:
    hf = saved(family)
    overrides = [
        *hf_models.RUN[family],
        *LAYOUTS[layout],
        f"checkpoint.initial_load_path={hf.path()}",
        "checkpoint.initial_load_format=hf",
        "logging.wandb.mode=disabled",
        "precision=fp32",
    ]
    return Job(
        "hf.hf_logits:job", devices(overrides), tuple(overrides), f"{family} {layout}", (hf,)
    )


@pytest.mark.parametrize(
    "job", [logits_job(f, n) for f, n in CASES], ids=[f"{f} {n}" for f, n in CASES]
)
def test_start_from_hf_equals_transformers(group, job):
    family = job.label.split()[0]
    hf_dir = group.result(saved(family))
    ranks = per_rank(group, job)
    ours = torch.load(group.result(job) / "logits.pt")
    hf_models.assert_close(ours, torch.load(hf_dir / "reference.pt"), job.label)
    total = json.loads((hf_dir / "total.json").read_text())
    for rank, r in ranks.items():
        # A q/k shard that starts or ends inside a head reads that head whole: a little more
        # than it holds, never the whole model when the layout shards it.
        assert r["held"] <= r["read"] <= 1.1 * r["held"], f"rank {rank}: {r}"
        if len(ranks) > 1:
            # tp alone leaves an MoE's experts whole on every rank (81% of qwen3_moe_debug):
            # ep splits them.
            assert r["read"] < 0.85 * total, f"rank {rank} read {r['read']} of {total}: {r}"
        else:
            assert r["read"] == total
