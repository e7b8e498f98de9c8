"""The one vocabulary the planner and the engine share: axes, mesh order, schedules, stage
placement and the `Layout` of a run (torchtitan's ParallelDims, as a frozen dataclass).

Pure Python: no torch import. `launcher/plan` evaluates Layouts, `launcher/parallel` and the
trainer build exactly what a Layout says; neither reads the degrees from anywhere else.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

# Parallelism axes: config keys (parallel.<axis>), mesh dimension names, function suffixes.
AXES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
# Mesh dimensions, outermost first: pipeline stages span the slowest links, tensor parallelism
# the fastest, so tp is innermost (consecutive ranks, one node). ep is carved from
# dp_shard x cp x tp rather than being a dimension of its own.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# Pipeline schedules, by how they place stages on ranks.
SINGLE = ("gpipe", "1f1b")  # one stage per rank
LOOPED = ("interleaved_1f1b", "interleaved_zb")  # stages r, r+p, r+2p, ...
V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank placed as a V: rank r holds r, 2p-1-r
SCHEDULES = SINGLE + LOOPED + V_SCHEDULES
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")  # input and weight gradients apart


def split_layers(n_layers: int, n_stages: int) -> list[int]:
    """Layers per (virtual) stage: as even as possible, extra layers to the middle stages first.

    The first stage also holds the embedding and the last the output head, so they are the
    ones left a layer short: Llama 3 405B's 126 layers on 16 stages -> 7, 8 x 14, 7.
    """
    base, extra = divmod(n_layers, n_stages)
    order = list(range(1, n_stages - 1)) + [0, n_stages - 1] if n_stages > 2 else [0, 1][:n_stages]
    counts = [base] * n_stages
    for i in order[:extra]:
        counts[i] += 1
    return counts


def stage_split(
    n_layers: int, n_stages: int, first: int = 0, last: int = 0, explicit: tuple[int, ...] = ()
) -> list[int]:
    """Layers per stage from the config: explicit counts, fixed ends, or the even default.

    With fixed ends the stages between them share the rest evenly. The result may hold
    counts below 1 or not sum to n_layers; the rules report that, naming the values.
    """
    if explicit:
        return list(explicit)
    if not (first or last) or n_stages < 2:
        return split_layers(n_layers, n_stages)
    head, tail = [first] if first else [], [last] if last else []
    inner = n_stages - len(head) - len(tail)
    rest = n_layers - first - last
    middle = split_layers(rest, inner) if inner > 0 and rest >= 0 else [rest] * max(inner, 0)
    return head + middle + tail


def stage_starts(counts: list[int] | tuple[int, ...]) -> list[int]:
    """First layer index of every stage, from the layers per stage."""
    return [sum(counts[:i]) for i in range(len(counts))]


def rank_stages(rank: int, pp: int, v: int, schedule: str) -> list[int]:
    """Virtual stage indices that pipeline rank `rank` holds."""
    if schedule in V_SCHEDULES:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(v)]


def stage_owner(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank that holds virtual stage `stage` (the inverse of rank_stages)."""
    if schedule in V_SCHEDULES:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def last_stage_rank(pp: int, schedule: str) -> int:
    """The rank that holds the output head: the V schedules fold it back onto rank 0."""
    return 0 if schedule in V_SCHEDULES else pp - 1


def recomputed(index: int, every: int) -> bool:
    """Whether block `index` (its index in the whole model) recomputes under recompute.every:
    blocks 0, every, 2 x every, ..."""
    return index % every == 0


@dataclass(frozen=True)
class Option:
    """What a Layout field is beyond its value, declared on the field itself: the setting it is
    read from, how the override that gives it is spelt, and what plan.search tries.

    The rules and engine limitations that read it declare so (`reads`: launcher/plan/rules.py
    and limitations.py; `python -m launcher.plan.options` lists each option with its readers),
    and the cost terms and the engine read it from the Layout, never from the config. Adding
    a layout option is its field here plus the code that does the work
    (tests/test_layout.py holds each record to the config's schema)."""

    setting: str  # the config key it is read from (`group.field`)
    spelt: str = ""  # the override's key when it is not the setting: a group choice, e.g. pipeline
    when: Callable[[Any], bool] | None = None  # (Layout) -> whether it is spelt; None: always
    changed_only: bool = False  # spelt only when it differs from its default
    read: Callable[[Any, dict[str, int]], Any] | None = None  # (cfg, degrees); None: as set
    # (cfg, the point so far: degrees and the options before) -> the values to try, each as
    # {field: value} (one option may fix another: a schedule its stages per rank); None: the
    # field's default. `escalates`: tried cheapest first, the search stops at the first that fits.
    search: Callable[[Any, dict[str, Any]], list[dict[str, Any]]] | None = None
    also_sets: tuple[str, ...] = ()  # the other fields its search's values set
    escalates: bool = False


def option(default: Any = MISSING, **record) -> Any:
    """A Layout field with its Option record (`record`: Option's fields)."""
    return field(default=default, metadata={"option": Option(**record)})


def _pipelined(lay) -> bool:
    return lay.pp > 1


def _never(lay) -> bool:
    """Not spelt: derived from the settings that are (train.global_batch_size and the rest)."""
    return False


def configured_split(cfg, degrees: dict[str, int]) -> tuple[int, ...]:
    """The layers per stage the config asks for, or () for the even default."""
    p, pp = cfg.pipeline, degrees["pp"]
    if pp == 1 or not (p.layers_per_stage or p.first_stage_layers or p.last_stage_layers):
        return ()
    return tuple(
        stage_split(
            cfg.model.n_layers,
            pp * p.stages_per_rank,
            p.first_stage_layers,
            p.last_stage_layers,
            tuple(p.layers_per_stage),
        )
    )


def _dp(point: dict[str, Any]) -> int:
    return point["dp_replicate"] * point["dp_shard"]


def _microbatches(cfg, degrees: dict[str, int]) -> int:
    b = cfg.train.micro_batch_size
    return cfg.pipeline.microbatches or max(
        1, cfg.train.global_batch_size // max(1, b * _dp(degrees))
    )


def _zero_stages(cfg, point) -> list[dict[str, Any]]:
    """ZeRO-0 is ZeRO-1's traffic with more memory, so only with nothing to shard over; ZeRO-2
    under a pipeline keeps gradients unreduced until the last micro-batch, as ZeRO-3 does."""
    if point["dp_shard"] == 1:
        return [{"zero_stage": 0}]
    return [{"zero_stage": z} for z in ((1, 3) if point["pp"] > 1 else (1, 2, 3))]


def pipeline_options(pp: int, n_layers: int) -> list[tuple[str, int]]:
    """(schedule, stages per rank) the search tries: gpipe is left out (1F1B's bubble with more
    memory)."""
    if pp == 1:
        return [("1f1b", 1)]
    options = [("1f1b", 1)]
    for v in (2, 4):
        if pp * v <= n_layers:
            options.append(("interleaved_1f1b", v))
    if pp * 2 <= n_layers:
        options += [("interleaved_zb", 2), ("zbv", 2), ("dualpipev", 2)]
    return options


def _schedules(cfg, point) -> list[dict[str, Any]]:
    return [
        {"schedule": s, "stages_per_rank": v}
        for s, v in pipeline_options(point["pp"], cfg.model.n_layers)
    ]


def _micro_batches(cfg, point) -> list[dict[str, Any]]:
    g, dp = cfg.train.global_batch_size, _dp(point)
    return [
        {"micro_batch_size": b, "microbatches": g // (b * dp)}
        for b in (1, 2, 4, 8)
        if g % (b * dp) == 0
    ]


# (mode, matmuls) from the least recompute to the most: op keeping every other matmul's output
# sits between op and full (for blocks without routed experts or MLA: rules.py).
RECOMPUTE = (
    ("none", "all"),
    ("selective", "all"),
    ("op", "all"),
    ("op", "alternate"),
    ("full", "all"),
)


def _recomputes(cfg, point) -> list[dict[str, Any]]:
    return [{"recompute": r, "recompute_matmuls": m} for r, m in RECOMPUTE]


def _context_methods(cfg, point) -> list[dict[str, Any]]:
    return [
        {"context_method": m}
        for m in (("allgather", "ring") if point["cp"] > 1 else ("allgather",))
    ]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to lay a run out on its ranks: the degrees, then every layout option, each with
    its record (Option): data-parallel sharding, micro-batching, recompute, tensor- and
    context-parallel options, pipeline shape. The options' order is the order of their
    overrides and of the search's loops."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    zero_stage: int = option(3, setting="data_parallel.zero_stage", search=_zero_stages)
    micro_batch_size: int = option(
        4,
        setting="train.micro_batch_size",
        search=_micro_batches,
        also_sets=("microbatches",),
    )
    # per pipeline and step: the gradient-accumulation count
    microbatches: int = option(setting="pipeline.microbatches", read=_microbatches, when=_never)
    recompute: str = option(
        "none",
        setting="recompute.mode",
        spelt="recompute",
        search=_recomputes,
        also_sets=("recompute_matmuls",),
        escalates=True,
    )
    # recompute blocks 0, k, 2k, ... only
    recompute_every: int = option(1, setting="recompute.every", changed_only=True)
    # under op: "all" matmul outputs kept, or "alternate" ones
    recompute_matmuls: str = option("all", setting="recompute.matmuls", changed_only=True)
    sequence_parallel: bool = option(
        False,
        setting="tensor.sequence_parallel",
        search=lambda cfg, point: [{"sequence_parallel": point["tp"] > 1}],
    )
    # vocab-sharded logits and loss (tp > 1)
    loss_parallel: bool = option(
        False,
        setting="tensor.loss_parallel",
        read=lambda cfg, degrees: cfg.tensor.loss_parallel and degrees["tp"] > 1,
    )
    # how attention meets the other ranks' keys and values under cp > 1
    context_method: str = option(
        "allgather",
        setting="context.method",
        spelt="context",
        when=lambda lay: lay.cp > 1,
        search=_context_methods,
    )
    schedule: str = option(
        "1f1b",
        setting="pipeline.schedule",
        spelt="pipeline",
        when=_pipelined,
        search=_schedules,
        also_sets=("stages_per_rank",),
    )
    stages_per_rank: int = option(1, setting="pipeline.stages_per_rank", when=_pipelined)
    # layers per stage; () = the even default split
    stage_layers: tuple[int, ...] = option(
        (),
        setting="pipeline.layers_per_stage",
        read=configured_split,
        when=_pipelined,
        changed_only=True,
    )
    # FSDP under pp: reshard after every backward
    reshard_each_microbatch: bool = option(
        False, setting="pipeline.reshard_each_microbatch", when=_pipelined, changed_only=True
    )

    @classmethod
    def from_config(cls, cfg, degrees: dict[str, int]) -> Layout:
        """The layout a config asks for, with its degrees resolved (rules.resolve_degrees)."""
        values = {}
        for f, opt in OPTIONS:
            if opt.read is not None:
                values[f.name] = opt.read(cfg, degrees)
                continue
            group, key = opt.setting.split(".")
            value = getattr(getattr(cfg, group), key)
            values[f.name] = getattr(value, "value", value)  # an enum by its name
        return cls(**degrees, **values)

    @property
    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)

    @property
    def dp(self) -> int:
        """Ranks that share the batch (each holds a different slice of it)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """Ranks over which FSDP shards parameters (context parallel ranks hold the same ones)."""
        return self.dp_shard * self.cp

    @property
    def dp_cp(self) -> int:
        """Ranks over which gradients are reduced."""
        return self.dp * self.cp

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters (ZeRO-3) or gradients (ZeRO-2) sharded by fully_shard; otherwise DDP."""
        return self.zero_stage >= 2 and self.dp_shard_cp > 1

    @property
    def reshard_after_forward(self) -> bool:
        """ZeRO-3 frees each block's gathered parameters after its forward. Not under the split
        schedules: their input-gradient pass finds the weights through the stage's registered
        parameters, and their weight pass runs after FSDP's backward hooks, so the parameters
        must stay gathered (and registered) from a stage's first forward to the step's gradient
        reduction, as under ZeRO-2."""
        return self.zero_stage == 3 and not (self.pp > 1 and self.schedule in SPLIT_BACKWARD)

    @property
    def grads_averaged_by_trainer(self) -> bool:
        """DDP or ZeRO-1 under a pipeline or tensor parallelism: no DDP wrapper, the trainer
        averages the gradients over dp x cp once the step's backward is done. torch 2.13's
        stages run the split schedules' weight-gradient pass outside DDP's hooks, DDP's reducer
        fails an internal assert with two stages per rank (interleaved 1F1B), and DDP does not
        take DTensor (tensor-parallel) parameters."""
        return (self.pp > 1 or self.tp > 1) and self.dp_cp > 1 and not self.fsdp_enabled

    @property
    def zero1_enabled(self) -> bool:
        """DDP with the optimizer states sharded over dp_shard x cp."""
        return self.zero_stage == 1 and self.dp_shard_cp > 1

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def overrides(self) -> list[str]:
        """The `launcher.train` overrides that give this layout (degrees and layout options)."""
        out = [f"parallel.{a}={getattr(self, a)}" for a in AXES]
        for f, opt in OPTIONS:
            value = getattr(self, f.name)
            if (opt.when is None or opt.when(self)) and not (
                opt.changed_only and value == f.default
            ):
                out.append(f"{opt.spelt or opt.setting}={_spell(value)}")
        return out


def axis_rows(lay: Layout) -> dict[str, str]:
    """What the engine builds for each axis, in the words of the plan's rows, from the Layout
    predicates the engine itself branches on (fsdp_enabled: fully_shard; zero1_enabled: ZeRO-1's
    optimizer; else DDP over dp x cp; the schedule and stages; recompute and sequence
    parallelism as the Layout resolves them): one function, so the plan cannot describe one
    layout and the engine build another (tests/plan/test_axis_rows.py, over random layouts)."""
    shard, rep, cp = lay.dp_shard, lay.dp_replicate, lay.cp
    over = (
        f"dp_shard {shard} x cp {cp}"
        if cp > 1 and shard > 1
        else (f"the {cp} cp ranks" if cp > 1 else f"{shard}")
    )
    if lay.dp_cp == 1:
        dp = "none (one data-parallel rank)"
    elif lay.zero_stage not in (0, 1, 2, 3):
        dp = f"unknown (data_parallel.zero_stage={lay.zero_stage})"
    elif lay.fsdp_enabled:
        name = "FSDP" if lay.zero_stage == 3 else "ZeRO-2"
        if rep > 1:
            dp = f"HSDP {name} ({rep} x {lay.dp_shard_cp})"
        else:
            dp = f"{name} (over {over})" if cp > 1 else name
    elif lay.zero1_enabled:
        dp = f"ZeRO-1 (DDP + optimizer sharded over {over})"
    else:
        dp = f"DDP ({lay.dp_cp} ranks)" if cp > 1 else "DDP"
    rows = {"data parallel": dp}
    if lay.pp > 1:
        rows["pipeline"] = f"{lay.schedule}, {lay.stages_per_rank} stage(s) per rank"
    every = ""
    if lay.recompute_every > 1 and lay.recompute != "none":  # none recomputes no block
        every = f" on blocks 0, {lay.recompute_every}, {2 * lay.recompute_every}, ..."
    alternate = lay.recompute == "op" and lay.recompute_matmuls == "alternate"
    kept = ", every other matmul's output kept" if alternate else ""
    sp = ", sequence parallel" if lay.sequence_parallel and lay.tp > 1 else ""
    rows["recompute"] = lay.recompute + kept + every + sp
    return rows


def as_saved(lay: dict) -> dict:
    """A layout as meta.json holds it (JSON: lists for tuples), an option that a checkpoint
    saved before it existed at its default: the layout that run had."""
    defaults = {f.name: f.default for f, _ in OPTIONS if f.default is not MISSING}
    return json.loads(json.dumps({**defaults, **lay}))


def _spell(value: Any) -> str:
    """A value as an override writes it: true, [7,8,8], interleaved_1f1b."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return f"[{','.join(map(str, value))}]"
    return str(value)


# Every layout option with its record, in the Layout's order.
OPTIONS: tuple[tuple[Field, Option], ...] = tuple(
    (f, f.metadata["option"]) for f in fields(Layout) if "option" in f.metadata
)

# The config groups whose every choice is a layout (data_parallel=zero1, recompute=op, ...).
LAYOUT_GROUPS = ("data_parallel", "recompute", "tensor", "context", "pipeline")


def _chooses(setting: str) -> str:
    group = setting.split(".")[0]
    return group if group in LAYOUT_GROUPS else setting


# Override keys that choose a layout (what parallel.auto=true sets): the run directory's name
# leaves them out, so that the same command resumes whatever world and layout a start gets.
LAYOUT_OVERRIDES = (
    "parallel.",
    "hardware.nodes",
    "hardware.devices_per_node",
    *dict.fromkeys(_chooses(opt.setting) for _, opt in OPTIONS),
)


def describe(lay: dict) -> str:
    """A layout (a Layout's asdict, or a checkpoint's meta.json `layout`) in a few words:
    `pp=3 1f1b, micro-batch 2`, `dp_shard=4, micro-batch 4`."""
    degrees = " ".join(f"{a}={lay[a]}" for a in AXES if lay.get(a, 1) > 1) or "one process"
    if lay.get("pp", 1) > 1:
        degrees += f" {lay['schedule']}" + (
            f"/{lay['stages_per_rank']}" if lay.get("stages_per_rank", 1) > 1 else ""
        )
    extras = [f"micro-batch {lay.get('micro_batch_size', '?')}"]
    if lay.get("recompute", "none") != "none":
        extras.append(f"recompute={lay['recompute']}")
    return f"{degrees}, {', '.join(extras)}"
