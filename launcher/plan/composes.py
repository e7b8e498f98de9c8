"""What composes with what: every pair of the engine's features, at debug scale, either is a
layout `launcher.train` runs or names the limitation (launcher/plan/limitations.py) that refuses it.

Each feature is a few overrides (`FEATURES`); a pair is both sets on top of `BASE`, on as many
ranks as its degrees multiply to. docs/planner.md's table is generated from this
(`python -m launcher.plan.composes`), and tests/test_limitations.py keeps that copy equal and checks
that nothing but a limitation refuses a pair (a rule refusing one would be a wrong sample, not a
composition hole). What "runs" means is shown by the parity rows and by the composition
property test (tests/parallel/test_composition.py), which trains random layouts drawn from the
same features against one process.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from itertools import combinations

from launcher.cli import compose_dict, to_config
from launcher.layout import MESH_DIMS
from launcher.plan import engine_plan
from launcher.plan.limitations import refusals
from launcher.plan.rules import NOT_AVAILABLE


@dataclass(frozen=True)
class Feature:
    label: str
    overrides: tuple[str, ...]
    kind: str = ""  # features of one kind exclude each other (one data parallelism, ...)


def _zero(label: str, name: str, stage: int, axis: str) -> Feature:
    """A data parallelism of ZeRO `stage` over 2 ranks of `axis`."""
    values = (f"data_parallel.name={name}", f"data_parallel.zero_stage={stage}")
    return Feature(label, (f"parallel.{axis}=2", *values), "dp")


def _schedule(label: str, schedule: str, stages_per_rank: int = 2) -> Feature:
    """pp=2 under `schedule`."""
    v = (f"pipeline.stages_per_rank={stages_per_rank}",) if stages_per_rank != 1 else ()
    return Feature(label, ("parallel.pp=2", f"pipeline.schedule={schedule}", *v), "pp")


# Each feature as overrides of single values (not config groups, except the model), so that
# a pair is the base model's composed config with them merged in: one Hydra composition per
# model instead of one per pair. They are valid `launcher.train` overrides as they are.
FEATURES: tuple[Feature, ...] = (
    Feature("FSDP", ("parallel.dp_shard=2",), "dp"),
    Feature("HSDP", ("parallel.dp_replicate=2", "parallel.dp_shard=2"), "dp"),
    _zero("ZeRO-2", "zero2", 2, "dp_shard"),
    _zero("ZeRO-1", "zero1", 1, "dp_shard"),
    _zero("DDP", "ddp", 0, "dp_replicate"),
    Feature("TP + SP", ("parallel.tp=2", "tensor.sequence_parallel=true")),
    Feature("CP", ("parallel.cp=2",)),
    Feature("EP", ("parallel.ep=2",)),
    _schedule("1F1B", "1f1b", stages_per_rank=1),
    _schedule("interleaved 1F1B", "interleaved_1f1b"),
    _schedule("interleaved ZB", "interleaved_zb"),
    _schedule("ZBV", "zbv"),
    _schedule("DualPipeV", "dualpipev"),
    Feature("recompute=op", ("recompute.mode=op",), "recompute"),
    Feature("recompute=full", ("recompute.mode=full",), "recompute"),
    Feature("compile", ("train.compile=true",)),
    Feature("tied embeddings", ("model.tie_embeddings=true",)),
    Feature("MLA (deepseek)", ("model=deepseek_debug",), "model"),
    Feature("MoE (mixtral)", ("model=mixtral_debug",), "model"),
)
MODEL = "model=llama3_debug"
BASE = (
    "train.global_batch_size=16",
    "train.micro_batch_size=1",
    "parallel.dp_replicate=1",
    "parallel.dp_shard=1",
)


def overrides(features: tuple[Feature, ...]) -> list[str]:
    """The model, BASE, the features' overrides, under EP an MoE model and ranks to carve the
    experts' from (dp_shard x cp x tp), and the ranks it takes."""
    out = [*BASE, *(o for f in features for o in f.overrides if not o.startswith("model="))]
    models = [o for f in features for o in f.overrides if o.startswith("model=")]
    degrees = dict.fromkeys(MESH_DIMS, 1)
    for o in out:
        key, _, value = o.partition("=")
        if key.removeprefix("parallel.") in degrees:
            degrees[key.removeprefix("parallel.")] = int(value)
    if "parallel.ep=2" in out:
        models = models or ["model=mixtral_debug"]  # experts to place
        if degrees["dp_shard"] * degrees["cp"] * degrees["tp"] == 1:
            degrees["dp_shard"] = 2
            out.append("parallel.dp_shard=2")
    world = 1
    for n in degrees.values():
        world *= n
    return [*(models or [MODEL]), *out, f"hardware.devices_per_node={world}"]


@functools.cache
def _model_config(model: str):

    return compose_dict([model])


def config(overrides: list[str]):
    """The typed Config of overrides whose first is the model and the rest single values: the
    model's composition (once) with the values merged in, as Hydra would."""
    from omegaconf import OmegaConf

    dcfg = OmegaConf.merge(_model_config(overrides[0]), OmegaConf.from_dotlist(overrides[1:]))
    return to_config(dcfg)


def verdict(features: tuple[Feature, ...]) -> str:
    """'yes', the names of the limitations that refuse the combination, or '-' (exclusive)."""

    kinds = [f.kind for f in features if f.kind]
    if len(set(kinds)) < len(kinds):
        return "-"
    cfg = config(overrides(features))
    plan = engine_plan(cfg)
    if plan.ok:
        return "yes"
    limits = refusals(cfg, plan.layout) if plan.layout is not None else []
    others = [p for p in plan.errors if p.rule != NOT_AVAILABLE]
    if others or not limits:
        raise ValueError(f"{' + '.join(f.label for f in features)}: {plan.errors}")
    return ", ".join(f"`{x.name}`" for x, _ in limits)


def matrix() -> dict[tuple[str, str], str]:
    """{(feature, feature): verdict} for every pair, each pair under both orders."""
    out = {}
    for a, b in combinations(FEATURES, 2):
        out[a.label, b.label] = out[b.label, a.label] = verdict((a, b))
    return out


def markdown() -> str:
    """docs/planner.md's table: one row per feature, the features it does not compose with."""
    cells = matrix()
    lines = ["| feature | composes with every other feature except |", "|---|---|"]
    for f in FEATURES:
        refused = [
            f"{g.label} ({cells[f.label, g.label]})"
            for g in FEATURES
            if g is not f and cells[f.label, g.label] not in ("yes", "-")
        ]
        lines.append(f"| {f.label} | {'; '.join(refused) or 'none'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from launcher.cli import print_table

    sys.exit(print_table("launcher.plan.composes", markdown, __doc__, sys.argv[1:]))
