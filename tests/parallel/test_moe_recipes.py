"""The debug-scale versions of the published MoE layouts train on CPU processes, and their
expert-load metrics reach metrics.jsonl.

Each recipe trains as a job of tests/group.py (the engine's own Trainer on as many processes as
the recipe asks for, writing metrics.jsonl as a run directory holds it); the CLI path around it
(plan, relaunch, torchrun) has its own end-to-end tests.
"""

from __future__ import annotations

import pytest
from conftest import compose_config, read_metrics
from jobs import train_job

pytestmark = pytest.mark.dist

SHORT = ("train.steps=6", "train.warmup_steps=2", "train.eval_interval=0")


def recipe_job(recipe: str):
    overrides = [f"recipe={recipe}", *SHORT, "logging.wandb.mode=disabled"]
    return train_job(overrides, recipe, compose_config(overrides).hardware.devices_per_node)


@pytest.mark.parametrize(
    "job",
    [recipe_job(r) for r in ("deepseek_v3_debug", "kimi_k2_debug", "mixtral_8x22b_debug")],
    ids=lambda job: job.label,
)
def test_moe_debug_recipe_trains(job, group):
    rows = read_metrics(group.result(job))
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, [r["loss"] for r in rows]
    # Every MoE layer reports its load (max over mean tokens per expert, 1 is balanced).
    loads = {k: v for k, v in rows[-1].items() if k.startswith("expert_load/")}
    assert loads and all(v >= 1.0 for v in loads.values()), rows[-1]
