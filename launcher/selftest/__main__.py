"""`python -m launcher.selftest [overrides]`: prove the engine's collectives on this machine's
devices before a long run.

Each correctness row (launcher/selftest/rows.py: every axis, and compositions of them, that fit
the world) trains a tiny model for a few steps on the real backend (NCCL on GPUs, gloo on CPU)
and is compared, step by step and down to the final parameters, with one process training the
same model on the same batch. Prints a table, writes RUN_DIR/selftest.md and selftest.json,
and exits 0 when every row passes, 1 when one fails.

On one node it starts its ranks under torchrun itself (hardware.devices_per_node of them);
under torchrun or SLURM (every node running this command) it joins that group.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from enum import Enum
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from launcher.cli import fail, hydra_app, quick_exit, to_config
from launcher.layout import AXES
from launcher.plan.ranges import range_problems
from launcher.runtime import launch
from launcher.runtime.imports import uncollected
from launcher.selftest import preset
from launcher.selftest.report import REPORT_JSON, write_report
from launcher.selftest.rows import recipe_row, rows_for

RUN_DIR = "outputs/selftest/${run_id:}"
OUTPUTS = ("rows", "speed", REPORT_JSON)  # what a self-test leaves in its directory


def hardware_overrides(hw) -> list[str]:
    """The composed hardware (the command line's, a recipe's, the user's preset), field by
    field, which every row and reference take; the rest of the run's settings (model,
    layout, batch) are the rows' own."""
    out = []
    for f in dataclasses.fields(hw):
        value = getattr(hw, f.name)
        value = value.value if isinstance(value, Enum) else value
        out.append(
            f"hardware.{f.name}={launch.hydra_quoted(value) if isinstance(value, str) else value}"
        )
    return out


def task(dcfg: DictConfig) -> None:
    launch.slurm_env()
    cfg = to_config(dcfg)
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    if problems := range_problems(cfg):
        fail("; ".join(message for _, message in problems))
    hw = cfg.hardware
    world = hw.nodes * hw.devices_per_node
    if unknown := [a for a in cfg.selftest.axes if a not in AXES]:
        fail(f"selftest.axes: {unknown[0]} is not an axis; the axes are {', '.join(AXES)}")
    rows = rows_for(world)
    recipe = hc.runtime.choices.get("recipe")
    if recipe and (row := recipe_row(recipe, cfg, dict(hc.runtime.choices), world)):
        rows.append(row)
    if cfg.selftest.axes:
        rows = [r for r in rows if set(r.axes) & set(cfg.selftest.axes)]
    if not rows and (world > 1 or cfg.selftest.axes):
        fail(
            f"selftest.axes=[{','.join(cfg.selftest.axes)}]: no row on {world} ranks "
            f"exercises them (the rows: {', '.join(r.name for r in rows_for(world))})"
        )
    try:
        if cfg.selftest.fabric:
            preset.target(cfg, run_dir)  # its name and place, before any rank starts
    except preset.PresetProblem as e:
        fail(str(e))
    overrides = list(hc.overrides.task)
    if not launch.in_distributed_env() and any((run_dir / d).exists() for d in OUTPUTS):
        fail(f"{run_dir} holds a self-test already: give hydra.run.dir another directory")
    if world == 1:
        print(
            f"self-test on one {hw.device_type.value} rank: no layout to compare with one "
            f"process, so the speed row alone; directory {run_dir}",
            flush=True,
        )
    if not launch.in_distributed_env() and world > 1:
        if hw.nodes > 1:
            given = any(o.startswith("hardware.nodes=") for o in overrides)
            origin = f" (recipe={recipe}'s)" if recipe and not given else ""
            fail(
                f"hardware.nodes={hw.nodes}{origin}: "
                "a multi-node self-test runs under SLURM or torchrun, this command on every "
                "node; hardware.nodes=1 tests this node alone"
            )
        print(
            f"self-test: {len(rows)} rows on {world} {hw.device_type.value} rank(s), each "
            f"against one process; directory {run_dir}",
            flush=True,
        )
        env = dict(os.environ, **{launch.CHILD_ENV: "1"})
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        status = subprocess.call(
            [*torchrun, f"--nproc-per-node={hw.devices_per_node}", "-m", "launcher.selftest",
             *overrides, f"hydra.run.dir={launch.hydra_quoted(str(run_dir))}"],
            env=env,
        )  # fmt: skip
        report = run_dir / REPORT_JSON
        if status == 0 and report.exists():
            status = 1 if json.loads(report.read_text())["failed"] else 0
        elif status == 0:
            status = 1  # the ranks ended without a report: their output says why
        quick_exit(status)
    if launch.in_distributed_env() and launch.world_size() != world:
        fail(
            f"this process group has WORLD_SIZE={launch.world_size()} but hardware.nodes x "
            f"hardware.devices_per_node = {world}"
        )
    with uncollected():  # torch and the engine only in the ranks: the launcher starts them
        import torch.distributed as dist

        from launcher.selftest.run import measure_fabric, measure_speed, run
    started = time.monotonic()
    hardware = hardware_overrides(hw)
    results = run(cfg, rows, hardware, run_dir, started)
    timings = measure_fabric(cfg, started)
    timed = measure_speed(cfg, overrides, run_dir, started)
    failed = 0
    if launch.global_rank() == 0:
        failed = write_report(results, timings, timed, cfg, run_dir)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # Started by this command (launch.CHILD_ENV), the ranks end well and the launcher reads
    # the report; under the user's torchrun or srun, rank 0's status is the verdict.
    quick_exit(1 if failed and not launch.is_child() else 0)


def main() -> None:
    given = {a.lstrip("+~").split("=", 1)[0] for a in sys.argv[1:]}
    # No .hydra/ record: nothing is written before the directory is checked (the report
    # holds what ran); the help is the self-test's own.
    own = (("hydra.run.dir", RUN_DIR), ("hydra.output_subdir", "null"), ("hydra/help", "selftest"))
    for key, value in own:
        if key not in given:
            sys.argv.append(f"{key}={value}")
    hydra_app(task)()
    quick_exit(0)


if __name__ == "__main__":
    main()
