"""The debug-scale versions of the published MoE layouts train on CPU processes, and their
expert-load metrics reach metrics.jsonl."""

from __future__ import annotations

import pytest
from conftest import read_metrics, run_cli

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("recipe", ["deepseek_v3_debug", "kimi_k2_debug", "mixtral_8x22b_debug"])
def test_moe_debug_recipe_trains(recipe, tmp_path):
    result = run_cli(
        "launcher.train",
        f"recipe={recipe}",
        "train.steps=6",
        "train.warmup_steps=2",
        "train.eval_interval=0",
        "logging.wandb.mode=disabled",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, [r["loss"] for r in rows]
    # Every MoE layer reports its load (max over mean tokens per expert, 1 is balanced).
    loads = {k: v for k, v in rows[-1].items() if k.startswith("expert_load/")}
    assert loads and all(v >= 1.0 for v in loads.values()), rows[-1]
