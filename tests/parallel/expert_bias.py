"""The engine's Trainer for a few steps, then every rank's router biases and expert loads.

A job of tests/group.py: `job(OUT_DIR, STEPS, *OVERRIDES)` trains the composed config's
layout (the parity harness's batch) and writes OUT_DIR/RANK.json: {layer: expert_bias as a
list} for the MoE layers this rank holds, and the metrics of the last step. DeepSeek-V3's bias
update must leave the same bias on every rank (it is computed from loads summed over all of
them); DCP checkpoints keep one copy of a replicated buffer, so only the ranks can show it.
"""

from __future__ import annotations

import json
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launcher.cli import CONF_DIR, hydra_app
from launcher.parallel.expert_parallel import moe_layers
from launcher.plan import engine_plan
from launcher.runtime import distributed
from launcher.training.trainer import Trainer

BATCH = ["train.global_batch_size=8", "train.micro_batch_size=2", "precision=fp32"]


def build_trainer(out: Path, overrides: list[str]) -> Trainer:
    """The engine's Trainer for the composed config (the parity batch), in this process of the
    group; its run directory under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    hydra_app(lambda cfg: None)  # registers the schema
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        dcfg = compose("config", overrides=[*BATCH, *overrides])
    cfg = OmegaConf.to_object(dcfg)
    plan = engine_plan(cfg)
    assert plan.ok, plan.errors
    d = distributed.init("cpu", plan.layout)
    return Trainer(cfg, plan, str(out / f"run{d.rank}"), dcfg, d)


def job(out: Path, steps: str, *overrides: str) -> None:
    """Train `steps` steps of the overrides; write OUT/RANK.json."""
    trainer = build_trainer(out, [f"train.steps={steps}", *overrides])
    metrics = {}
    for step in range(1, int(steps) + 1):
        metrics = trainer.train_step(step)
    biases = {
        i: moe.router.expert_bias.tolist()
        for part in trainer.parts
        for i, moe in moe_layers(part)
        if moe.router.expert_bias is not None
    }
    (out / f"{trainer.d.rank}.json").write_text(json.dumps({"bias": biases, "metrics": metrics}))
