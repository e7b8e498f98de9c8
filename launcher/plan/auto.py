"""`parallel.auto=true`: at every start, the fastest layout launcher.train runs on the world
this start is given.

The world is torchrun's or SLURM's where the process runs inside one, else `hardware.*`. The
choice is `plan.search`'s fastest runnable layout (search.runnable) among those that keep the
degrees the command line sets beside `parallel.auto=true`. What defines the run stays: the
model, global batch, sequence length, optimizer and schedule; the choice sets the degrees,
ZeRO stage, pipeline schedule, recompute and micro-batch size (kept for an MoE whose balance
loss is taken per micro-batch: kept_micro_batch). The data order is a function
of the step and checkpoints reshard on load, so a run resumes on whatever it is given.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from launcher.config import Config
from launcher.layout import AXES, describe
from launcher.plan.config_rules import config_problems
from launcher.plan.search import runnable, with_overrides

WORLDS_TRIED = 64  # how far `smallest_world` looks


def fixed_degrees(overrides: list[str]) -> dict[str, int]:
    """The degrees a command line sets beside parallel.auto=true (`parallel.tp=2`)."""
    out = {}
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        axis = key.removeprefix("parallel.")
        numeric = value.lstrip("-").isdigit()
        if key.startswith("parallel.") and axis in AXES and numeric and value != "-1":
            out[axis] = int(value)  # dp_shard=-1 ("the rest") constrains nothing
    return out


def on_world(cfg: Config, nodes: int, per_node: int) -> Config:
    return replace(cfg, hardware=replace(cfg.hardware, nodes=nodes, devices_per_node=per_node))


def kept_micro_batch(cfg: Config) -> int | None:
    """The micro-batch size a choice must keep, when it defines the run: an MoE's balance loss
    (model.aux_loss_coef) is taken per micro-batch, so the sequences grouped into one change
    the gradients (the mean of the main loss over micro-batches does not depend on them)."""
    m = cfg.model
    return cfg.train.micro_batch_size if m.n_routed_experts and m.aux_loss_coef > 0 else None


def choose(cfg: Config, fixed: dict[str, int]):
    """The fastest runnable layout's estimate that keeps `fixed`, or None."""
    micro = kept_micro_batch(cfg)
    for est in runnable(cfg):
        if micro is not None and est.layout.micro_batch_size != micro:
            continue
        if all(getattr(est.layout, a) == v for a, v in fixed.items()):
            return est
    return None


def smallest_world(cfg: Config, fixed: dict[str, int]) -> int | None:
    """The fewest ranks (whole nodes past one) on which a layout fits and trains."""
    per_node = cfg.hardware.devices_per_node
    for world in range(1, WORLDS_TRIED + 1):
        if world > per_node and world % per_node:
            continue
        nodes, per = (1, world) if world <= per_node else (world // per_node, per_node)
        if choose(on_world(cfg, nodes, per), fixed) is not None:
            return world
    return None


def plan_for(cfg: Config, overrides: list[str], nodes: int, per_node: int):
    """(the overrides of the chosen layout on `nodes` x `per_node` ranks, None) or ([], why
    none fits)."""
    fixed = fixed_degrees(overrides)
    world_cfg = on_world(cfg, nodes, per_node)
    if problems := config_problems(world_cfg):  # broken whatever the layout: say so
        return [], "; ".join(map(str, problems))
    est = choose(world_cfg, fixed)
    if est is not None:
        hardware = [f"hardware.nodes={nodes}", f"hardware.devices_per_node={per_node}"]
        return [*hardware, *est.layout.overrides(), "parallel.auto=true"], None
    kept = " ".join(f"parallel.{a}={v}" for a, v in fixed.items())
    smallest = smallest_world(cfg, fixed)
    where = (
        f"the smallest world on which one does is {smallest} rank(s)"
        if smallest
        else f"none does on up to {WORLDS_TRIED} ranks"
    )
    return [], (
        f"parallel.auto=true: no layout of model={cfg.model.name} with global batch "
        f"{cfg.train.global_batch_size} x seq_len {cfg.train.seq_len}"
        + (f" and {kept}" if kept else "")
        + f" fits and trains on {nodes * per_node} rank(s) ({nodes} x {per_node}); {where}"
    )


def choice_line(layout, world: int, previous: dict | None) -> str:
    """What the start says: the choice, and on a resume what changed."""
    now = describe(asdict(layout))
    if not previous or not previous.get("layout"):
        return f"planned for {world} rank(s): {now}"
    was_world, was = previous.get("world_size"), describe(previous["layout"])
    if was == now and was_world == world:
        return f"planned for {world} rank(s): {now} (as before)"
    return f"re-planned for {world} rank(s) (was {was_world}): {now} (was {was})"


def recompose(cfg: Config, overrides: list[str], world: tuple[int, int] | None, compose):
    """(the composed config of the chosen layout, None) or (None, why none fits), for a
    Hydra app's `compose(overrides)`; `world` is (nodes, per node), None: hardware.*."""

    nodes, per_node = world or (cfg.hardware.nodes, cfg.hardware.devices_per_node)
    extra, problem = plan_for(cfg, overrides, nodes, per_node)
    if problem:
        return None, problem
    if world is None:  # before the start: every world an elastic run may shrink to works too
        for fewer in range(cfg.launch.min_nodes or nodes, nodes):
            if problem := plan_for(cfg, overrides, fewer, per_node)[1]:
                return None, f"launch.min_nodes={cfg.launch.min_nodes}: {problem}"
    return compose(with_overrides(overrides, extra)), None
