"""A SLURM job warned before its end checkpoints, is requeued and finishes like an
uninterrupted run; a job killed outright is failed in the sweep, which returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, read_metrics
from jobs import train_job
from wandb_log import one_wandb_run

pytestmark = pytest.mark.e2e

RUN = [
    "train.eval_interval=0",
    "logging.wandb.mode=disabled",
    "hardware.devices_per_node=2",
]


WARNED = ["train.steps=24", "train.seed=5"]
# The uninterrupted runs the requeued jobs are held to, as jobs of tests/group.py (the engine's
# Trainer as launcher.train runs it; tests/e2e/test_train.py holds the two bitwise equal).
UNINTERRUPTED = train_job([*RUN, *WARNED], "uninterrupted run of the warned SLURM job")
ONE_PROCESS = train_job(
    [*RUN[:2], "hardware.devices_per_node=1", "train.steps=16"], "one process, 16 steps"
)


def start_sweep(sweep_dir, env, *overrides):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher.train",
            "-m",
            *RUN,
            *overrides,
            "hydra/launcher=slurm",
            "hydra.launcher.timeout_min=10",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=ROOT,
        env={**env, "WANDB_SILENT": "true"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_steps(metrics, steps: int, sweep, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        if sweep.poll() is not None:
            pytest.fail(f"the sweep ended early: {sweep.communicate()[1][-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"{metrics} did not reach step {steps} in {timeout} s")


def running_job(cluster) -> str:
    (job,) = cluster.run("squeue", "-h", "-t", "RUNNING", "-o", "%i").stdout.split()
    return job


def release_requeued(cluster, job: str, timeout: float = 120) -> None:
    """SLURM holds a requeued job for about two minutes (EligibleTime = requeue + 121 s here):
    once the launcher has requeued it, start it now instead, to keep the test short."""
    deadline, released = time.monotonic() + timeout, False
    while time.monotonic() < deadline:
        record = cluster.job(job)
        if record.get("JobState") == "PENDING" and record.get("Reason") == "BeginTime":
            # Again if an update of the job (the sweep restoring a node range) held it anew.
            cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
            released = True
        elif released and record.get("JobState") != "PENDING":
            return
        time.sleep(0.5)
    pytest.fail(f"job {job} was not requeued and started within {timeout} s:\n{cluster.logs()}")


def summary_row(sweep_dir) -> dict:
    (row,) = [json.loads(x) for x in (sweep_dir / "summary.jsonl").read_text().splitlines()]
    return row


@pytest.mark.jobs(UNINTERRUPTED)
def test_warned_job_checkpoints_is_requeued_and_matches_the_uninterrupted_run(
    slurm_cluster, group, tmp_path
):
    sweep_dir = tmp_path / "sweep"
    sweep = start_sweep(sweep_dir, slurm_cluster.env, *WARNED)
    try:
        wait_for_steps(sweep_dir / "0" / "metrics.jsonl", 3, sweep)
        # What SLURM sends signal_delay_s before a time limit (submitit asks for USR2).
        job = running_job(slurm_cluster)
        slurm_cluster.run("scancel", "--signal=USR2", job)
        release_requeued(slurm_cluster, job)
        out, err = sweep.communicate(timeout=400)
    finally:
        sweep.kill()
    assert sweep.returncode == 0, err[-3000:] + slurm_cluster.logs()
    row = summary_row(sweep_dir)
    assert row["status"] == "completed" and row["requeued"] >= 1, row
    assert (sweep_dir / "0" / "stopped.json").exists()  # the stop checkpoint was taken
    got = read_metrics(sweep_dir / "0")
    assert [r["step"] for r in got] == list(range(1, 25))  # every step once
    want = [r["loss"] for r in read_metrics(group.result(UNINTERRUPTED))]
    assert [r["loss"] for r in got] == pytest.approx(want, rel=1e-6)
    assert "completed (requeued" in out


def test_killed_job_is_failed_and_the_sweep_returns_without_accounting(slurm_cluster, tmp_path):
    """No stand-in sacct on PATH: the real one fails without accounting storage, as on a
    cluster without it; the launcher watches the queue itself."""
    env = dict(slurm_cluster.env)
    env["PATH"] = os.pathsep.join(
        p for p in env["PATH"].split(os.pathsep) if p != str(slurm_cluster.bin)
    )
    sweep_dir = tmp_path / "sweep"
    sweep = start_sweep(sweep_dir, env, "train.steps=500")
    try:
        wait_for_steps(sweep_dir / "0" / "metrics.jsonl", 2, sweep)
        slurm_cluster.run("scancel", "--signal=KILL", running_job(slurm_cluster))
        killed = time.monotonic()
        out, err = sweep.communicate(timeout=120)
    finally:
        sweep.kill()
    assert sweep.returncode == 0, err[-3000:]
    assert time.monotonic() - killed < 60
    row = summary_row(sweep_dir)
    assert row["status"] == "failed" and "without a result" in row["reason"], row
    assert "failed" in out


@pytest.mark.jobs(ONE_PROCESS)
def test_node_range_job_requeued_onto_one_node_replans_and_matches_one_process(
    slurm_cluster, group, tmp_path
):
    """A parallel.auto point of launch.min_nodes=1 of hardware.nodes=2 is submitted as
    --nodes=1-2 and starts on both nodes (4 ranks). n2 is drained and SLURM's warning signal
    stops the job, which requeues itself and comes back on n1 alone: it re-plans for 2 ranks
    and finishes with the losses of one process, each step once; the summary shows both
    layouts."""
    sweep_dir = tmp_path / "sweep"
    run = [
        "train.steps=16",
        "checkpoint.interval=2",
        "parallel.auto=true",
        "logging.wandb.mode=offline",
    ]
    sweep = start_sweep(
        sweep_dir, slurm_cluster.env, *run, "hardware.nodes=2", "launch.min_nodes=1"
    )
    try:
        wait_for_steps(sweep_dir / "0" / "metrics.jsonl", 3, sweep)
        job = running_job(slurm_cluster)
        assert slurm_cluster.job(job).get("NumNodes") == "2", slurm_cluster.job(job)
        slurm_cluster.run("scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=test")
        slurm_cluster.run("scancel", "--signal=USR2", job)
        release_requeued(slurm_cluster, job)
        out, err = sweep.communicate(timeout=400)
    finally:
        sweep.kill()
        slurm_cluster.run("scontrol", "update", "NodeName=n2", "State=RESUME", check=False)
    assert sweep.returncode == 0, err[-3000:] + slurm_cluster.logs()
    row = summary_row(sweep_dir)
    assert row["status"] == "completed" and row["requeued"] >= 1, row
    assert [x.split(" rank(s)")[0] for x in row["layouts"]] == ["4", "2"], row["layouts"]
    got = read_metrics(sweep_dir / "0")
    assert [r["step"] for r in got] == list(range(1, 17))  # every step once
    one_wandb_run(sweep_dir / "0", starts=2, steps=16)  # one wandb run across the requeue
    want = [r["loss"] for r in read_metrics(group.result(ONE_PROCESS))]
    assert [r["loss"] for r in got] == pytest.approx(want, abs=1e-5)
    assert "4 rank(s)" in out and "2 rank(s)" in out  # the summary's layout column
