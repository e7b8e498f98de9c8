"""A run started from a Hugging Face directory (checkpoint.initial_load_format=hf) on each
layout computes transformers' logits, and each rank reads only the slices it holds.

The engine's own Trainer loads the weights (tests/hf/hf_logits.py under torchrun); the
reference is transformers' LlamaForCausalLM / MixtralForCausalLM / DeepseekV3ForCausalLM /
DeepseekV2ForCausalLM on the same batch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT, torchrun

from hf import hf_models
from hf.hf_logits import batch

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
}
CASES = [("llama", name) for name in LAYOUTS] + [
    ("mixtral", "one process"),
    ("mixtral", "dp_shard=2"),
    ("mixtral", "pp=2"),
    ("deepseek_v3", "one process"),
    ("deepseek_v3", "dp_shard=2"),
    ("deepseek_v3", "pp=2"),
    ("deepseek_v2", "one process"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(family: str):
        if family not in cache:
            model = hf_models.build(family)
            path = hf_models.save(model, tmp_path_factory.mktemp(f"hf_{family}"))
            cache[family] = (path, hf_models.logits(model, batch(320)))
        return cache[family]

    return get


def run(tmp_path, family: str, hf_dir, layout: list[str]) -> dict[int, dict]:
    n = int(next(o for o in layout if o.startswith("hardware.devices_per_node")).split("=")[1])
    overrides = [
        *hf_models.RUN[family],
        *layout,
        f"checkpoint.initial_load_path={hf_dir}",
        "checkpoint.initial_load_format=hf",
        "logging.wandb.mode=disabled",
        "precision=fp32",
    ]
    return torchrun(ROOT / "tests" / "hf" / "hf_logits.py", n, tmp_path, *overrides)


@pytest.mark.parametrize(("family", "layout"), CASES, ids=[f"{f} {n}" for f, n in CASES])
def test_start_from_hf_equals_transformers(saved, tmp_path, family, layout):
    hf_dir, reference = saved(family)
    ranks = run(tmp_path, family, hf_dir, LAYOUTS[layout])
    ours = torch.load(tmp_path / "logits.pt")
    hf_models.assert_close(ours, reference, f"{family} {layout}")
    # Parameters and persistent buffers (DeepSeek-V3's expert biases, read like weights).
    total = sum(t.numel() for t in hf_models.build(family).state_dict().values())
    for rank, r in ranks.items():
        # A q/k shard that starts or ends inside a head reads that head whole: a little more
        # than it holds, never the whole model when the layout shards it.
        assert r["held"] <= r["read"] <= 1.1 * r["held"], f"rank {rank}: {r}"
        if len(ranks) > 1:
            assert r["read"] < 0.8 * total, f"rank {rank} read {r['read']} of {total}: {r}"
        else:
            assert r["read"] == total
