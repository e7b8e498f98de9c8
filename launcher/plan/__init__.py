"""Plan before build: resolve degrees, check every rule, estimate memory, all in pure Python.

`make_plan(cfg)` never raises for a user mistake: it returns a Plan whose `errors` list names
every broken rule with the values involved. The engine only ever receives a Plan without errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.config import Config
from launcher.plan.memory import GIB, Memory, estimate
from launcher.plan.model_size import ParamCounts, flops_per_token, param_counts
from launcher.plan.rules import Problem, check, resolve_degrees

AXES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")


@dataclass
class Plan:
    cfg: Config
    world_size: int
    degrees: dict[str, int]
    counts: ParamCounts | None = None
    memory: Memory | None = None
    flops_per_token: float = 0.0
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.errors

    @property
    def fits(self) -> bool:
        return self.memory is not None and self.memory.total <= self.capacity_bytes

    @property
    def capacity_bytes(self) -> float:
        return self.cfg.hardware.memory_gib * GIB

    @property
    def dp(self) -> int:
        return self.degrees["dp_replicate"] * self.degrees["dp_shard"]

    @property
    def grad_accum(self) -> int:
        t = self.cfg.train
        return max(1, t.global_batch_size // (t.micro_batch_size * self.dp))

    @property
    def data_parallel_strategy(self) -> str:
        """What the engine builds for the data-parallel axis, in words."""
        stage = self.cfg.data_parallel.zero_stage
        shard, rep = self.degrees["dp_shard"], self.degrees["dp_replicate"]
        if self.dp == 1:
            return "none (one data-parallel rank)"
        if shard == 1 or stage == 0:
            return "DDP"
        name = {1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}[stage]
        if stage == 1:
            return f"{name} (DDP + optimizer sharded over {shard})"
        return f"HSDP {name} ({rep} x {shard})" if rep > 1 else name


def make_plan(cfg: Config) -> Plan:
    """Check the config and estimate memory; never touches torch.distributed."""
    hw = cfg.hardware
    world = hw.nodes * hw.devices_per_node
    degrees, problems = resolve_degrees(cfg.parallel, world)
    plan = Plan(cfg=cfg, world_size=world, degrees=degrees)
    plan.errors.extend(problems)
    if any(v < 1 for v in degrees.values()):
        return plan  # unresolved degrees: the rules below would only repeat the problem
    errors, warnings = check(cfg, degrees)
    plan.errors.extend(errors)
    plan.warnings.extend(warnings)
    if cfg.model.family in ("llama",):
        plan.counts = param_counts(cfg.model)
        plan.memory = estimate(cfg, plan.counts, degrees["dp_shard"])
        plan.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)
        if plan.valid and not plan.fits:
            plan.errors.append(Problem("memory", memory_message(plan)))
    return plan


def memory_message(plan: Plan) -> str:
    m, cfg = plan.memory, plan.cfg
    return (
        f"model={cfg.model.name} needs an estimated {m.total / GIB:,.1f} GiB per rank "
        f"(params {m.params / GIB:,.1f}, grads {m.grads / GIB:,.1f}, optimizer "
        f"{m.optimizer / GIB:,.1f}, activations {m.activations / GIB:,.1f}, other "
        f"{m.other / GIB:,.1f}) but hardware={cfg.hardware.name} has memory_gib="
        f"{cfg.hardware.memory_gib:g} per device; shard more (parallel.dp_shard, "
        f"data_parallel=fsdp), shrink train.micro_batch_size or use more devices"
    )


__all__ = ["AXES", "Plan", "Problem", "make_plan"]
