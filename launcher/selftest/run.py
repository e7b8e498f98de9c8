"""The rank side of `python -m launcher.selftest`: each correctness row trained on the whole
world with the engine's own Trainer, against one process of the same model and batch.

Rank 0 trains the references first, as a process of its own, before the process group exists
(the other ranks wait for it at the rendezvous); then every rank trains each row in turn over
the group (one mesh per row, as the tests' long-lived groups do) and rank 0 compares it with
its reference. Each row's files are under RUN_DIR/rows/, its training output in its train.log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose as hydra_compose
from omegaconf import OmegaConf

from launcher.cli import to_config
from launcher.plan import engine_plan
from launcher.plan.report import problems_message
from launcher.runtime import distributed, launch
from launcher.runtime.failures import NoStops
from launcher.selftest import fabric, speed
from launcher.selftest.compare import Verdict, compare
from launcher.selftest.rows import BASE, DENSE, Row, batch_for
from launcher.training.trainer import Trainer


@dataclass
class Result:
    """One row as the report shows it: passed, failed, refused by the plan or not run."""

    row: Row
    status: str  # "pass", "FAIL", "refused", "not run"
    seconds: float = 0.0
    verdict: Verdict | None = None
    reason: str = ""


def compose(overrides: list[str]):
    """The typed config of these overrides, composed by the running Hydra app (its search
    path: the user's config directories too)."""
    return to_config(hydra_compose(config_name="config", overrides=overrides))


def overrides_of(row_or_model: tuple[str, ...], hardware: list[str], steps: int) -> list[str]:
    return [*hardware, *BASE, f"train.steps={steps}", *row_or_model]


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "=." else "_" for c in text)


# torch's advice that a DTensor redistribution takes two all-gathers (a TP row's gathered
# parameters): a line per rank and row, about torch's choice, not about what the row checks.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@contextlib.contextmanager
def quiet(path: Path) -> Iterator[None]:
    """The trainer's progress lines and summary, and the warnings training raises (torch's
    advisories on every rank), into `path`, not the self-test's output; a row's error still
    reaches it (raised through, reported by the row's line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        yield


def train_reference(model: tuple[str, ...], hardware: list[str], steps: int, out: Path) -> None:
    """The one-process run of a row's model, on this rank's device, outside any group."""
    cfg = compose([*overrides_of(model, hardware, steps), "hardware.nodes=1",
                   "hardware.devices_per_node=1"])  # fmt: skip
    plan = engine_plan(cfg)
    if not plan.ok:
        raise RuntimeError(f"the reference {' '.join(model)} is refused:\n{problems_message(plan)}")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    single = distributed.single(cfg.hardware.device_type.value, local)
    with quiet(out / "train.log"):
        Trainer(cfg, plan, str(out), OmegaConf.structured(cfg), single).train(NoStops())


@contextlib.contextmanager
def fault(kind: str) -> Iterator[None]:
    """selftest.fault: one collective's results corrupted (scaled by 1.01) on every rank.
    `send` is the point-to-point send the pipeline's schedules and CP's ring post (isend, as
    torch.distributed.pipelining and batch_isend_irecv call it: torch.distributed's name and
    distributed_c10d's own, which batch_isend_irecv compares ops with, both replaced)."""
    if kind == "none":
        yield
        return
    import torch.distributed.distributed_c10d as c10d

    name = {"all_to_all": "all_to_all_single", "send": "isend"}[kind]
    real = getattr(dist, name)
    sent: list[torch.Tensor] = []  # the scaled copies live until the row ends

    def all_to_all_single(output, *args, **kwargs):
        work = real(output, *args, **kwargs)
        if output.is_floating_point():  # not the exchanged counts (the dispatch's splits)
            output.mul_(1.01)
        return work

    def isend(tensor, *args, **kwargs):
        if not tensor.is_floating_point():  # sizes and pickled objects (send_object_list)
            return real(tensor, *args, **kwargs)
        sent.append(tensor * 1.01)
        return real(sent[-1], *args, **kwargs)

    wrong = {"all_to_all_single": all_to_all_single, "isend": isend}[name]
    for module in (dist, c10d):
        setattr(module, name, wrong)
    try:
        yield
    finally:
        for module in (dist, c10d):
            setattr(module, name, real)


def agreed_over_budget(started: float, budget_s: float) -> bool:
    """Rank 0's clock decides, for every rank: the rows start together or not at all."""
    flag = torch.tensor([float(time.monotonic() - started > budget_s)])
    if dist.is_initialized():
        dist.broadcast(flag, src=0)
    return bool(flag.item())


def barrier() -> None:
    """Every rank here (nothing to wait for on one process)."""
    if dist.is_initialized():
        dist.barrier()


def run(cfg, rows: list[Row], hardware: list[str], run_dir: Path, started: float) -> list[Result]:
    """Every row over this process group, compared on rank 0; the results on rank 0 (empty
    elsewhere). A row the planner refuses is reported with its reason, not run."""
    st, rank = cfg.selftest, launch.global_rank()
    device_type = cfg.hardware.device_type.value
    planned = []
    for row in rows:
        row_cfg = compose(overrides_of((*row.reference, *row.layout), hardware, st.steps))
        planned.append((row, row_cfg, engine_plan(row_cfg)))
    refs = {row.reference: run_dir / "reference" / slug("_".join(row.reference)) for row in rows}
    if rank == 0:
        for model, out in refs.items():
            say(f"reference: {' '.join(model)} on one process")
            train_reference(model, hardware, st.steps, out)
    join(cfg, hardware)
    results: list[Result] = []
    for i, (row, row_cfg, plan) in enumerate(planned, 1):
        if not plan.ok:
            results.append(Result(row, "refused", reason=problems_message(plan)))
            continue
        d = distributed.init(device_type, plan.layout, cfg.train.timeout_s)
        if agreed_over_budget(started, st.budget_s):
            results.append(Result(row, "not run", reason=f"selftest.budget_s={st.budget_s:g}"))
            continue
        if rank == 0:
            say(f"row {i}/{len(planned)}: {row.name}")
        row_started = time.monotonic()
        out = run_dir / "rows" / slug(row.name)
        with fault(st.fault.value), quiet(out / "train.log"):
            Trainer(row_cfg, plan, str(out), OmegaConf.structured(row_cfg), d).train(NoStops())
        barrier()  # metrics.jsonl and final_model.pt written before rank 0 reads them
        if rank == 0:
            verdict = compare(refs[row.reference], out, plan.layout.cp)
            status = "pass" if verdict.passed else "FAIL"
            seconds = time.monotonic() - row_started
            results.append(Result(row, status, seconds, verdict, verdict.detail))
    return results


def measure_fabric(cfg, started: float) -> list[fabric.Timing]:
    """The fabric's timings over this process group (every rank), within the budget."""
    world = cfg.hardware.nodes * cfg.hardware.devices_per_node
    if world < 2 or not cfg.selftest.fabric or agreed_over_budget(started, cfg.selftest.budget_s):
        return []
    hw = cfg.hardware
    device = distributed.single(hw.device_type.value, int(os.environ.get("LOCAL_RANK", "0"))).device
    if launch.global_rank() == 0:
        say("fabric: each collective over pairs, the node" + (", across nodes" * (hw.nodes > 1)))
    return fabric.measure(device, hw.nodes * hw.devices_per_node, hw.devices_per_node)


@dataclass
class Speed:
    """The speed row on rank 0: the cut's overrides and config, its measured step (median
    after a warm-up), the planner's for it with the preset's figures; or why it did not run."""

    overrides: list[str]
    cfg: object = None
    measured_s: float = 0.0
    predicted_s: float = 0.0
    reason: str = ""


def measure_speed(cfg, overrides: list[str], run_dir: Path, started: float) -> Speed | None:
    """A few timed steps of the command line's run cut to fit (launcher/selftest/speed.py),
    over this process group (every rank); the result on rank 0."""
    if not cfg.selftest.fabric or agreed_over_budget(started, cfg.selftest.budget_s):
        return None
    cut = speed.cut_overrides(cfg, overrides)
    cut_cfg = compose(cut)
    plan = engine_plan(cut_cfg)
    rank = launch.global_rank()
    if not plan.ok:
        return Speed(cut, reason=problems_message(plan)) if rank == 0 else None
    if rank == 0:
        say(f"speed: {' '.join(cut)}")
    out = run_dir / "speed"
    d = distributed.init(cfg.hardware.device_type.value, plan.layout, cfg.train.timeout_s)
    with quiet(out / "train.log"):
        Trainer(cut_cfg, plan, str(out), OmegaConf.structured(cut_cfg), d).train(NoStops())
    barrier()  # metrics.jsonl written (by the rank holding the loss) before rank 0 reads it
    if rank:
        return None
    return Speed(cut, cut_cfg, speed.measured_step(out), plan.estimate.time.step)


def join(cfg, hardware: list[str]) -> None:
    """The process group of the whole world (every rank; rank 0 after its references), for
    the rows and the fabric: joined through a plain data-parallel layout's meshes."""
    world = cfg.hardware.nodes * cfg.hardware.devices_per_node
    batch = f"train.global_batch_size={batch_for(world, 1)}"
    plain = compose(overrides_of((*DENSE, batch, f"parallel.dp_shard={world}"), hardware, 2))
    distributed.init(cfg.hardware.device_type.value, engine_plan(plain).layout, cfg.train.timeout_s)


def say(line: str) -> None:
    print(line, flush=True)
