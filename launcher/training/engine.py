"""Where a training process starts: join the process group, train, leave together.

Receives a validated Plan. The trainer (launcher/training/trainer.py) builds the model identically
on every rank, applies the layout and trains; a stop signal ends the process with
failures.EXIT_STOPPED once a checkpoint of the current step is complete; an end the ranks agree on
(a non-finite step, a damaged checkpoint given by path) with its own status (RunEnded).
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

from launcher.plan import Plan
from launcher.runtime import distributed, launch
from launcher.runtime.failures import (
    EXIT_FILE,
    EXIT_STOPPED,
    RESERVED,
    STOPPED_FILE,
    RunEnded,
    StopRequest,
    ended,
    peer_gone,
    reserve_record,
    stopped_message,
    watch_parent,
)
from launcher.training.trainer import Stopped, Trainer


@record
def run(cfg, plan: Plan, run_dir: str, dcfg: DictConfig) -> None:
    """Train the planned layout; every rank calls this."""
    # From the first moment: a stop signal during start-up stops after the first step.
    stop = StopRequest(cfg.train.timeout_s)
    if launch.in_distributed_env():
        watch_parent()
    d = distributed.init(cfg.hardware.device_type.value, plan.layout, cfg.train.timeout_s)
    if d.rank == 0 and launch.is_child():
        # A stop of an earlier round, which this round goes on from (torchrun stops the ranks
        # with SIGTERM to regroup when a node joins): the launcher must not report it.
        for record in (STOPPED_FILE, EXIT_FILE):
            Path(run_dir, record).unlink(missing_ok=True)
        reserve_record(run_dir)
    try:
        Trainer(cfg, plan, run_dir, dcfg, d).train(stop)
    except Stopped as e:
        distributed.shutdown()
        if launch.is_child():
            # The relaunching process reports the stop and exits EXIT_STOPPED; a non-zero
            # status here would make torchrun restart the ranks or report a failure.
            sys.exit(0)
        if d.rank == 0:
            print(stopped_message(e.signum, e.step, e.checkpoint), file=sys.stderr, flush=True)
        sys.exit(EXIT_STOPPED)
    except RunEnded as e:  # every rank agreed: a non-finite step, no usable checkpoint
        distributed.shutdown()
        recorded = d.rank != 0 or ended(e, run_dir, report=not launch.is_child())
        # As above, the launcher reports it, if rank 0 could record it (else said already).
        sys.exit(0 if launch.is_child() and recorded else e.status)
    except RuntimeError as e:
        if (line := peer_gone(e)) is None:
            raise
        print(line, file=sys.stderr, flush=True)  # one line, not a traceback per rank
        sys.exit(1)
    # Only after a clean finish: the model (DDP's reducer, FSDP's hooks) is gone by now, and
    # every rank leaves together. After a crash the launcher ends the other ranks instead.
    distributed.shutdown()
    if d.rank == 0:
        Path(run_dir, RESERVED).unlink(missing_ok=True)  # nothing to record
