"""Saving and loading the trainer's state with torch.distributed.checkpoint (DCP).

Every rank writes its own shards (FSDP and TP shards by their owner, replicated tensors once);
loading reads whatever each rank needs under the current layout, so a checkpoint saved on one
layout resumes on another. The state is a dict of Stateful objects: `model` (parameter names
as in the plain model), `optimizer` (launcher.training.optim.Optimizers, layout-free keys), `train`
(step and samples consumed), and `rng.<rank>` (each rank's generators, restored only on the
layout they were saved under).

torch.distributed.checkpoint is imported where a state dict is taken, saved or loaded: a run
reaches its first step without it.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from launcher.checkpoint import reader
from launcher.checkpoint.store import (
    PARTIAL,
    Entry,
    newest_complete,
    prune,
    publish,
    rank_files,
    step_dir,
    write_meta,
    write_sums,
)
from launcher.runtime.failures import RunEnded
from launcher.runtime.rundir import write_failure

# One process (no process group) is a supported way to save and load, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class ModelState:
    """All model parts (pipeline stages) as one state dict keyed by the plain model's names."""

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {k: v for part in self.parts for k, v in get_model_state_dict(part).items()}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            set_model_state_dict,
        )

        for part in self.parts:
            mine = get_model_state_dict(part)
            set_model_state_dict(part, {k: state[k] for k in mine})


class TrainState:
    """Where training stands: optimizer steps taken and training windows consumed (the data
    position; equal to step x global batch unless the batch size changed on a resume)."""

    def __init__(self) -> None:
        self.step, self.samples = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples = int(state["step"]), int(state["samples"])


class RngState:
    """This rank's random generators (dropout)."""

    def state_dict(self) -> dict:
        out = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state()
        return out

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


class SaveFailed(RunEnded):
    """A checkpoint could not be written; the run stops with the previous one intact."""

    def __init__(self, step: int, why: str, previous: str | None):
        kept = (
            f"the previous checkpoint, {previous}, is intact"
            if previous
            else "no earlier checkpoint"
        )
        super().__init__(
            1,
            f"error: the checkpoint of step {step} could not be written: {why}; its partial "
            f"directory was removed and {kept}. Free space (or make checkpoint.dir writable) "
            "and run the same command again to resume",
        )


class Checkpointer:
    """Saves into DIR/step_N.partial; then each rank sums the files it wrote, and global rank 0
    writes meta.json and renames the directory to DIR/step_N once every rank's shards and sums
    are there: complete and provable, or invisible. Older checkpoints are pruned only after.

    The write blocks training (with async_save, only DCP's copy of the state to memory: the
    write goes on in a background thread); the sums and the publish always run in the
    background, over a gloo group of their own (training collectives on the default group must
    not interleave with them: tests/checkpoint/test_resume.py's async save row). The next save,
    a stop and the end of the run wait for them.
    """

    def __init__(
        self,
        directory: str | Path,
        keep: int,
        async_save: bool,
        rank: int,
        meta: Callable[[int], dict],
    ):
        self.directory, self.keep, self.async_save = Path(directory), keep, async_save
        self.rank, self.meta = rank, meta
        self.pending: tuple[Future | None, threading.Event] | None = None
        self.refused: SaveFailed | None = None  # a save written but not published (_finish)
        self.error: Exception | None = None  # what stopped _finish (not a traceback of its own)
        self.group = None
        if dist.is_initialized():
            self.group = dist.new_group(backend="gloo")

    def save(self, step: int, state: dict, wait: bool = False) -> None:
        """Save `state` as step `step`; with wait=True return only once it is published."""
        import torch.distributed.checkpoint as dcp

        self.wait()  # one save in flight at a time
        final = step_dir(self.directory, step)
        partial = final.with_name(final.name + PARTIAL)
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # shards of a save that never finished
        if dist.is_initialized():
            dist.barrier()
        # meta.json is rank 0's to write (_finish); the other ranks need not build it.
        meta = {}
        if self.rank == 0:
            meta = {**self.meta(step), "saved_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        done = threading.Event()
        self.pending_step, self.pending_partial = step, partial

        def finish(f: Future | None) -> None:
            try:
                self._finish(f, step, partial, final, meta)
            except Exception as e:  # a peer gone mid-gather: wait() raises it on the main thread
                self.error = e
            finally:
                done.set()

        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group)
            # Future.result() may return before callbacks ran: wait() waits for `done` too.
            future.add_done_callback(finish)
            self.pending = (future, done)
        else:
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                dcp.save(state, checkpoint_id=str(partial), no_dist=not dist.is_initialized())
            except (CheckpointException, OSError) as e:  # DCP raises it on every rank
                raise self.failed(step, partial, e) from None
            threading.Thread(target=finish, args=(None,), name="checkpoint", daemon=True).start()
            self.pending = (None, done)
        if wait:  # published (a run's last save, a stop)
            self.wait()

    def failed(self, step: int, partial: Path, error: BaseException | str) -> SaveFailed:
        """A save that could not be written (a full disk, a read-only mount), or why: its
        partial directory removed, the previous checkpoint named. Why is read first: with no
        OS error inside DCP's (torch.save says "unexpected pos" on a full disk), the disk
        tells, and the partial's removal would free it."""
        why = error if isinstance(error, str) else write_failure(error, self.directory)
        why = why or str(error).splitlines()[0][:300]
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        newest = newest_complete(self.directory)
        return SaveFailed(step, why, str(newest.path) if newest else None)

    def _finish(self, future: Future | None, step: int, partial: Path, final: Path, meta: dict):
        """On every rank once its write returned; on rank 0 DCP has by then written .metadata,
        which it does only after gathering every rank's write results. Each rank sums its
        files into the partial directory; rank 0 gathers the sizes of every rank's files into
        meta.json (a collective on the save's own group), publishes and prunes."""
        failed = future is not None and future.exception() is not None  # wait() reports it
        # Each rank's file sizes, or why it could not write its sums (None: its save failed).
        mine = None
        if not failed:
            try:
                mine = write_sums(partial, self.rank, rank_files(partial, self.rank))
            except OSError as e:
                mine = f"{e.strerror or e} ({e.filename})"
        gathered = [mine]
        if dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine, group=self.group)
        if all(isinstance(g, dict) for g in gathered):
            if self.rank == 0:
                files = {name: s for g in gathered for name, s in g.items()}
                try:
                    write_meta(partial, {**meta, "files": files})
                    publish(partial, final)
                except OSError as e:  # a disk that filled, a mount gone read-only
                    self.refused = self.failed(step, partial, e)
                    return
                try:
                    prune(self.directory, self.keep)
                except OSError as e:  # the new checkpoint stands; older ones stay
                    print(f"warning: older checkpoints were not pruned: {e}", file=sys.stderr)
        elif why := next((g for g in gathered if isinstance(g, str)), None):
            self.refused = self.failed(step, partial, why)  # raised by wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is published, or raise why it was not."""
        if self.pending is not None:
            future, done = self.pending
            self.pending = None
            if future is not None:
                try:
                    future.result()
                except BaseException as e:  # DCP's CheckpointException is a BaseException
                    if isinstance(e, (KeyboardInterrupt, SystemExit)):
                        raise
                    done.wait()
                    raise self.failed(self.pending_step, self.pending_partial, e) from None
            done.wait()
        if (error := self.error) is not None:
            self.error = None  # the engine reports a peer gone in one line (engine.py)
            raise error
        if (refused := self.refused) is not None:
            self.refused = None  # a rank had no room left for its sums: as a failed save
            raise refused

    def load(self, entry: Entry, state: dict) -> None:
        """Fill `state` (a subset of what was saved is fine) from a complete checkpoint,
        running none of its code (reader.py)."""

        reader.load(state, entry.path, no_dist=not dist.is_initialized())
