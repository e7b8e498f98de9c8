"""`python -m launcher.train [overrides]`: plan, then train on the layout the config describes.

The plan runs first in every process and nothing starts unless it is valid and fits. Outside a
distributed environment a multi-device layout relaunches this command under torchrun with
`hardware.devices_per_node` processes; inside torchrun or a SLURM step it joins that group.
"""

# ruff: noqa: E402 (a stop signal is held from the first moment: the imports below take seconds)
from __future__ import annotations

import copy
import importlib.util
import os
import pickle
import sys
from pathlib import Path

from launcher.runtime import early
from launcher.runtime.failures import hold_stops, resume_mode, stop_before_start

if __name__ == "__main__":
    hold_stops()
    early.start(sys.argv[1:])  # the agent of a local relaunch imports beside this process

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, read_write

from launcher import configs
from launcher.checkpoint.store import (
    finished,
    newest_complete,
    nothing_left,
    run_checkpoint_dir,
    start_problems,
)
from launcher.cli import CONF_DIR, fail, hydra_app, quick_exit, to_config
from launcher.data.batches import id_problem
from launcher.data.sources import token_file_paths
from launcher.plan import auto, engine_plan
from launcher.plan.report import plan_json, print_plan, problems_message
from launcher.plan.search import candidate_overrides, with_overrides
from launcher.runtime import launch, rundir, sweep_files
from launcher.runtime.imports import uncollected


def check_devices(device_type: str, devices_per_node: int) -> None:
    """Refuse a CUDA layout this machine cannot run, before any process group exists."""
    if device_type != "cuda":
        return
    import torch

    found = torch.cuda.device_count()
    if found < devices_per_node:
        fail(
            f"hardware.device_type=cuda with devices_per_node={devices_per_node} but this "
            f"machine has {found} CUDA device(s); use hardware=cpu or fewer devices"
        )


def check_installed(cfg) -> None:
    """Refuse a run whose optional dependency this machine lacks (pyproject.toml's extras),
    before any process starts; launcher.plan does not ask: it plans for other machines."""
    fp8 = cfg.precision.fp8.value
    if fp8 != "none" and importlib.util.find_spec("torchao") is None:
        fail(
            f"precision.fp8={fp8} needs torchao, which is not installed here: "
            "pip install 'llm-launcher[fp8]' (or torchao)"
        )


def reject(problems: str, hc, run_dir: Path, first: bool) -> None:
    """A layout that breaks a rule: exit 2, or in a sweep skip it (the summary names it) and
    go on with the valid ones."""
    if hc.mode != RunMode.MULTIRUN:
        fail(problems)
    if first:
        print(f"rejected: {' '.join(hc.overrides.task)}\n{problems}", file=sys.stderr)
        sweep_files.write_json(run_dir / sweep_files.REJECTED, {"problems": problems})


def checkpoint_problems(cfg, run_dir: str) -> list[str]:
    """What keeps this run from starting with the checkpoints it has or is given (the run
    directory's, checkpoint.initial_load_path)."""
    ck = cfg.checkpoint
    return start_problems(
        run_checkpoint_dir(ck.dir, run_dir),
        resume_mode(ck.resume.value),
        ck.initial_load_path,
        ck.initial_load_format.value,
        vars(cfg.model),
    )


def task(dcfg: DictConfig) -> None:
    launch.slurm_env()  # a SLURM task learns its rank before anything asks for it
    given = dcfg
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    if hc.mode == RunMode.RUN and not str(hc.run.dir).strip():
        fail(
            "hydra.run.dir is empty: a run needs a directory of its own (leave it unset for "
            "outputs/<model>-<hash>)"
        )
    first = launch.global_rank() == 0 and not launch.is_child()
    if first and hc.mode == RunMode.MULTIRUN:  # the sweep's summary reads these (sweep.py)
        sweep_files.write_json(run_dir / sweep_files.OVERRIDES, list(hc.overrides.task))
    cfg = to_config(dcfg)
    hw = cfg.hardware
    if launch.in_distributed_env() or hw.nodes * hw.devices_per_node == 1:
        early.end()  # no ranks of this process's to start: its agent's CPU back at once
    if cfg.parallel.auto:
        if cfg.plan.candidate >= 0:
            fail("parallel.auto=true chooses the layout itself: drop plan.candidate")
        dcfg, problem = auto.recompose(
            cfg,
            list(hc.overrides.task),
            launch.actual_world(),
            lambda overrides: compose(config_name="config", overrides=overrides),
        )
        if problem:
            return reject(problem, hc, run_dir, first)
        cfg = to_config(dcfg)
        if first or (launch.is_child() and launch.global_rank() == 0):
            previous = newest_complete(run_checkpoint_dir(cfg.checkpoint.dir, run_dir))
            world = cfg.hardware.nodes * cfg.hardware.devices_per_node
            line = auto.choice_line(engine_plan(cfg).layout, world, previous and previous.meta)
            # A rank prints the choice when it is not the one its launcher printed: the
            # group a torchrun restart or an elastic round formed re-planned.
            if os.environ.get(launch.CHOICE_ENV) != line:
                print(line, flush=True)
            os.environ[launch.CHOICE_ENV] = line
    elif cfg.plan.candidate >= 0:
        extra, problem = candidate_overrides(cfg)
        if problem:
            return reject(problem, hc, run_dir, first)
        dcfg = compose(config_name="config", overrides=with_overrides(hc.overrides.task, extra))
        cfg = to_config(dcfg)
        if first:
            print(f"plan.candidate={cfg.plan.candidate}: {' '.join(extra)}", flush=True)
    plan = engine_plan(cfg)
    plan.config_files = configs.user_files(HydraConfig.get().runtime.choices)
    if not plan.ok:  # the problems name every value; launcher.plan shows the estimate too
        return reject(problems_message(plan), hc, run_dir, first)
    if first:
        print_plan(plan)
    check_devices(cfg.hardware.device_type.value, cfg.hardware.devices_per_node)
    check_installed(cfg)
    problems = checkpoint_problems(cfg, str(run_dir))
    if problems:
        fail("; ".join(problems))
    if first:  # the process in charge of the run: one run per directory, and it can write
        if problem := next(filter(None, map(id_problem, token_file_paths(cfg.data))), None):
            fail(problem)
        try:
            rundir.writable(run_dir, "hydra.run.dir")
            rundir.regular_files(run_dir)
            rundir.writable(run_checkpoint_dir(cfg.checkpoint.dir, run_dir), "checkpoint.dir")
            if cfg.logging.tensorboard:
                rundir.writable(run_dir / "tensorboard", "logging.tensorboard's directory")
            rundir.lock(run_dir, cfg.launch.rendezvous)
        except rundir.DirectoryProblem as e:
            fail(str(e))
        # Once the directory is this run's (a second run there is refused above).
        record = {
            **plan_json(plan),
            "train_steps": cfg.train.steps,
            "model": cfg.model.name,
            "overrides": list(hc.overrides.task),  # what launcher.runs tells runs apart by
        }
        # Read by the sweep summary and by launcher.runs.
        sweep_files.write_json(run_dir / sweep_files.PLAN, record)
    if first:
        print(f"run directory: {run_dir}", flush=True)
    if first and cfg.launch.rendezvous and plan.world_size == 1:
        print(
            f"warning: launch.rendezvous={cfg.launch.rendezvous} is not used: this run is one "
            "process (hardware.nodes x devices_per_node = 1), which meets no other",
            file=sys.stderr,
            flush=True,
        )
    if launch.in_distributed_env() and launch.world_size() != plan.world_size:
        fail(
            f"this process group has WORLD_SIZE={launch.world_size()} but the plan needs "
            f"world_size={plan.world_size} (hardware.nodes x hardware.devices_per_node)"
        )
    if first and not launch.in_distributed_env():  # answered before any rank starts
        ck = cfg.checkpoint
        directory = run_checkpoint_dir(ck.dir, run_dir)
        if done := finished(directory, resume_mode(ck.resume.value), cfg.train.steps):
            print(nothing_left(done.step, cfg.train.steps, run_dir), flush=True)
            return
    if not launch.in_distributed_env() and plan.world_size > 1:
        stop_before_start()  # until relaunch forwards stop signals to the ranks it starts
        overrides = list(hc.overrides.task)
        status = launch.relaunch(cfg, overrides, str(run_dir), rank_config(given))
        if status:
            sys.exit(status)
        return  # a multirun goes on to its next job

    with uncollected():  # torch.distributed only past this point
        from launcher.training.engine import run

    run(cfg, plan, str(run_dir), dcfg)


def rank_config(dcfg: DictConfig) -> bytes:
    """What the ranks of a relaunch start from: this process's composition (the job's config,
    and Hydra's as a run of its own in the run directory), so that a rank forked by
    launcher.agent does not compose the same config again (Hydra composes twice,
    about a CPU-second)."""
    hydra_node = copy.deepcopy(HydraConfig.get())
    with read_write(hydra_node):
        hydra_node.mode = RunMode.RUN
        hydra_node.output_subdir = None
        hydra_node.run.dir = hydra_node.runtime.output_dir
    return pickle.dumps((dcfg, hydra_node))


def rank_task(composed: bytes) -> None:
    """A rank's task from rank_config's composition, as Hydra would run it."""
    dcfg, hydra_node = pickle.loads(composed)
    initialize_config_dir(config_dir=CONF_DIR, version_base=None)  # compose(): auto, candidate
    HydraConfig.instance().set_config(OmegaConf.create({"hydra": hydra_node}))
    task(dcfg)


main = hydra_app(task)

if __name__ == "__main__":
    main()
    quick_exit(0)  # a run that ended well (or had nothing to do): no module teardown
