"""Elastic re-plan (`parallel.auto=true`) equals the uninterrupted single-process run step for
step: one command run three times into the same run directory on 4, 2 and 3 ranks; a MoE
across a change of ep; two torchrun agents as elastic nodes, one of them SIGKILLed."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import newest_step, read_metrics, start_cli, survivors, wait_for_step
from jobs import train_job
from wandb_log import one_wandb_run

from launcher.runtime import launch, rendezvous

pytestmark = pytest.mark.e2e

STEPS = 12
ARGS = [
    f"train.steps={STEPS}",
    "train.eval_interval=0",
    "checkpoint.interval=2",
    "logging.wandb.mode=disabled",
]
REFERENCE = train_job([*ARGS, "hardware.devices_per_node=1"], "one process for test_elastic")
MOE = ["model=mixtral_debug"]
MOE_REFERENCE = train_job(
    [*ARGS, *MOE, "hardware.devices_per_node=1"], "mixtral one process for test_elastic"
)
EXIT_STOPPED = 75


def start(run_dir: Path, ranks: int, *extra: str) -> subprocess.Popen:
    args = [*ARGS, *extra, "parallel.auto=true", f"hardware.devices_per_node={ranks}"]
    return start_cli("launcher.train", *args, f"hydra.run.dir={run_dir}")


def stop_after(proc: subprocess.Popen, run_dir: Path, step: int) -> tuple[str, str]:
    """SIGTERM once metrics.jsonl reaches `step`; the run saves and exits 75."""
    wait_for_step(proc, run_dir, step)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    return out, err


def finished_like(
    proc: subprocess.Popen, run_dir: Path, reference: dict[int, float]
) -> tuple[str, str]:
    """Waits for the last run; every step once in metrics.jsonl, each loss within 1e-5 of the
    reference's. Returns its stdout and stderr."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    done = read_metrics(run_dir)
    assert [r["step"] for r in done] == list(range(1, STEPS + 1))
    for r in done:
        assert abs(r["loss"] - reference[r["step"]]) <= 1e-5, (r["step"], r["loss"])
    return out, err


@pytest.mark.jobs(REFERENCE)
def test_one_command_resumes_on_4_then_2_then_3_ranks(group, tmp_path):
    """...as one wandb run (offline): three starts, one run id, every step sent once."""
    reference = {r["step"]: r["loss"] for r in read_metrics(group.result(REFERENCE))}
    wandb = "logging.wandb.mode=offline"
    out4, _ = stop_after(start(tmp_path, 4, wandb), tmp_path, 4)
    assert "planned for 4 rank(s): dp_shard=4" in out4
    first = newest_step(tmp_path)
    out2, _ = stop_after(start(tmp_path, 2, wandb), tmp_path, first + 3)
    assert "re-planned for 2 rank(s) (was 4): dp_shard=2" in out2
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert f"starting from step {first} of" in out2, (first, saved, out2[-1500:])
    out3, _ = finished_like(start(tmp_path, 3, wandb), tmp_path, reference)
    # llama3_debug's 8 heads and 16 sequences do not split over 3: a 3-stage pipeline.
    assert "re-planned for 3 rank(s) (was 2): pp=3 1f1b" in out3
    ran_on = [r["layout"].split(" rank(s)")[0] for r in read_metrics(tmp_path)]
    assert ran_on[0] == "4" and ran_on[-1] == "3" and "2" in ran_on, ran_on
    one_wandb_run(tmp_path, starts=3, steps=STEPS)


@pytest.mark.jobs(MOE_REFERENCE)
def test_a_moe_run_resumes_across_a_world_that_changes_ep(group, tmp_path):
    """mixtral_debug on 4 ranks with its 4 experts one per rank (parallel.ep=4 kept beside
    auto), then on 2 ranks with two per rank (ep=2): the same run directory, the same losses
    as one process."""
    reference = {r["step"]: r["loss"] for r in read_metrics(group.result(MOE_REFERENCE))}
    out4, _ = stop_after(start(tmp_path, 4, *MOE, "parallel.ep=4"), tmp_path, 4)
    assert "planned for 4 rank(s): dp_shard=4 ep=4" in out4
    out2, _ = finished_like(start(tmp_path, 2, *MOE, "parallel.ep=2"), tmp_path, reference)
    assert "re-planned for 2 rank(s) (was 4): dp_shard=2 ep=2" in out2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_of(launcher: subprocess.Popen) -> int:
    """The PID of the torchrun agent a launcher process started."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in launch.children(launcher.pid):
            with contextlib.suppress(OSError):
                if b"launcher.agent" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
        time.sleep(0.1)
    raise AssertionError("the launcher started no torchrun")


@pytest.mark.jobs(REFERENCE)
def test_two_elastic_nodes_lose_one_and_the_survivor_replans(group, tmp_path):
    """Two launchers on this machine as the two nodes of 2 ranks of one run meeting at
    launch.rendezvous, elastic down to one (launch.min_nodes=1). The first one's torchrun
    agent (beside which its launcher started the rendezvous store) is SIGKILLed mid-run: its
    ranks exit, the survivor's fail their step, torchrun regroups them as one node of 2 ranks,
    which re-plans and resumes from the newest checkpoint."""
    reference = {r["step"]: r["loss"] for r in read_metrics(group.result(REFERENCE))}
    port = free_port()
    args = [
        *ARGS,
        "parallel.auto=true",
        "hardware.nodes=2",
        "hardware.devices_per_node=2",
        f"launch.rendezvous=127.0.0.1:{port}",
        "launch.min_nodes=1",
        "train.max_restarts=2",
        "logging.wandb.mode=offline",
        f"hydra.run.dir={tmp_path}",
    ]
    first = start_cli("launcher.train", *args)
    second = start_cli("launcher.train", *args)
    agent = torchrun_of(first)
    wait_for_step(first, tmp_path, 3)
    assert read_metrics(tmp_path)[0]["layout"].startswith("4 rank(s)"), read_metrics(tmp_path)
    os.kill(agent, signal.SIGKILL)
    _, err1 = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGKILL, err1[-3000:]
    assert f"torchrun (PID {agent}) was killed by SIGKILL" in err1
    out2, err2 = finished_like(second, tmp_path, reference)
    assert "re-planned for 2 rank(s) (was 4): dp_shard=2" in out2
    assert "a peer process is gone" in err2 and "Traceback" not in err2, err2[-3000:]
    ran_on = [r["layout"].split(" rank(s)")[0] for r in read_metrics(tmp_path)]
    assert ran_on[0] == "4" and ran_on[-1] == "2", ran_on
    one_wandb_run(tmp_path, starts=2, steps=STEPS)
    # The store leaves with the last launcher; no process of the run is left.
    deadline = time.monotonic() + 15
    while (rendezvous.listening("127.0.0.1", port) or survivors(tmp_path)) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert not rendezvous.listening("127.0.0.1", port), "the rendezvous store is still up"
    assert not survivors(tmp_path), survivors(tmp_path)
