"""Plan before build: degrees, rules, memory and time, all in pure Python.

`make_plan(cfg)` never raises for a user mistake: it returns a Plan whose `errors` list names
every broken rule with the values involved. The engine only ever receives a Plan without errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.config import Config
from launcher.data.sources import data_use, repeat_warnings
from launcher.layout import AXES, Layout, axis_rows
from launcher.plan.config_rules import config_problems
from launcher.plan.estimate import Context, Estimate, evaluate
from launcher.plan.memory import GIB
from launcher.plan.problem import Problem
from launcher.plan.rules import (
    engine_problems,
    layout_problems,
    reads_any,
    resolve_degrees,
)


@dataclass
class Plan:
    cfg: Config
    world_size: int
    degrees: dict[str, int]
    layout: Layout | None = None
    estimate: Estimate | None = None
    context: Context | None = None
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    data: list = field(default_factory=list)  # sources.Use of each training source
    # "group=choice" -> the file of each group read from a user's directory (launcher/configs.py)
    config_files: dict[str, str] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        """No rule is broken (the memory verdict is `fits`)."""
        return not [p for p in self.errors if p.rule != "memory"]

    @property
    def fits(self) -> bool:
        """The high memory figure (its band's, launcher/plan/bands.py) fits the device."""
        est = self.estimate
        return est is not None and est.memory_high <= self.cfg.hardware.memory_gib * GIB

    @property
    def ok(self) -> bool:
        return self.valid and self.fits

    @property
    def memory(self):
        return self.estimate.memory if self.estimate else None

    @property
    def dp(self) -> int:
        return self.degrees["dp_replicate"] * self.degrees["dp_shard"]

    @property
    def flops_per_token(self) -> float:
        return self.context.model_flops_per_token if self.context else 0.0

    @property
    def data_parallel_strategy(self) -> str:
        """What the engine builds for the data-parallel axis, in words (launcher.layout
        axis_rows: from the Layout the engine builds from)."""
        if self.layout is None:
            d = self.degrees
            also = f", cp={d['cp']}" if d["cp"] != 1 else ""
            return f"unresolved (dp_replicate={d['dp_replicate']}, dp_shard={d['dp_shard']}{also})"
        return axis_rows(self.layout)["data parallel"]


# Errors after which the estimate would crash or mean nothing: it reads the model, the batch
# and sequence sizes, the hardware's speeds and sizes, the schedule, the ZeRO stage, the
# checkpoint interval (ranges.py names these by group), a stage
# split that gives every stage its layers, and which blocks recompute.
UNESTIMABLE = frozenset(
    {
        "model",
        "train",
        "hardware",
        "schedule",
        "zero_stage",
        "data_parallel",
        "pipeline",
        "checkpoint",
        "pp_stages",
        "pp_split",
        "pp_layers",
        "recompute",
    }
)


def make_plan(cfg: Config) -> Plan:
    """Check the config and estimate memory and time; never touches torch.distributed.

    Every problem that can be determined is reported: with a degree unresolved, the layout
    rules that do not read it; with the degrees resolved, every layout rule, and the memory and
    time of the layout as configured even when it breaks one (the memory verdict is an error
    only for a valid layout)."""
    hw = cfg.hardware
    world = hw.nodes * hw.devices_per_node
    degrees, problems = resolve_degrees(cfg.parallel, world)
    plan = Plan(cfg=cfg, world_size=world, degrees=degrees)
    plan.errors.extend(problems)
    plan.errors.extend(config_problems(cfg))
    if any(p.rule == "model" for p in plan.errors):
        return plan  # a broken model: every rule below reads it
    if not plan.errors:  # (a broken value may be what data_use divides by)
        plan.data = data_use(cfg)
        plan.warnings.extend(Problem("data_epochs", w) for w in repeat_warnings(plan.data))
    unresolved = [a for a, v in degrees.items() if v < 1]
    if unresolved:
        stand_in = Layout.from_config(
            cfg, {a: 1 if a in unresolved else v for a, v in degrees.items()}
        )
        errors, warnings = layout_problems(cfg, stand_in)
        plan.errors.extend(p for p in errors if not reads_any(p, unresolved))
        plan.warnings.extend(p for p in warnings if not reads_any(p, unresolved))
        return plan
    plan.layout = Layout.from_config(cfg, degrees)
    errors, warnings = layout_problems(cfg, plan.layout)
    plan.errors.extend(errors)
    plan.warnings.extend(warnings)
    if plan.layout.microbatches < 1 or any(p.rule in UNESTIMABLE for p in plan.errors):
        return plan
    plan.context = Context(cfg)
    plan.estimate = evaluate(plan.context, plan.layout)
    if plan.valid and not plan.fits:
        plan.errors.append(Problem("memory", memory_message(plan)))
    straddle = straddle_message(plan)
    if straddle:
        plan.warnings.append(Problem("memory_band", straddle))
    return plan


def straddle_message(plan: Plan) -> str:
    """A layout whose memory band straddles the device's memory: the point figure fits, the
    high one does not ("" otherwise)."""
    est, cap = plan.estimate, plan.cfg.hardware.memory_gib
    low, high = est.memory_band
    if not (max(low, est.memory.start) <= cap * GIB < est.memory_high):
        return ""
    return (
        f"the memory band ({low / GIB:,.1f}-{high / GIB:,.1f} GiB, from "
        f"{plan.context.ratios.memory.runs} held-out runs of {plan.context.ratios.memory.of}) "
        f"straddles memory_gib={cap:g}: it may fit, and is planned as not fitting"
    )


def engine_plan(cfg: Config) -> Plan:
    """make_plan, plus what launcher.train cannot run yet (the planner plans more layouts
    than the engine builds): the plan every launch path checks before starting anything."""
    plan = make_plan(cfg)
    if plan.layout is not None:
        plan.errors.extend(engine_problems(cfg, plan.layout))
    return plan


def memory_message(plan: Plan) -> str:
    m, cfg = plan.memory, plan.cfg
    parts = [
        ("params", m.params),
        ("grads", m.grads),
        ("master", m.master),
        ("optimizer", m.optimizer),
        ("activations", m.activations),
        ("other", m.other),
    ]
    shown = ", ".join(
        f"{name} {size / GIB:,.1f}" for name, size in parts if size or name != "master"
    )
    high = plan.estimate.memory_high
    return (
        f"model={cfg.model.name} needs an estimated {m.total / GIB:,.1f} GiB on its most loaded "
        f"rank ({shown}; up to {high / GIB:,.1f} GiB in its band) but "
        f"hardware={cfg.hardware.name} has memory_gib="
        f"{cfg.hardware.memory_gib:g} per device; shard more (dp_shard, tp, pp), "
        f"{recompute_advice(cfg.recompute)}shrink train.micro_batch_size, or use more devices"
    )


def recompute_advice(rc) -> str:
    """The recompute this run does not use yet that would save activations ("" if none)."""
    mode, every = rc.mode.value, rc.every
    if mode in ("none", "selective"):
        return "use recompute=op or full (recompute.every=k: on every k-th block), "
    if every > 1:
        return f"recompute on more blocks (recompute.every={every} now; 1 is every block), "
    return "use recompute=full, " if mode == "op" else ""


__all__ = ["AXES", "Plan", "Problem", "make_plan"]
