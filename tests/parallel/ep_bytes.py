"""What expert parallelism sends in one real training step, against the planner's figure.

Run under torchrun: `ep_bytes.py OUT_DIR OVERRIDE...` builds the engine's Trainer for the
composed config (fp32, the parity harness's batch), forces balanced routing (token t's j-th
copy goes to expert (t k + j) mod E, so every expert gets the same number of copies from every
rank: the planner's assumption), runs one step and writes OUT_DIR/RANK.json: {"sent": bytes of
token copies and their gradients this rank sent to other ranks, "planned": the planner's
ep_layer_bytes times the MoE layers this rank holds}.

Bytes are counted at the all-to-alls expert_parallel.py calls, through a stand-in for its `dist`
module, as what must leave this rank: the rows it sends to every other rank (the split count
exchange, integers, is counted apart and left out).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launcher import distributed
from launcher.cli import CONF_DIR, hydra_app
from launcher.parallel import expert_parallel
from launcher.plan import engine_plan
from launcher.plan.estimate import ep_layer_bytes
from launcher.trainer import Trainer
from models import moe

BATCH = ["train.global_batch_size=8", "train.micro_batch_size=2", "precision=fp32"]


class CountingDist:
    """torch.distributed as expert_parallel.py sees it, counting what this rank sends."""

    def __init__(self):
        self.sent = {"rows": 0, "counts": 0}

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_to_all_single(self, out, x, out_splits=None, in_splits=None, group=None):
        ranks = dist.get_world_size(group)
        me = dist.get_rank(group)
        splits = in_splits or [x.shape[0] // ranks] * ranks
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        kind = "rows" if x.is_floating_point() else "counts"
        self.sent[kind] += (sum(splits) - splits[me]) * row
        return dist.all_to_all_single(out, x, out_splits, in_splits, group=group)


def balanced(self, x: torch.Tensor):
    t, e, k = x.shape[0], self.n_experts, self.top_k
    chosen = (torch.arange(t)[:, None] * k + torch.arange(k)) % e
    weights = torch.full((t, k), 1.0 / k, dtype=x.dtype)
    logits = self.gate(x).float()  # keep the gate in the graph, as a real router
    probs = logits.softmax(-1) * 0 + 1.0 / e
    return weights + 0 * logits[:, :1].type_as(x), chosen.to(x.device), probs


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out.mkdir(parents=True, exist_ok=True)
    hydra_app(lambda cfg: None)  # registers the schema
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        dcfg = compose("config", overrides=[*BATCH, "train.steps=1", *overrides])
    cfg = OmegaConf.to_object(dcfg)
    plan = engine_plan(cfg)
    assert plan.ok, plan.errors
    moe.Router.forward = balanced
    counting = CountingDist()
    expert_parallel.dist = counting
    d = distributed.init("cpu", plan.layout)
    trainer = Trainer(cfg, plan, str(out / f"run{d.rank}"), dcfg, d)
    trainer.train_step(1)
    layers = sum(len(expert_parallel.moe_layers(part)) for part in trainer.parts)
    planned = layers * ep_layer_bytes(plan.context, plan.layout)
    (out / f"{d.rank}.json").write_text(
        json.dumps({"sent": counting.sent["rows"], "planned": planned})
    )
    distributed.shutdown()


if __name__ == "__main__":
    main()
