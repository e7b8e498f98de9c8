"""The same seed gives the same initial parameters on one process and on any layout.

Each rank of a layout builds the model on the meta device and computes only the values of the shards
it holds (launcher/models/init.py); gathered whole, they must equal, bit for bit, what one process
draws for the whole model (`launcher.training.trainer.build_model`). Cases: FSDP over 4 ranks;
tensor x pipeline parallelism with tied embeddings (the last stage's copy of the embedding drawn as
the embedding); routed experts split over ep=2 and sharded by FSDP; DeepSeek's MLA and experts under
tp x ep with ZeRO-1.
"""

from __future__ import annotations

import pytest
import torch
from group import Job

from launcher.cli import compose
from launcher.training.trainer import build_model

pytestmark = pytest.mark.dist

BASE = "hardware.devices_per_node=4 logging.wandb.mode=disabled train.seed=11"
CASES = {
    "dp_shard=4": "model=llama3_debug parallel.dp_shard=4",
    "tp=2 x pp=2, tied": "model=llama3_debug model.tie_embeddings=true parallel.tp=2 "
    "parallel.pp=2 parallel.dp_shard=1",
    "mixtral ep=2 x dp_shard=4": "model=mixtral_debug parallel.ep=2 parallel.dp_shard=4",
    "deepseek tp=2 x ep=2, zero1": "model=deepseek_debug parallel.tp=2 parallel.ep=2 "
    "parallel.dp_shard=2 data_parallel=zero1",
}
JOB = Job("parallel.initial:job", 4, tuple(f"{BASE} {c}" for c in CASES.values()))


@pytest.mark.jobs(JOB)
@pytest.mark.parametrize("case", list(CASES))
def test_initial_parameters_equal_one_process(case, group):
    index = list(CASES).index(case)
    got = torch.load(group.result(JOB) / f"{index}.pt")
    cfg = compose(f"{BASE} {CASES[case]}".split())
    want = build_model(cfg, cfg.train.seed).state_dict()
    assert got.keys() == want.keys(), got.keys() ^ want.keys()
    differ = [name for name, w in want.items() if not torch.equal(got[name], w)]
    assert not differ, f"{case}: initial values differ from one process's in {differ}"
    # Not a test that cannot fail: another seed gives other values.
    other = build_model(cfg, cfg.train.seed + 1).state_dict()
    name = "layers.0.attention.wo.weight"
    assert not torch.equal(other[name], want[name])
