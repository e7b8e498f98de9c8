"""Surviving failures, with real processes and real signals (2 local processes, FSDP).

Every run here trains the same 16 steps with a checkpoint every 2; the uninterrupted run is
the reference each interrupted-then-resumed run must equal, step for step.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, run_cli, start_cli, survivors, wait_for_step
from jobs import train_job
from wandb_log import one_wandb_run

from e2e.bad_inputs import TINY_MODEL
from launcher.checkpoint import __main__ as checkpoint_command
from launcher.checkpoint.reader import checkpoint_damage
from launcher.checkpoint.store import newest_complete
from launcher.runtime import launch

pytestmark = pytest.mark.e2e

STEPS = 16
ARGS = [
    f"train.steps={STEPS}",
    "train.eval_interval=0",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "checkpoint.interval=2",
    "logging.wandb.mode=disabled",
]
EXIT_STOPPED = 75
EXIT_NONFINITE = 3


def train(run_dir: Path, *extra: str, env: dict | None = None, timeout: float = 300):
    return run_cli(
        "launcher.train", *ARGS, *extra, f'hydra.run.dir="{run_dir}"', env=env, timeout=timeout
    )


def losses(run_dir: Path) -> dict[int, float]:
    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"metrics.jsonl repeats or reorders steps: {steps}"
    return {r["step"]: r["loss"] for r in rows}


# The uninterrupted run, as a job of tests/group.py (the engine's Trainer on 2 processes, as
# launcher.train runs it; tests/e2e/test_train.py holds the two bitwise equal).
REFERENCE = train_job(ARGS, "uninterrupted run of tests/e2e/test_failures.py")


@pytest.fixture
def reference(group) -> dict[int, float]:
    return losses(group.result(REFERENCE))


@pytest.mark.jobs(REFERENCE)
def test_killed_rank_is_restarted_and_resumes(reference, tmp_path):
    """SIGKILL of rank 1 at step 8 (its own real SIGKILL, first attempt only): torchrun
    restarts both ranks, they resume from step 6, and the run ends as if nothing happened.
    (Step 7 lets step 6's checksums, written in the background, land: a crash before they do
    falls back to step 4, as a checkpoint that cannot be proven whole is not resumed.)
    wandb (offline) continues the same run id without sending a step twice. A restart resumes
    even with checkpoint.resume=never, which only keeps a new run from continuing an old one."""
    result = train(
        tmp_path,
        "train.max_restarts=1",
        "checkpoint.resume=never",
        "logging.wandb.mode=offline",
        env={"LAUNCHER_FAULT_INJECT": "1:8:kill"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "starting from step 6 of" in result.stdout
    assert losses(tmp_path) == reference
    one_wandb_run(tmp_path, starts=2, steps=STEPS)  # one id, two attempts


@pytest.mark.jobs(REFERENCE)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_the_launcher_stops_saves_and_resumes(sig, reference, tmp_path):
    proc = start_cli("launcher.train", *ARGS, f"hydra.run.dir={tmp_path}")
    wait_for_step(proc, tmp_path, 3)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    assert not survivors(tmp_path)
    done = max(losses(tmp_path))
    assert done < STEPS, "the signal came too late to test a stop"
    assert (tmp_path / "checkpoints" / f"step_{done:08d}" / "meta.json").exists()
    assert f"stopped by {sig.name} after step {done}" in err
    assert f"run stopped by {sig.name} at step {done} of {STEPS}" in out
    # The summary's command continues it: the same directory, from the next step.
    (line,) = [x for x in out.splitlines() if x.startswith("  to continue    ")]
    command = shlex.split(line.removeprefix("  to continue    "))
    assert command[:3] == ["python", "-m", "launcher.train"], command
    again = run_cli("launcher.train", *command[3:])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"starting from step {done} of" in again.stdout
    assert losses(tmp_path) == reference


@pytest.mark.jobs(REFERENCE)
def test_a_stop_at_the_last_step_ends_the_run_whole(reference, tmp_path):
    """SIGTERM as the last step's line is printed (its save, the summary, the ranks' exit
    still to come): the run finishes (the stop on the last step just ends it) or stops with
    that step saved; either way exit 0 or 75 with its one line, the final checkpoint whole,
    every step's loss the uninterrupted run's, nothing left running."""
    proc = start_cli("launcher.train", *ARGS, f"hydra.run.dir={tmp_path}")
    for line in proc.stdout:
        if line.startswith(f"step {STEPS}/{STEPS}"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=180)
    assert proc.returncode in (0, EXIT_STOPPED), err[-3000:]
    assert "Traceback" not in err and not survivors(tmp_path)
    final = tmp_path / "checkpoints" / f"step_{STEPS:08d}"
    assert newest_complete(final.parent).path == final
    assert not checkpoint_damage(newest_complete(final.parent))
    assert losses(tmp_path) == reference


@pytest.mark.parametrize("devices", [1, 2])
def test_a_stop_during_start_up_ends_like_any_stop(devices, tmp_path):
    """SIGTERM half a second in, while Python imports torch: not the default death (-15, no
    word). One process stops after its first step and saves it; a launcher whose ranks have
    not started stops before starting them, and nothing is left running."""
    args = [*ARGS, f"hardware.devices_per_node={devices}", f"hydra.run.dir={tmp_path}"]
    proc = start_cli("launcher.train", *args)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    assert "Traceback" not in err and not survivors(tmp_path)
    if devices == 1:
        assert "stopped by SIGTERM after step 1" in err
        assert (tmp_path / "checkpoints" / "step_00000001" / "meta.json").exists()
    else:
        assert "stopped by SIGTERM before the run started: no rank ran" in err, err
        assert not (tmp_path / "checkpoints").exists() or not any(
            (tmp_path / "checkpoints").iterdir()
        )


def test_a_hung_rank_fails_the_run_within_the_timeout(tmp_path):
    """Rank 1 hangs at step 3: rank 0's collective gives up after train.timeout_s, naming
    itself and the step; torchrun ends the group and nothing is left running."""
    start = time.monotonic()
    result = train(
        tmp_path, "train.timeout_s=10", env={"LAUNCHER_FAULT_INJECT": "1:3:hang"}, timeout=240
    )
    assert result.returncode not in (0, 2)
    assert "rank 0: forward/backward of step 3 waited longer than train.timeout_s=10" in (
        result.stderr
    )
    # The hung rank exits by itself train.timeout_s after torchrun's SIGTERM, not at its
    # SIGKILL 30 s later.
    assert "rank 1: still running 10 s after SIGTERM (train.timeout_s)" in result.stderr
    assert time.monotonic() - start < 120
    assert not survivors(tmp_path)


def test_a_nonfinite_run_stops_at_its_first_nonfinite_step_and_keeps_a_finite_checkpoint(
    tmp_path,
):
    """lr=1e6 trains into NaN within a few steps. The first non-finite step is not applied,
    the run stops there with exit 3 (no torchrun restart replays it), every checkpoint is from
    before it and finite (checkpoint.keep=1 would have pruned the finite one for NaN ones),
    and metrics.jsonl is strict JSON with the non-finite values as null."""
    lr = ["train.lr=1e6", "train.warmup_steps=0", "checkpoint.keep=1", "train.max_restarts=1"]
    result = train(tmp_path, *lr)
    assert result.returncode == EXIT_NONFINITE, result.stderr[-3000:]
    rows = read_metrics(tmp_path)
    bad = [r["step"] for r in rows if r["loss"] is None or r["grad_norm"] is None]
    assert bad and bad[0] > 2 and rows[-1]["step"] == bad[0], rows
    assert rows[-1]["skipped"] is True
    assert f"stopped at step {bad[0]}: the gradient norm (nan) is not finite" in result.stderr
    assert "starting from" not in result.stdout  # not restarted into the same NaN
    # The run's last lines: how it ended, where things are, the command that continues it.
    assert f"run ended (exit 3) at step {bad[0]} of {STEPS}" in result.stdout
    assert f"  checkpoint     {tmp_path / 'checkpoints'}/step_" in result.stdout
    assert f"  to continue    python -m launcher.train {ARGS[0]}" in result.stdout
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == [f"step_{(bad[0] - 1) // 2 * 2:08d}"], saved
    # Every saved tensor finite: the checkpoint exported (here, in this process) and read.
    out = tmp_path / "model.pt"
    with contextlib.redirect_stdout(io.StringIO()):
        assert (
            checkpoint_command.main(["export", str(tmp_path / "checkpoints" / saved[0]), str(out)])
            == 0
        )
    assert all(torch.isfinite(t).all() for t in torch.load(out).values())


@pytest.mark.jobs(REFERENCE)
def test_nonfinite_steps_are_skipped_up_to_max_skipped_steps(reference, tmp_path):
    """A NaN in one rank's gradient shard at step 3: every rank agrees to skip the step
    (train.max_skipped_steps=1), it is logged as skipped and training goes on to the end from
    the same parameters as before it (steps 1-3's losses are the reference's)."""
    result = train(tmp_path, "train.max_skipped_steps=1", env={"LAUNCHER_FAULT_INJECT": "1:3:nan"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 3 skipped: its loss or gradient norm is not finite" in result.stderr
    rows = {r["step"]: r for r in read_metrics(tmp_path)}
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert rows[3]["skipped"] is True and rows[3]["grad_norm"] is None
    assert not any(r.get("skipped") for s, r in rows.items() if s != 3)
    assert [rows[s]["loss"] for s in (1, 2, 3)] == [reference[s] for s in (1, 2, 3)]
    assert rows[4]["loss"] != reference[4]  # step 3 was not applied


def damage_shard(step_dir: Path, kind: str) -> None:
    """One kind of damage a checkpoint meets on disk."""
    shard = step_dir / "__1_0.distcp"
    if kind == "flipped bytes":
        data = bytearray(shard.read_bytes())
        for i in range(64):
            data[len(data) // 2 + i] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif kind == "truncated shard":
        os.truncate(shard, shard.stat().st_size // 3)
    else:
        (step_dir / ".metadata").unlink()


@pytest.mark.jobs(REFERENCE)
@pytest.mark.parametrize("kind", ["flipped bytes", "truncated shard", "deleted .metadata"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(kind, group, tmp_path):
    """The uninterrupted run's directory with its newest checkpoint (step 16) damaged and its
    metrics.jsonl cut in the middle of step 15's row, as a crash would leave them. Running the
    same command again names the damage in one warning line, drops the cut row, resumes from
    step 14 and ends with the reference's losses. The directory's name holds a quote and a
    space (the relaunch quotes it for Hydra)."""
    reference = losses(group.result(REFERENCE))
    run_dir = tmp_path / "it's a run"
    shutil.copytree(group.result(REFERENCE), run_dir)
    damage_shard(run_dir / "checkpoints" / "step_00000016", kind)
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:14]) + lines[14][:20])  # a last line cut short
    result = train(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    warned = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert any("step_00000016 is damaged" in w and "resuming from" in w for w in warned), warned
    assert "dropping a last line cut short" in result.stderr
    assert "starting from step 14 of" in result.stdout
    assert losses(run_dir) == reference


def test_a_second_run_in_the_same_directory_is_refused_and_the_first_loses_nothing(group, tmp_path):
    first = start_cli("launcher.train", *ARGS, f"hydra.run.dir={tmp_path}")
    wait_for_step(first, tmp_path, 2)
    second = train(tmp_path)
    assert second.returncode == 2
    assert f"hydra.run.dir={tmp_path} is in use by another run (host " in second.stderr
    assert f"PID {first.pid}" in second.stderr and "Traceback" not in second.stderr
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert losses(tmp_path) == losses(group.result(REFERENCE))


def test_sigkill_to_torchrun_leaves_no_rank_running(tmp_path):
    """torchrun SIGKILLed mid-run cannot stop its ranks: they notice it is gone and exit."""
    args = [*ARGS, "train.steps=400", f"hydra.run.dir={tmp_path}"]
    proc = start_cli("launcher.train", *args)
    wait_for_step(proc, tmp_path, 2)
    running = {int(line.split(":")[0]): line for line in survivors(tmp_path)}
    (agent,) = launch.children(proc.pid)  # torchrun's agent
    assert "launcher.agent" in running[agent], running
    ranks = [pid for pid in launch.children(agent) if os.getsid(pid) == pid]  # own sessions
    assert len(ranks) == 2, running
    os.kill(agent, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    deadline = time.monotonic() + 15
    while survivors(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not survivors(tmp_path), survivors(tmp_path)
    assert "is gone: exiting" in err
    assert max(losses(tmp_path)) < 400


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs: room for one checkpoint of the runs here (11.6 MB), not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.jobs(REFERENCE)
def test_a_full_disk_and_a_read_only_one_lose_nothing(small_disk, group, tmp_path):
    """The second save does not fit: one line, its partial removed, step 2 intact. A read-only
    checkpoint.dir is refused before training. With room again the run resumes from step 2
    and ends with the reference's losses."""
    run_dir = tmp_path / "run"
    full = train(run_dir, f"checkpoint.dir={small_disk}", "checkpoint.keep=0")
    assert full.returncode == 1, full.stderr[-3000:]
    assert (
        "error: the checkpoint of step 4 could not be written: No space left on device"
        in full.stderr
    )
    assert "Traceback" not in full.stderr
    assert sorted(p.name for p in small_disk.iterdir()) == ["step_00000002"]
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    read_only = train(run_dir, f"checkpoint.dir={small_disk}", "checkpoint.keep=0")
    assert read_only.returncode == 2
    assert f"checkpoint.dir={small_disk} is not writable: Read-only file system" in (
        read_only.stderr
    )
    subprocess.run(["mount", "-o", "remount,rw,size=256m", str(small_disk)], check=True)
    again = train(run_dir, f"checkpoint.dir={small_disk}", "checkpoint.keep=0")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "starting from step 2 of" in again.stdout
    assert losses(run_dir) == losses(group.result(REFERENCE))


TINY = (
    *TINY_MODEL,
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "train.eval_interval=0",
    "logging.wandb.mode=disabled",
    "checkpoint.interval=20",
)


def test_a_disk_that_fills_during_a_run_ends_it_with_one_line(small_disk):
    """The run directory's disk fills after the checkpoint of step 40: whichever write fails
    first (metrics.jsonl, TensorBoard's events, a checkpoint) ends the run with one line naming
    it and the newest checkpoint, exit 1, no traceback (under torchrun too: the record of the
    end was given its room at start). That checkpoint is whole and the run resumes from it."""
    run_dir = small_disk / "run"
    args = [*TINY, "hardware.devices_per_node=2", "logging.tensorboard=true"]
    proc = start_cli("launcher.train", *args, "train.steps=100000", f"hydra.run.dir={run_dir}")
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "step_00000040").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    # The run may have filled the disk itself by now (its next checkpoint): then the filler
    # cannot even be created, and the run ends the same way.
    with contextlib.suppress(OSError), open(small_disk / "filler", "wb") as f:
        while True:
            f.write(bytes(1 << 16))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert "No space left on device" in line and "is intact" in line, line
    newest = Path(line.split("checkpoint, ")[1].split(",")[0])
    assert newest.parent == run_dir / "checkpoints"
    assert newest_complete(newest.parent).path == newest
    assert not checkpoint_damage(newest_complete(newest.parent))
    assert survivors(run_dir) == []
    (small_disk / "filler").unlink(missing_ok=True)
    step = int(newest.name.removeprefix("step_"))
    again = run_cli("launcher.train", *args, f"train.steps={step + 1}", f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"starting from step {step} of {newest}" in again.stdout
