"""Time to first step and memory at start by rank count: `make bench`'s start table.

A llama-shaped model of about 1 GB in fp32 (dim 2048, 5 layers of SwiGLU 5632) is trained for
one step by `launcher.train` itself on 1, 2, 4 and 8 CPU processes (FSDP over all of them: each
holds 1/N of the model). The run's first step records (launcher/training/trainer.py, `started`) the
seconds from each process's start to its first step and, of them, the model's build (the
slowest rank of each), and each rank's peak resident memory before it; the whole command's wall
time is measured beside them. Every rank builds on the meta device and materialises only its
share, so the memory at start and the build's time fall with the rank count (1/N of the model,
plus what every process holds: torch, the process group, the data). The time to the first step
does not fall here: N processes share this machine's 2 cores, and each one's start (Python,
torch's import, the process group: about 5 s of CPU) is paid N times over.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launcher import models
from launcher.cli import compose

MODEL = [
    "model=llama3_debug",
    "model.dim=2048",
    "model.n_heads=16",
    "model.n_kv_heads=8",
    "model.ffn_dim=5632",
    "model.n_layers=5",
]
RUN = [
    "train.steps=1",
    "train.seq_len=32",
    "train.micro_batch_size=1",
    "train.eval_interval=0",
    "precision=fp32",
    "logging.wandb.mode=disabled",
]
RANKS = (1, 2, 4, 8)


def model_bytes() -> int:
    """The model's fp32 size (built on the meta device)."""
    import torch

    cfg = compose(MODEL)
    with torch.device("meta"):
        model = models.build(cfg.model.family, vars(cfg.model))
    return 4 * sum(p.numel() for p in model.parameters())


def start_run(ranks: int, directory: Path) -> dict:
    """One single-step run on `ranks` processes: its first step's start figures."""
    run_dir = directory / f"ranks{ranks}"
    layout = [f"hardware.devices_per_node={ranks}", f"parallel.dp_shard={ranks}"]
    batch = [f"train.global_batch_size={ranks}"]
    began = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "launcher.train", *MODEL, *RUN, *layout, *batch,
         f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    wall = time.perf_counter() - began
    if result.returncode != 0:
        raise RuntimeError(f"{ranks} rank(s) failed:\n{result.stderr[-2000:]}")
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return {
        "ranks": ranks,
        "start_s": first["start_s"],
        "build_s": first["build_s"],
        "start_peak_gib": first["start_peak_gib"],
        "start_peak_gib_least": first["start_peak_gib_least"],
        "step_s": first["step_time_s"],
        "wall_s": wall,
    }


def start_by_ranks(ranks=RANKS, progress=print) -> dict:
    """The start of the same model on each rank count."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for n in ranks:
            progress(f"start on {n} rank(s)")
            rows.append(start_run(n, Path(tmp)))
    return {"model_gib": model_bytes() / 2**30, "runs": rows}
