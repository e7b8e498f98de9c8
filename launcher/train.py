"""`python -m launcher.train [overrides]`: plan, then train on the layout the config describes.

The plan runs first in every process and nothing starts unless it is valid and fits. Outside a
distributed environment a multi-device layout relaunches this command under torchrun with
`hardware.devices_per_node` processes; inside torchrun or a SLURM step it joins that group.
"""

from __future__ import annotations

import sys

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from launcher import launch
from launcher.checkpoint.store import checkpoint_dir, start_problems
from launcher.cli import fail, hydra_app, to_config
from launcher.failures import resume_mode
from launcher.plan import make_plan
from launcher.plan.report import print_plan, problems_message
from launcher.plan.rules import engine_problems


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


def task(dcfg: DictConfig) -> None:
    cfg = to_config(dcfg)
    plan = make_plan(cfg)
    if plan.layout is not None:  # the planner may accept what the engine cannot run yet
        plan.errors.extend(engine_problems(cfg, plan.layout))
    if launch.global_rank() == 0 and not launch.is_child():
        print_plan(plan)
    if not plan.ok:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            # A sweep skips the layouts that break a rule and goes on with the valid ones.
            overrides = " ".join(HydraConfig.get().overrides.task)
            print(f"rejected: {overrides}\n{problems_message(plan)}", file=sys.stderr)
            return
        fail(problems_message(plan))
    check_devices(cfg.hardware.device_type.value, cfg.hardware.devices_per_node)
    run_dir = HydraConfig.get().runtime.output_dir
    ck = cfg.checkpoint
    directory = checkpoint_dir(ck.dir, run_dir)
    resume = resume_mode(ck.resume.value)
    problems = start_problems(
        directory, resume, ck.initial_load_path, ck.initial_load_format.value, vars(cfg.model)
    )
    if problems:
        fail("; ".join(problems))
    if launch.in_distributed_env() and launch.world_size() != plan.world_size:
        fail(
            f"this process group has WORLD_SIZE={launch.world_size()} but the plan needs "
            f"world_size={plan.world_size} (hardware.nodes x hardware.devices_per_node)"
        )
    if not launch.in_distributed_env() and plan.world_size > 1:
        overrides = list(HydraConfig.get().overrides.task)
        status = launch.relaunch(
            cfg.hardware.nodes,
            cfg.hardware.devices_per_node,
            overrides,
            run_dir,
            max_restarts=cfg.train.max_restarts,
            stop_timeout_s=cfg.train.timeout_s,
        )
        if status:
            sys.exit(status)
        return  # a multirun goes on to its next job

    from launcher.engine import run  # torch.distributed only past this point

    run(cfg, plan, run_dir, dcfg)


main = hydra_app(task)

if __name__ == "__main__":
    main()
