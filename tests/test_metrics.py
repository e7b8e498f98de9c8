"""metrics.jsonl: strict JSON, appended in place, a cut-short last line dropped on resume."""

from __future__ import annotations

import json

from conftest import strict_json

from launcher.runtime.metrics import MetricsLogger, json_safe, keep_steps_up_to


def rows(n: int) -> str:
    return "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, n + 1))


def test_resume_truncates_later_rows_in_place(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows(6))
    inode = path.stat().st_ino
    assert keep_steps_up_to(path, 4) == 6
    assert path.stat().st_ino == inode  # the same file: another writer's rows are not swapped out
    assert [strict_json(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_a_last_line_cut_short_is_dropped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows(3) + '{"step": 4, "lo')
    assert keep_steps_up_to(path, 3) == 3
    assert path.read_text() == rows(3)
    assert "dropping a last line cut short" in capsys.readouterr().err


def test_a_whole_last_row_without_its_newline_is_kept_and_ended(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows(3).rstrip("\n"))
    assert keep_steps_up_to(path, 3) == 3
    assert path.read_text() == rows(3)


def test_non_finite_values_are_written_as_null():
    record = json_safe({"step": 4, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1})
    assert strict_json(json.dumps(record, allow_nan=False)) == {
        "step": 4,
        "loss": None,
        "grad_norm": None,
        "lr": 0.1,
    }


METRICS = {"lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 100.0, "mfu": 0.1}


def new_logger(tmp_path, total: int, start: int = 0, mode="disabled", **logging) -> MetricsLogger:
    """The logger of rank 0 of a run in `tmp_path`; wandb `mode`, other logging.* fields."""
    from launcher.config import LoggingConfig, WandbConfig, WandbMode

    return MetricsLogger(
        str(tmp_path),
        enabled=True,
        total_steps=total,
        logging=LoggingConfig(wandb=WandbConfig(mode=WandbMode(mode)), **logging),
        config={},
        run_name=tmp_path.name,
        start_step=start,
    )


def test_tensorboard_events_hold_each_step_once_across_a_resume(tmp_path):
    """logging.tensorboard: the scalars of every step, read back with TensorBoard's own event
    reader; a resume from step 2 hides the steps 3-4 logged before the interruption."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def logger(start: int) -> MetricsLogger:
        return new_logger(tmp_path, 5, start, log_interval=100, tensorboard=True)

    first = logger(0)
    for step in range(1, 5):
        first.log(step, {**METRICS, "loss": 10.0 + step, "skipped": False})
    first.close()
    again = logger(2)  # resumed from the checkpoint of step 2
    for step in range(3, 6):
        again.log(step, {**METRICS, "loss": 20.0 + step})
    again.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert "loss" in events.Tags()["scalars"] and "skipped" not in events.Tags()["scalars"]
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0), (5, 25.0)]


def progress_lines(tmp_path, monkeypatch, capsys, tty: bool) -> list[str]:
    """What 200 steps (evaluated at 50 and 150) print, with the default log_interval."""
    import sys

    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
    log = new_logger(tmp_path, 200)
    for step in range(1, 201):
        evaluated = {"eval_loss": 1.0} if step in (50, 150) else {}
        log.log(step, {**METRICS, "loss": 2.0, **evaluated})
    log.close()
    return capsys.readouterr().out.split("\n")


def test_a_log_file_gets_a_line_per_log_interval_each_evaluation_and_the_last(
    tmp_path, monkeypatch, capsys
):
    """Piped to a file, a 200-step run writes 10 progress lines with the default interval,
    plus its evaluations; every line is whole (no carriage return)."""
    lines = [x for x in progress_lines(tmp_path, monkeypatch, capsys, tty=False) if x]
    steps = [int(x.split()[1].split("/")[0]) for x in lines]
    assert steps == [20, 40, 50, 60, 80, 100, 120, 140, 150, 160, 180, 200]
    assert not any("\r" in x for x in lines)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 200


def test_a_terminal_gets_one_line_rewritten_every_step(tmp_path, monkeypatch, capsys):
    """On a terminal every step rewrites the line (a carriage return, no newline); the lines
    of the interval, the evaluations and the last stay."""
    out = progress_lines(tmp_path, monkeypatch, capsys, tty=True)
    rewritten = [x for x in "\n".join(out).split("\r") if x]
    assert len(rewritten) == 200
    kept = [x.rsplit("\r", 1)[-1] for x in out if x]
    assert [int(x.split()[1].split("/")[0]) for x in kept] == [
        20, 40, 50, 60, 80, 100, 120, 140, 150, 160, 180, 200
    ]  # fmt: skip


def test_wandb_starts_beside_the_first_step_and_gets_every_row(tmp_path, monkeypatch):
    """wandb.init runs on a thread of its own: the logger returns at once, and the first row
    waits for wandb (a row in metrics.jsonl is one wandb holds too); every row reaches it.
    A rank whose launcher is gone finishes its wandb run on the watcher's thread while its
    training goes on: the next step's log waits for the rank's exit and writes no row (a
    resumed run sends wandb the steps after metrics.jsonl's last row: such a row would be a
    step wandb never gets, and a checkpoint after it would leave rows out)."""
    import threading

    import wandb
    from wandb_log import history

    up = threading.Event()
    real_init = wandb.init

    def slow_init(**kwargs):
        assert up.wait(60)  # held until the logger has returned
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", slow_init)
    log = new_logger(tmp_path, 6, mode="offline")
    assert log.wandb_run is None and log._wandb_start.is_alive()  # nothing was waited for
    assert not (tmp_path / "metrics.jsonl").read_text()
    up.set()
    for step in range(1, 5):
        log.log(step, {**METRICS, "loss": float(step)})
    orphaned = threading.Thread(target=log._orphaned)  # as failures.watch_parent runs it
    orphaned.start()
    orphaned.join()
    after = threading.Thread(target=log.log, args=(5, {**METRICS, "loss": 5.0}), daemon=True)
    after.start()
    after.join(1.0)
    assert after.is_alive()  # held until watch_parent's os._exit
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").open()] == [1, 2, 3, 4]
    # A rank's exit ends wandb's service, which writes out its run file; finish() alone does
    # not wait for that (the rows were missing from the file under load, in CI).
    wandb.teardown()
    assert log.wandb_where and "offline" in log.wandb_where
    files = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    sent = [(r["_step"], r["loss"]) for f in files for r in history(str(f)) if "loss" in r]
    assert sent == [(s, float(s)) for s in range(1, 5)]


def test_a_wandb_that_cannot_start_leaves_the_run_going(tmp_path, monkeypatch, capsys):
    import wandb

    def refused(**kwargs):
        raise wandb.errors.CommError("wandb.example: connection refused")

    monkeypatch.setattr(wandb, "init", refused)
    log = new_logger(tmp_path, 6, mode="offline")
    for step in range(1, 4):
        log.log(step, {**METRICS, "loss": float(step)})
    log.close()
    err = capsys.readouterr().err
    assert "warning: wandb could not start (CommError: wandb.example: connection refused)" in err
    assert "metrics.jsonl only" in err and log.wandb_run is None
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
