"""A job of tests/group.py: the initial parameters of each layout, gathered.

`job(OUT, CASE, ...)`: for each case (space-separated overrides), the engine's own Trainer is
built over this group (the meta-device build, each rank materialising and initialising only its
share) and its parameters, gathered whole from every shard and pipeline stage before any step,
are written by rank 0 to OUT/CASE_INDEX.pt.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from jobs import trainer_of

from launcher.training.trainer import save_full_state_dict


def job(out: Path, *cases: str) -> None:
    for i, case in enumerate(cases):
        _, d, trainer = trainer_of(out / str(i), case.split())
        save_full_state_dict(trainer.parts, d, out / f"{i}.pt")
        dist.barrier()
