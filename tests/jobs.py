"""Jobs for the process groups of tests/group.py: the engine's training run inside a group, and
a measurement on a device mesh.

`train` is what `launcher.train` does once its process group exists: plan the composed config
(refused layouts fail the job with the planner's message), build the layout's meshes over the
group and train with the engine's own Trainer, which writes metrics.jsonl, checkpoints and
final_model.pt into the job's directory exactly as a CLI run writes its run directory.

`on_mesh` builds a device mesh over the group and writes what a measuring function returns on
each rank to OUT/RANK.json (`group.per_rank` reads them). A measurement that wraps engine or torch
functions does it with `patched`, so the jobs after it in the same group see the originals.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
from pathlib import Path

from group import Job

from launcher.runtime.failures import NoStops


def last_value(overrides, key: str, default: str) -> str:
    """What the last `key=` among overrides sets (later overrides win), else `default`."""
    found = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    return found[-1] if found else default


def devices(overrides: list[str] | tuple[str, ...]) -> int:
    """Processes a layout asks for: its last hardware.devices_per_node (cpu's default 2)."""
    return int(last_value(overrides, "hardware.devices_per_node", "2"))


def train_job(overrides: list[str], label: str = "", nproc: int = 0) -> Job:
    """The job that trains these overrides on as many processes as they ask for (`nproc` where
    they ask through a recipe)."""
    return Job("jobs:train", nproc or devices(overrides), tuple(overrides), label)


def composed(overrides) -> object:
    """launcher.cli.compose(overrides), composed by the group's rank 0 and sent to the others
    (as launcher.train sends its composed config to the ranks it starts): Hydra's composition
    costs a third of a CPU-second, once per job rather than once per rank."""
    import torch.distributed as dist

    from launcher.cli import compose

    if not dist.is_initialized():
        return compose(list(overrides))
    box = [compose(list(overrides)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def train(out: Path, *overrides: str) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from launcher.plan import engine_plan
    from launcher.plan.report import problems_message
    from launcher.runtime import distributed
    from launcher.train import checkpoint_problems
    from launcher.training.trainer import Trainer

    cfg = composed(overrides)
    plan = engine_plan(cfg)
    if not plan.ok:
        raise ValueError(f"the plan refuses {list(overrides)}:\n{problems_message(plan)}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.world_size:
        raise ValueError(f"the group has {world} processes, the plan needs {plan.world_size}")
    problems = checkpoint_problems(cfg, str(out))
    if problems:
        raise ValueError("; ".join(problems))
    d = distributed.init("cpu", plan.layout)
    Trainer(cfg, plan, str(out), OmegaConf.structured(cfg), d).train(NoStops())


def trainer_of(out: Path, overrides, timeout_s: float = 120.0):
    """(config, Dist, Trainer) of these overrides on this job's group: the engine's own Trainer
    for the planned layout, as a job that runs pieces of a step needs it."""
    from omegaconf import OmegaConf

    from launcher.plan import make_plan
    from launcher.runtime import distributed
    from launcher.training.trainer import Trainer

    cfg = composed(overrides)
    plan = make_plan(cfg)
    assert plan.ok, plan.errors
    d = distributed.init("cpu", plan.layout, timeout_s)
    return cfg, d, Trainer(cfg, plan, str(out), OmegaConf.structured(cfg), d)


def mesh_job(target: str, shape: tuple[int, ...], names: tuple[str, ...], *args, label="") -> Job:
    """The job writing `target(mesh, *args)` ("module:function" under tests/) of every rank of
    a mesh of this shape and these dimension names to OUT/RANK.json."""
    return Job("jobs:on_mesh", math.prod(shape), (target, list(shape), list(names), *args), label)


def on_mesh(out: Path, target: str, shape: list[int], names: list[str], *args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    module, name = target.split(":")
    compute = getattr(importlib.import_module(module), name)
    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    (out / f"{dist.get_rank()}.json").write_text(json.dumps(compute(mesh, *args)))


@contextlib.contextmanager
def patched(owner, name: str, value):
    """`owner.name` is `value` inside the block, what it was after it."""
    own = name in vars(owner)
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield old
    finally:
        if own:
            setattr(owner, name, old)
        else:
            delattr(owner, name)
