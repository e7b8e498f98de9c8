"""The dry run shards the real model over a fake group and agrees with the analytic count
(within 0.1%: more fails the dry run)."""

from __future__ import annotations

import pytest
from conftest import REFUSED_RECIPES, ROOT, compose_config, run_cli

from launcher.plan import make_plan
from launcher.plan.dry_run import dry_run

H100 = ["hardware=h100_80g", "train.micro_batch_size=1", "train.seq_len=4096"]
LAYOUTS = {
    "llama3_8b fsdp 64": ["model=llama3_8b", "hardware.nodes=8", "train.global_batch_size=64"],
    "llama3_8b hsdp 8x16": [
        "model=llama3_8b",
        "hardware.nodes=16",
        "parallel.dp_replicate=8",
        "train.global_batch_size=128",
    ],
    "llama3_8b zero2 128": [
        "model=llama3_8b",
        "hardware.nodes=16",
        "data_parallel=zero2",
        "train.global_batch_size=128",
    ],
    "llama3_8b zero1 64": [
        "model=llama3_8b",
        "hardware.nodes=8",
        "data_parallel=zero1",
        "train.global_batch_size=64",
    ],
    "llama3_8b fsdp 8 x tp 8": [
        "model=llama3_8b",
        "hardware.nodes=8",
        "parallel.tp=8",
        "tensor=sequence_parallel",
        "train.global_batch_size=64",
    ],
    "llama3_8b hsdp 2x4 x tp 8": [
        "model=llama3_8b",
        "hardware.nodes=8",
        "parallel.tp=8",
        "parallel.dp_replicate=2",
        "train.global_batch_size=64",
    ],
    "llama3_8b pp 4 x fsdp 16": [
        "model=llama3_8b",
        "hardware.nodes=8",
        "parallel.pp=4",
        "train.global_batch_size=64",
    ],
    "llama3_8b pp 4 x fsdp 16 resharding every micro-batch": [
        "model=llama3_8b",
        "hardware.nodes=8",
        "parallel.pp=4",
        "pipeline.reshard_each_microbatch=true",
        "train.global_batch_size=64",
    ],
    # Zero-bubble schedules do not train under FSDP (launcher/plan/limitations.py).
    "llama3_8b pp 8 zbv x tp 8": [
        "model=llama3_8b",
        "hardware.nodes=8",
        "parallel.pp=8",
        "parallel.tp=8",
        "parallel.dp_shard=1",
        "pipeline=zbv",
        "train.global_batch_size=64",
    ],
    "llama3_8b pp 4 split 5,9,9,9 x fsdp 16": [
        "model=llama3_8b",
        "hardware.nodes=8",
        "parallel.pp=4",
        "pipeline.layers_per_stage=[5,9,9,9]",
        "train.global_batch_size=64",
    ],
    "mixtral_8x7b fsdp 128": [
        "model=mixtral_8x7b",
        "hardware.nodes=16",
        "train.global_batch_size=128",
    ],
    # Experts under a pipeline: each rank holds its ep share of its stages' experts, sharded
    # by FSDP over the ranks holding the same experts (dp_shard x tp / ep), not over dp_shard.
    "mixtral_8x7b pp 4 x tp 2 x ep 4 x fsdp 8": [
        "model=mixtral_8x7b",
        "hardware.nodes=8",
        "parallel.pp=4",
        "parallel.tp=2",
        "parallel.ep=4",
        "train.global_batch_size=64",
    ],
    "mixtral_8x7b pp 4 x ep 8 x zero1 16": [
        "model=mixtral_8x7b",
        "hardware.nodes=8",
        "parallel.pp=4",
        "parallel.ep=8",
        "data_parallel=zero1",
        "train.global_batch_size=64",
    ],
    # A tied embedding under a pipeline: the last stage holds a copy of it.
    "llama3_8b tied pp 4 x tp 8": [
        "model=llama3_8b",
        "model.tie_embeddings=true",
        "hardware.nodes=8",
        "parallel.pp=4",
        "parallel.tp=8",
        "parallel.dp_shard=2",
        "train.global_batch_size=64",
    ],
    "mixtral_8x7b hsdp 2x32": [
        "model=mixtral_8x7b",
        "hardware.nodes=8",
        "parallel.dp_replicate=2",
        "train.global_batch_size=64",
    ],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dry_run_matches_analytic_parameters(name):
    cfg = compose_config(H100 + LAYOUTS[name])
    plan = make_plan(cfg)
    assert plan.ok, plan.errors
    assert plan.world_size >= 64
    result = dry_run(cfg, plan)
    assert result.ok, result.errors
    assert result.relative_error < 1e-3, (result.engine_params, result.analytic_params)


def test_dry_run_builds_through_the_trainers_build(monkeypatch):
    """One build path: the dry run calls launcher.parallel.build, as the trainer does, and
    only its last step (allocating on the device) is skipped on the meta device."""
    import launcher.parallel
    import launcher.training.trainer

    calls = []
    real = launcher.parallel.build

    def counting(cfg, layout, d, pp_rank):
        built = real(cfg, layout, d, pp_rank)
        calls.append([p.device.type for _, m in built.stages for p in m.parameters()])
        return built

    monkeypatch.setattr(launcher.parallel, "build", counting)
    cfg = compose_config(["model.tie_embeddings=true", "parallel.pp=2", "parallel.dp_shard=1"])
    assert dry_run(cfg, make_plan(cfg)).ok
    assert len(calls) == 1 and set(calls[0]) == {"meta"}
    assert launcher.training.trainer.build is real  # the trainer's, imported from the same place


def test_dry_run_reports_what_the_engine_refuses():
    cfg = compose_config(
        H100
        + [
            "model=llama3_8b",
            "hardware.nodes=8",
            "parallel.pp=2",
            "pipeline=zbv",
            "recompute=op",
            "train.global_batch_size=64",
        ]
    )
    result = dry_run(cfg, make_plan(cfg))
    assert not result.ok
    assert "recompute=op with pipeline.schedule=zbv is not available" in result.errors[0]


def test_dry_run_builds_context_parallel_layout():
    """cp x tp x FSDP over dp_shard x cp on the full 64-rank mesh: the engine holds what the
    planner counts (context-parallel ranks hold whole parameter shards of dp_shard x cp)."""
    cfg = compose_config(
        H100
        + [
            "model=llama3_8b",
            "hardware.nodes=8",
            "parallel.cp=2",
            "parallel.tp=4",
            "context=ring",
            "train.global_batch_size=64",
            "train.micro_batch_size=1",
        ]
    )
    result = dry_run(cfg, make_plan(cfg))
    assert result.ok, result.errors
    assert result.relative_error < 1e-3, (result.engine_params, result.analytic_params)


@pytest.mark.e2e
def test_dry_run_cli_json():
    import json

    result = run_cli(
        "launcher.plan",
        *H100,
        *LAYOUTS["mixtral_8x7b fsdp 128"],
        "plan.dry_run=true",
        "plan.format=json",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    assert out["dry_run"]["ok"] and out["dry_run"]["relative_error"] < 1e-3


CLUSTER_RECIPES = [
    p.stem
    for p in sorted((ROOT / "recipes").glob("*.yaml"))
    if compose_config([f"recipe={p.stem}"]).hardware.device_type.value == "cuda"
]


@pytest.mark.parametrize("recipe", CLUSTER_RECIPES)
def test_every_cluster_recipe_dry_runs_to_the_planners_count(recipe):
    """At its full world size, every parameter placed as the engine places it (experts under
    pipelines, tied copies, gpt's replicated biases and positions): within 0.1%, or refused
    by the limitation conftest.REFUSED_RECIPES names for it."""
    cfg = compose_config([f"recipe={recipe}"])
    result = dry_run(cfg, make_plan(cfg))
    if recipe in REFUSED_RECIPES:
        assert result.errors and "not available" in result.errors[0], result.errors
        return
    assert result.ok, (result.errors, result.engine_params, result.analytic_params)


# launcher.plan with the planner's per-rank count made 1% too high, run as the CLI runs.
WRONG_PLANNER = """
import dataclasses, runpy, sys
import launcher.plan.dry_run as dry_run
real = dry_run.rank_params
def wrong(*args, **kwargs):
    held = real(*args, **kwargs)
    return dataclasses.replace(held, dense=held.dense * 1.01, experts=held.experts * 1.01)
dry_run.rank_params = wrong
sys.argv = ["launcher.plan", *sys.argv[1:]]
runpy.run_module("launcher.plan", run_name="__main__", alter_sys=True)
"""


def test_dry_run_mismatch_fails_the_cli():
    """A planner more than 0.1% from the engine's shards exits 1 (the planner's failure, not
    a usage error) and says how far apart they are."""
    import subprocess
    import sys

    args = [*H100, *LAYOUTS["mixtral_8x7b fsdp 128"], "plan.dry_run=true"]
    result = subprocess.run(
        [sys.executable, "-c", WRONG_PLANNER, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1, (result.stdout[-2000:], result.stderr[-2000:])
    assert "(1.000% apart)" in result.stdout and "Traceback" not in result.stderr
