"""`python -m launcher.runs`: the table of runs and their plot, from run directories' files."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from conftest import run_cli, survivors

from launcher import runs
from launcher.runtime import rundir
from launcher.runtime.failures import EXIT_FILE, EXIT_STOPPED, STOPPED_FILE, no_rank_ran


def make_run(path, steps_done: int, steps: int = 4, layout="2 rank(s): dp_shard=2", **files):
    path.mkdir(parents=True)
    plan = {"train_steps": steps, "model": "llama3_debug"}
    (path / runs.PLAN).write_text(json.dumps(plan))
    rows = [
        {
            "step": s,
            "loss": 5.0 - s / 10,
            "lr": 1e-3 * s,
            "grad_norm": 1.0,
            "tokens_per_s": 1000.0 + s,
            "layout": layout,
            **({"eval_loss": 4.5} if s == 2 else {}),
        }
        for s in range(1, steps_done + 1)
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (path / runs.METRICS).write_text(text + '{"step": 9, "loss"')  # a last row cut short
    for name, value in files.items():
        (path / name).write_text(json.dumps(value))
    return path


@pytest.fixture
def release():
    yield
    while rundir._held:
        os.close(rundir._held.pop())


def test_every_status_from_the_files(tmp_path, release):
    out = tmp_path / "outputs"
    make_run(out / "done", 4)
    make_run(out / "stopped", 2, **{STOPPED_FILE: {"step": 2}})
    make_run(out / "ended", 3, **{EXIT_FILE: {"status": 3, "message": "non-finite"}})
    make_run(out / "crashed", 1)
    make_run(out / "live", 2)
    rundir.lock(out / "live")  # this process trains it
    away = make_run(out / "away", 2, **{rundir.LOCK: {"host": "node7", "pid": 1, "since": 0}})
    make_run(tmp_path / "multirun" / "sweep" / "0", 4)
    (out / "done" / "checkpoints" / "step_00000004").mkdir(parents=True)  # not a run
    found = runs.find([out, tmp_path / "multirun"])
    assert [p.relative_to(tmp_path).as_posix() for p in found] == [
        "multirun/sweep/0",
        "outputs/away",
        "outputs/crashed",
        "outputs/done",
        "outputs/ended",
        "outputs/live",
        "outputs/stopped",
    ]
    by = {p.name: runs.summary(p) for p in found}
    assert {k: v["status"] for k, v in by.items()} == {
        "0": "finished",
        "away": "running on node7",
        "crashed": "failed",
        "done": "finished",
        "ended": "ended (exit 3)",
        "live": "running",
        "stopped": "stopped",
    }
    done = by["done"]
    assert (done["model"], done["step"], done["steps"]) == ("llama3_debug", 4, 4)
    assert done["loss"] == pytest.approx(4.6) and done["eval_loss"] == 4.5
    assert done["layout"] == "dp_shard=2" and done["checkpoint"] is None
    old = time.time() - 2 * runs.RECENT_S
    os.utime(away / runs.METRICS, (old, old))
    assert runs.summary(away)["status"] == "failed"  # its host has not written for long
    assert socket.gethostname() != "node7"


def test_the_table_and_the_plot_on_the_command_line(tmp_path):
    a = make_run(tmp_path / "a", 4)
    b = make_run(tmp_path / "b", 3, layout="4 rank(s): pp=2 1f1b")
    table = run_cli("launcher.runs", str(tmp_path))
    assert table.returncode == 0, table.stderr
    assert "2 run(s)" in table.stdout and "4 / 4" in table.stdout and "pp=2 1f1b" in table.stdout
    png = tmp_path / "curves.png"
    drawn = run_cli("launcher.runs", "plot", str(a), str(b), "--out", str(png))
    assert drawn.returncode == 0, drawn.stderr
    assert f"wrote {png}: 2 run(s)" in drawn.stdout
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert height > width  # the five panels, one above the other
    bad = run_cli("launcher.runs", "plot", str(tmp_path), "--out", str(png))
    assert bad.returncode == 2 and "not a run directory (no metrics.jsonl)" in bad.stderr
    bad = run_cli("launcher.runs", "plot", str(a), "--out", str(tmp_path / "c.txt"))
    assert bad.returncode == 2 and "must end in .png, .svg or .pdf" in bad.stderr
    bad = run_cli("launcher.runs", str(tmp_path / "nowhere"))
    assert bad.returncode == 2 and "no such directory" in bad.stderr
    missing = tmp_path / "nowhere" / "c.png"
    bad = run_cli("launcher.runs", "plot", str(a), "--out", str(missing))
    assert bad.returncode == 2 and bad.stderr == (
        f"error: --out {missing}: no such directory {missing.parent}\n"
    )
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "metrics.jsonl").write_bytes(b'\xff\xfe\x00 not utf-8\n{"step": "x"}\n[1, 2]\n')
    listed = run_cli("launcher.runs", str(tmp_path))
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    assert "3 run(s)" in listed.stdout and "0 / ?" in listed.stdout
    # Named for a plot, it is refused by name rather than drawn as nothing.
    drawn = run_cli("launcher.runs", "plot", str(junk), str(a), "--out", str(png))
    assert drawn.returncode == 2 and drawn.stderr == (
        f"error: {junk / 'metrics.jsonl'}:1 is not a metrics row of this launcher: a damaged or "
        "foreign file\n"
    ), drawn.stderr
    (tmp_path / "taken.png").mkdir()  # a directory where the file would go
    bad = run_cli("launcher.runs", "plot", str(a), "--out", str(tmp_path / "taken.png"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert (
        bad.stderr
        == f"error: --out {tmp_path / 'taken.png'} is a directory; name the file to write\n"
    )


def test_runs_of_one_model_show_what_sets_each_apart(tmp_path):
    """Not only a hash in the directory's name: the overrides not common to all the runs of a
    model, from plan.json, or from Hydra's .hydra/overrides.yaml in runs written before."""
    a = make_run(tmp_path / "a", 4)
    b = make_run(tmp_path / "b", 4)
    c = make_run(tmp_path / "c", 4)
    for run, schedule in ((a, "cosine"), (b, "wsd")):
        plan = json.loads((run / runs.PLAN).read_text())
        plan["overrides"] = ["train.steps=4", f"train.lr_schedule={schedule}"]
        (run / runs.PLAN).write_text(json.dumps(plan))
    (c / ".hydra").mkdir()
    (c / ".hydra" / "overrides.yaml").write_text("- train.steps=4\n- train.lr=0.01\n")
    found = [runs.summary(p) for p in runs.find([tmp_path])]
    assert runs.differences(found) == {
        str(a): "train.lr_schedule=cosine",
        str(b): "train.lr_schedule=wsd",
        str(c): "train.lr=0.01",
    }
    assert runs.differences(found[:1]) == {}  # one run of its model: nothing to tell apart


def test_a_run_whose_files_lead_to_a_device_is_listed_not_read_without_end(tmp_path):
    run = tmp_path / "endless"
    run.mkdir()
    (run / runs.METRICS).symlink_to("/dev/zero")
    (run / runs.PLAN).symlink_to("/dev/zero")
    (summary,) = [runs.summary(p) for p in runs.find([tmp_path])]
    assert (summary["step"], summary["steps"], summary["status"]) == (0, None, "failed")


def test_a_second_ctrl_c_ends_the_run_as_stopped_with_130(tmp_path):
    """The second Ctrl-C kills the ranks without a checkpoint of their step: the launcher
    exits 130 (as a shell reports SIGINT), not -9's 247, and the runs table says stopped."""
    import signal
    import sys
    import threading

    from launcher.runtime.early import spawn
    from launcher.runtime.launch import supervise

    # A torchrun whose rank ignores the first Ctrl-C (it would save and stop).
    rank = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    ranks = (
        "import signal, subprocess, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        f"subprocess.run([sys.executable, '-c', {rank!r}])"
    )
    begun = time.monotonic()

    def press_ctrl_c_twice():
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)  # the first: the ranks are to save and stop
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)  # the second: stop now

    threading.Thread(target=press_ctrl_c_twice, daemon=True).start()
    status = supervise(
        lambda: spawn([sys.executable, "-c", ranks], dict(os.environ)), tmp_path, 600
    )
    assert status == 130 and time.monotonic() - begun < 30
    assert runs.summary(tmp_path)["status"] == "stopped"


def test_a_stop_while_torchrun_starts_ends_the_run_in_one_line(tmp_path, capfd):
    """A Ctrl-C in the hand-over, torchrun started but no rank yet (it imports torch for
    seconds): torchrun is ended before it prints KeyboardInterrupt's traceback, no process
    stays, and the run ends as one stopped before it started (EXIT_STOPPED, its line)."""
    import signal
    import sys
    import threading

    from launcher.runtime.early import spawn
    from launcher.runtime.launch import supervise

    marker = tmp_path / "torchrun started"
    starting = (  # a torchrun still importing: Python's own Ctrl-C handling, no child yet
        f"import pathlib, time; pathlib.Path({str(marker)!r}).touch(); time.sleep(60)"
    )

    def press_ctrl_c():
        while not marker.exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    begun = time.monotonic()
    status = supervise(
        lambda: spawn([sys.executable, "-c", starting], dict(os.environ)), tmp_path, 600
    )
    err = capfd.readouterr().err
    assert status == EXIT_STOPPED and time.monotonic() - begun < 30
    assert err == f"{no_rank_ran(signal.SIGINT)}\n", err
    assert not survivors(tmp_path), "torchrun outlived the stop"
