"""Where metrics go: a progress line, DIR/metrics.jsonl, a wandb run and TensorBoard event
files (logging.tensorboard), from one rank."""

from __future__ import annotations

import contextlib
import json
import math
import netrc
import os
import sys
import threading
import time
import uuid
from pathlib import Path

from launcher.config import LoggingConfig, WandbMode
from launcher.runtime.failures import ON_ORPHANED


def wandb_mode(requested: WandbMode) -> str:
    """online only when an API key is configured (env or ~/.netrc), else offline."""
    if requested != WandbMode.online:
        return requested.value
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


def keep_steps_up_to(path: Path, step: int) -> int:
    """Drop the rows of metrics.jsonl after `step` (a resumed run logs those steps again) by
    truncating the file in place, never by swapping in a new one; a last line cut short (a
    full disk, a kill mid-write) is dropped with a warning. Returns the last step the file
    held before."""
    if not path.exists():
        return 0
    last, keep_bytes, offset = 0, None, 0
    with open(path, "rb") as f:
        for line in f:
            row = parse_row(line)
            if row is None and (not line.endswith(b"\n") or not f.peek(1)):
                print(
                    f"warning: {path}: dropping a last line cut short ({len(line)} bytes: "
                    f"{line[:60]!r}...)",
                    file=sys.stderr,
                )
                keep_bytes = offset if keep_bytes is None else keep_bytes
                break
            if row is not None:
                last = max(last, row["step"])
                if row["step"] > step and keep_bytes is None:
                    keep_bytes = offset
            offset += len(line)
    if keep_bytes is not None:
        os.truncate(path, keep_bytes)
    with open(path, "rb+") as f:  # a whole last row written without its newline keeps it
        if f.seek(0, os.SEEK_END) and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
            f.write(b"\n")
    return last


def parse_row(line: bytes) -> dict | None:
    """One metrics.jsonl row, or None for a line that is not one."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def json_safe(record: dict) -> dict:
    """Non-finite numbers as null: metrics.jsonl stays JSON (a bare NaN is not)."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }


def wandb_run_id(run_dir: Path) -> str:
    """One wandb run per run directory: a resumed or restarted run continues it."""
    path = run_dir / "wandb_run_id"
    if not path.exists():
        path.write_text(uuid.uuid4().hex[:8])
    return path.read_text().strip()


_hooks: list = []  # the thread excepthook quiet_writer_errors passes the rest to


def quiet_writer_errors(args) -> None:
    """TensorBoard's writer thread ends on a full or read-only disk with a traceback of its
    own; the error reaches the run at its next flush (MetricsLogger.failed), said in one line."""
    if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
        return
    _hooks[0](args)


class MetricsLogger:
    """Logs on the rank that holds the loss; every other rank gets a logger that does nothing.

    A run resumed at step k keeps metrics.jsonl's rows up to k and appends from k+1, so every
    step appears once. Its wandb run is the same one (same id), and steps it already received
    before the interruption are not sent again (a resumed run recomputes them bitwise equal).
    """

    def __init__(
        self,
        run_dir: str,
        enabled: bool,
        total_steps: int,
        logging: LoggingConfig,
        config: dict,
        run_name: str,
        start_step: int = 0,
        layout: str = "",
    ):
        self.enabled, self.total = enabled, total_steps
        self.interval = max(1, logging.log_interval)
        self.layout = layout  # every row says what it ran on (a resume may re-plan)
        self.last: dict | None = None  # the last row logged, and the last evaluation
        self.last_eval: float | None = None
        self.start, self.start_step = time.perf_counter(), start_step
        self.file = None
        self.wandb_run = None
        self._wandb_start: threading.Thread | None = None  # wandb.init, beside the first steps
        self.wandb_where: str | None = None  # the wandb run's page, or its local directory
        self.wandb_done = 0  # steps up to this one are in the wandb run already
        self.tensorboard = None
        self.failed: str | None = None  # what could not be written, and why (a full disk)
        # A row, and the wandb run's finish when the launcher is gone (_orphaned, on the
        # watcher's thread while this one trains on): one at a time, and no row after it.
        self._lock = threading.Lock()
        self._ended = False
        self._orphan = False  # ended by _orphaned: watch_parent is ending the process
        if not enabled:
            return
        path = Path(run_dir) / "metrics.jsonl"
        self.wandb_done = keep_steps_up_to(path, start_step)
        self.file = open(path, "a")  # noqa: SIM115 (closed in close())
        mode = wandb_mode(logging.wandb.mode)
        if mode != "disabled":
            # wandb starts beside the first step, not before it: its import and its service
            # process took seconds of a 2-rank toy run's start (docs/speed.md). The first row
            # waits for it (log), so that a row is in metrics.jsonl only once wandb holds it
            # too: a resumed run sends wandb the steps after metrics.jsonl's last row, and a
            # run killed before wandb was up must not have rows there that wandb never got.
            settings = dict(
                project=logging.wandb.project,
                entity=logging.wandb.entity,
                mode=mode,
                dir=run_dir,
                name=run_name,
                id=wandb_run_id(Path(run_dir)),
                resume="allow",
                config=config,
            )
            self._wandb_start = threading.Thread(
                target=self._start_wandb, args=(settings,), name="wandb-start", daemon=True
            )
            self._wandb_start.start()
        if logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            if threading.excepthook is not quiet_writer_errors:
                _hooks[:] = [threading.excepthook]
                threading.excepthook = quiet_writer_errors
            # Events of the steps after the one resumed from, written before an interruption,
            # are hidden: TensorBoard shows each step once, as metrics.jsonl does.
            self.tensorboard = SummaryWriter(
                str(Path(run_dir) / "tensorboard"), purge_step=start_step + 1
            )

    def _start_wandb(self, settings: dict) -> None:
        try:
            import wandb

            # Silent: its three lines a run (offline mode, where the files are, `wandb leet`)
            # become one of the run's last lines (wandb_line).
            quiet = wandb.Settings(console="off", quiet=True, silent=True)
            run = wandb.init(**settings, settings=quiet)
        except Exception as e:  # the run goes on: metrics.jsonl holds every row
            print(
                f"warning: wandb could not start ({type(e).__name__}: {e}); this run's metrics "
                "go to metrics.jsonl only (logging.wandb.mode=disabled: no wandb at all)",
                file=sys.stderr,
                flush=True,
            )
            return
        mode = settings["mode"]
        self.wandb_where = (
            run.url
            if mode == "online"
            else f"{Path(run.dir).parent} ({mode}: `wandb sync` it to upload)"
        )
        self.wandb_run = run
        # A rank whose launcher dies exits at once (failures.watch_parent): the steps wandb
        # holds in its queue go to its files first.
        ON_ORPHANED.append(self._orphaned)

    def _wandb_started(self) -> None:
        if self._wandb_start is not None:
            self._wandb_start.join()
            self._wandb_start = None

    def log(self, step: int, metrics: dict) -> None:
        """One JSON object per step; a progress line every log_interval steps, at each evaluation
        and at the end (on a terminal also a line rewritten every step)."""
        if not self.enabled:
            return
        self._wandb_started()  # the first row: wandb is up (or said it cannot start)
        record = {"step": step, **metrics, "layout": self.layout}
        self.last = record
        if metrics.get("eval_loss") is not None:
            self.last_eval = metrics["eval_loss"]
        try:
            self._write(step, record, metrics)
        except OSError as e:  # the trainer stops the run after this step (its `failed`)
            self.failed = f"{e.filename or self.file.name} could not be written: {e.strerror or e}"
        stays = step % self.interval == 0 or step == self.total or "eval_loss" in metrics
        if stays or sys.stdout.isatty():
            self._progress(step, metrics, stays)

    def _write(self, step: int, record: dict, metrics: dict) -> None:
        with self._lock:
            ended, orphan = self._ended, self._orphan
            if not ended:
                self._write_row(step, record, metrics)
        if orphan:
            # The launcher is gone and failures.watch_parent is ending this process: no row
            # that wandb would not hold, and no step or checkpoint after the last row.
            threading.Event().wait()

    def _write_row(self, step: int, record: dict, metrics: dict) -> None:
        self.file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self.file.flush()
        if self.wandb_run is not None and step > self.wandb_done:
            self.wandb_run.log(metrics, step=step)
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()

    def skipped(self, step: int, in_a_row: int, allowed: int) -> None:
        """Say that a non-finite step was not applied (train.max_skipped_steps allows it)."""
        if self.enabled:
            print(
                f"step {step} skipped: its loss or gradient norm is not finite ({in_a_row} in a "
                f"row of train.max_skipped_steps={allowed})",
                file=sys.stderr,
                flush=True,
            )

    def _progress(self, step: int, m: dict, stays: bool) -> None:
        elapsed = time.perf_counter() - self.start
        done = step - self.start_step
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        ahead = f"mtp_loss {m['mtp_loss']:.4f}  " if "mtp_loss" in m else ""
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total}  loss {m['loss']:.4f}  {ahead}"
            f"lr {m['lr']:.2e}  grad_norm {m['grad_norm']:.3f}  "
            f"tok/s/dev {m['tokens_per_s']:,.0f}  mfu {m['mfu'] * 100:.1f}%  "
            f"eta {eta:,.0f}s"
        )
        if "eval_loss" in m:
            line += f"  eval_loss {m['eval_loss']:.4f}"
        line += "".join(f"  {k} {v:.4f}" for k, v in m.items() if k.startswith("eval/"))
        # On a terminal the line rewrites itself every step, and stays every log_interval; in a
        # log file only the lines that stay are printed.
        if not stays:
            print("\r" + line, end="", flush=True)
        else:
            print(("\r" if sys.stdout.isatty() else "") + line, flush=True)

    def _orphaned(self) -> None:
        self._finish_wandb(exit_code=1, orphan=True)

    def _finish_wandb(self, exit_code: int, orphan: bool = False) -> None:
        """The wandb run finished once, after the last row, and no row after it: a row in
        metrics.jsonl is one wandb holds (a resumed run sends only the steps after the file's)."""
        with self._lock:
            self._ended, self._orphan = True, self._orphan or orphan
            run, self.wandb_run = self.wandb_run, None
            if run is not None:
                run.finish(exit_code=exit_code)

    def close(self, ok: bool = True) -> None:
        self._wandb_started()  # stopped before its first row: wandb ends, not starting
        if self._orphaned in ON_ORPHANED:
            ON_ORPHANED.remove(self._orphaned)
        if self.file is not None:
            with contextlib.suppress(OSError):  # said already (failed), or said now by the trainer
                self.file.close()
        self._finish_wandb(exit_code=0 if ok else 1)
        if self.tensorboard is not None:
            with contextlib.suppress(OSError):  # as the file's
                self.tensorboard.close()
