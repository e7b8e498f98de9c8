"""What expert parallelism sends in one real training step, against the planner's figure.

A job of tests/group.py: `job(OUT_DIR, *OVERRIDES)` builds the engine's Trainer for the
composed config (expert_bias.build_trainer: fp32, the parity batch), forces balanced routing
(token t's j-th copy goes to expert (t k + j) mod E, so every expert gets the same number of
copies from every rank: the planner's assumption), runs one step and writes OUT_DIR/RANK.json:
{"sent": bytes of token copies and their gradients this rank sent to other ranks, "planned":
the planner's ep_layer_bytes times the MoE layers this rank holds}.

Bytes are counted at the all-to-alls expert_parallel.py calls, through a stand-in for its `dist`
module, as what must leave this rank: the rows it sends to every other rank (the split count
exchange, integers, is counted apart and left out).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.models import moe
from launcher.parallel import expert_parallel
from launcher.plan.terms.ep import ep_layer_bytes
from parallel.expert_bias import build_trainer


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


def job(out: Path, *overrides: str) -> None:
    """One step of the overrides with balanced routing; writes OUT/RANK.json."""
    counting, forward = CountingDist(), moe.Router.forward
    moe.Router.forward, expert_parallel.dist = balanced, counting
    try:
        trainer = build_trainer(out, ["train.steps=1", *overrides])
        trainer.train_step(1)
    finally:  # the next job in this process routes and counts as usual
        moe.Router.forward, expert_parallel.dist = forward, dist
    layers = sum(len(expert_parallel.moe_layers(part)) for part in trainer.parts)
    planned = layers * ep_layer_bytes(trainer.plan.context, trainer.plan.layout)
    (out / f"{trainer.d.rank}.json").write_text(
        json.dumps({"sent": counting.sent["rows"], "planned": planned})
    )
