"""What checkpoint integrity costs a save: `make bench`'s checkpoint table.

A save with checksums against the same save without (write_sums switched off), taking turns
as the training steps do (launcher/bench/timing.py). The figure is the time a save blocks
training: the sums of one save are computed in the background after its write, before it is
published (each rank's sums.RANK.json), so each timed save starts once the previous one is
published, as it is by the next save of a run. Goal: at most 1.05. The background summing's own
time is reported beside it (it shares the CPU with training steps meanwhile). The checkpoints go to
/dev/shm where it has room: on a disk, write-back moves a save's time by +-20% at random.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from launcher.checkpoint import saver, store
from launcher.checkpoint.saver import ModelState
from launcher.cli import compose
from launcher.training.trainer import build_model


def state_of(overrides: list[str]) -> dict:
    """A one-process model and its AdamW state after one step: what a checkpoint holds."""

    cfg = compose(["hardware.devices_per_node=1", *overrides])
    model = build_model(cfg, 0)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": ModelState([model]), "optimizer": {"state": opt.state_dict()}}


def state_bytes(state: dict) -> int:
    tensors = [*state["model"].state_dict().values()]
    tensors += [v for s in state["optimizer"]["state"]["state"].values() for v in s.values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def save_cost(overrides: list[str], rounds: int = 6, progress=print) -> dict:
    """Seconds a save blocks, with and without checksums (fastest of `rounds` turns each),
    the checkpoint's size and the background summing's seconds."""

    state = state_of(overrides)
    # In memory where there is room (/dev/shm): a disk's write-back lands on the saves at
    # random, far more than what is measured here.
    shm = Path("/dev/shm")
    room = shm.is_dir() and shutil.disk_usage(shm).free > 8 * state_bytes(state)
    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=shm if room else None))
    times: dict[str, list[float]] = {"with checksums": [], "without": []}
    summing: list[float] = []

    def timed_sums(*args):
        start = time.perf_counter()
        sizes = store.write_sums(*args)
        summing.append(time.perf_counter() - start)
        return sizes

    def unsummed(directory, rank, names):
        return store.file_sizes(directory, names)

    try:
        for r in range(rounds):
            order = list(times) if r % 2 == 0 else list(reversed(times))
            for name in order:
                progress(f"checkpoint save: round {r + 1}/{rounds}, {name}")
                saver.write_sums = timed_sums if name == "with checksums" else unsummed
                ck = saver.Checkpointer(
                    root / name.replace(" ", "_"), 1, False, 0, lambda step: {"step": step}
                )
                start = time.perf_counter()
                ck.save(r + 1, state)
                times[name].append(time.perf_counter() - start)
                ck.wait()  # published (its sums written) before the next timed save
        size = sum(f.stat().st_size for f in (root / "with_checksums").rglob("*") if f.is_file())
    finally:
        saver.write_sums = store.write_sums
        shutil.rmtree(root, ignore_errors=True)
    best = {name: min(t) for name, t in times.items()}
    return {
        "bytes": size,
        "seconds": best,
        "ratio": best["with checksums"] / best["without"],
        "summing_seconds": min(summing),
    }
