"""Joining an existing torchrun group, and Hydra multirun sweeps over layouts."""

from __future__ import annotations

import json

import pytest
from conftest import read_metrics, run_cli

pytestmark = pytest.mark.e2e

SHORT = ["train.steps=2", "train.eval_interval=0", "logging.wandb.mode=disabled"]


def torchrun_train(run_dir, *overrides: str):
    """`torchrun --nproc-per-node=2 -m launcher.train`: a group launcher.train must join."""
    return run_cli(
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "launcher.train",
        *SHORT,
        *overrides,
        f"hydra.run.dir={run_dir}",
    )


def test_joins_an_existing_torchrun_group(tmp_path):
    result = torchrun_train(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("data parallel") == 1  # rank 0 alone prints the plan
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_torchrun_world_size_must_match_the_plan(tmp_path):
    result = torchrun_train(tmp_path, "hardware.devices_per_node=4")
    assert result.returncode != 0
    assert "WORLD_SIZE=2" in result.stderr and "world_size=4" in result.stderr


def test_multirun_runs_valid_points_and_names_rejected_ones(tmp_path):
    """A sweep trains its valid points, names the rejected ones, and sums them up. Its
    hydra.sweep.dir holds a timestamp that Hydra resolves again for every job: each job of
    one sweep must still land in the same directory."""
    result = run_cli(
        "launcher.train",
        "-m",
        "parallel.dp_shard=2,3",
        *SHORT,
        f"hydra.sweep.dir={tmp_path}/${{run_id:}}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep,) = tmp_path.iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    assert "rejected: parallel.dp_shard=3" in result.stderr and "[world_size]" in result.stderr
    assert len(read_metrics(sweep / "0")) == 2
    assert not (sweep / "1" / "metrics.jsonl").exists()
    # The summary: the table on stdout, summary.jsonl in the sweep directory.
    rows = [json.loads(x) for x in (sweep / "summary.jsonl").read_text().splitlines()]
    assert [(r["job"], r["status"]) for r in rows] == [("0", "completed"), ("1", "rejected")]
    assert rows[0]["loss"] == read_metrics(sweep / "0")[-1]["loss"]
    assert rows[0]["predicted_tokens_per_s"] > 0 and rows[0]["tokens_per_s"] > 0
    assert "[world_size]" in rows[1]["reason"]
    assert "parallel.dp_shard=3" in result.stdout and "measured / planned" in result.stdout


def test_sweep_of_the_planners_best_layouts(tmp_path):
    """plan.candidate=k trains the k-th fastest layout of plan.search that launcher.train
    runs; a k past the end is rejected by name."""
    from launcher.cli import compose
    from launcher.plan.search import runnable

    result = run_cli(
        "launcher.train",
        "-m",
        "plan.candidate=0,99",
        "hardware.devices_per_node=2",
        *SHORT,
        f"hydra.sweep.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    best = runnable(compose(["hardware.devices_per_node=2", *SHORT]))[0].layout
    plan = json.loads((tmp_path / "0" / "plan.json").read_text())
    assert plan["degrees"] == best.degrees
    assert plan["layout"]["micro_batch_size"] == best.micro_batch_size
    assert len(read_metrics(tmp_path / "0")) == 2
    rows = [json.loads(x) for x in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert rows[1]["status"] == "rejected" and "plan.candidate=99" in rows[1]["reason"]
