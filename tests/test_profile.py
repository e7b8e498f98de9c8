"""`profile.steps` / `profile.memory`: a trace per rank for each step asked for, and a memory
timeline, from the engine's own Trainer on 2 processes (FSDP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT
from jobs import train_job

from launcher.runtime.profiling import step_dir

RUN = [
    "train.steps=3",
    "train.eval_interval=0",
    "logging.wandb.mode=disabled",
    "profile.steps=[1,3]",
    "profile.memory=true",
]
PROFILED = train_job(RUN, "profiled steps 1 and 3")


@pytest.mark.dist
@pytest.mark.jobs(PROFILED)
def test_a_trace_per_rank_for_each_step_asked_for_and_a_memory_timeline(group):
    run_dir = group.result(PROFILED)
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == [
        "step_00000001",
        "step_00000003",
    ]
    for step in (1, 3):
        out = step_dir(run_dir, step)
        names = sorted(p.name for p in out.iterdir())
        assert names == ["rank_0.json", "rank_0_memory.json", "rank_1.json", "rank_1_memory.json"]
        for rank in (0, 1):
            events = json.loads((out / f"rank_{rank}.json").read_text())["traceEvents"]
            ops = {e.get("name") for e in events}
            assert "aten::mm" in ops or "aten::addmm" in ops, sorted(ops)[:20]  # the step's matmuls
            memory = json.loads((out / f"rank_{rank}_memory.json").read_text())
            times, allocated = memory["time_us"], memory["allocated_bytes"]
            assert len(times) == len(allocated) > 100 and times == sorted(times)
            assert memory["peak_bytes"] == max(allocated) > 0


def test_steps_outside_the_run_and_memory_without_steps_are_refused():
    from launcher.cli import compose
    from launcher.plan.config_rules import config_problems

    def problems(*overrides: str) -> list[str]:
        return [p.message for p in config_problems(compose(list(overrides)))]

    assert problems("train.steps=3", "profile.steps=[0,2,4]") == [
        "profile.steps=[0, 2, 4]: [0, 4] not in 1..train.steps=3"
    ]
    assert problems("profile.memory=true") == [
        "profile.memory=true needs profile.steps=[N, ...]: the steps to record"
    ]


def test_steps_a_resumed_run_has_already_trained_are_named_not_skipped_silently():
    from launcher.runtime.profiling import resumed_past

    assert resumed_past([2, 8], 5) == (
        "warning: profile.steps=[2, 8]: [2] trained before step 5, where this run resumes, "
        "so not profiled (name later steps to profile them)"
    )
    assert resumed_past([6, 8], 5) is None
    assert resumed_past([5], 5) is not None  # step 5 is the checkpoint's: not trained again
    assert resumed_past([], 0) is None


def test_a_profiled_step_prints_no_line_of_the_profilers_own(tmp_path):
    """Kineto's "USDT: ... profiler_start" lines (stderr, from C++) are not a run's output."""
    code = (
        "import torch; from types import SimpleNamespace as N; "
        "from launcher.runtime.profiling import profiled; "
        f"cm = profiled(1, N(steps=[1], memory=False), {str(tmp_path)!r}, 0, False); "
        "cm.__enter__(); torch.randn(8, 8) @ torch.randn(8, 8); cm.__exit__(None, None, None)"
    )
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        f"profiled step 1: {step_dir(tmp_path, 1)} (a trace per rank)"
    ]
    assert done.stderr == "", done.stderr
