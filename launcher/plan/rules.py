"""The rules a run must satisfy. Each broken rule becomes a Problem naming values and rule.

Three sets: the config rules (model, training, precision, data: independent of the layout;
launcher/plan/config_rules.py), the layout rules here (degrees, divisibility, pipeline, batch:
evaluated for every searched layout, so kept cheap) and `engine_problems` (what
`launcher.train` cannot run yet: the records of launcher/plan/limitations.py). Config and
layout rules are of one kind: a registered check that declares what it reads and yields a
message per way a run breaks it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from launcher.config import Config, ParallelConfig
from launcher.layout import (
    AXES,
    LOOPED,
    SCHEDULES,
    SINGLE,
    SPLIT_BACKWARD,
    V_SCHEDULES,
    Layout,
)
from launcher.plan import bubble as pl
from launcher.plan.limitations import LIMITATIONS, refusals
from launcher.plan.model_size import alternate_unpriced
from launcher.plan.problem import Problem


def resolve_degrees(p: ParallelConfig, world: int) -> tuple[dict[str, int], list[Problem]]:
    """Fill in dp_shard=-1 and check that the degrees multiply to the world size."""
    degrees = {k: getattr(p, k) for k in AXES}
    problems = [
        Problem("degree", f"parallel.{k}={v} must be a positive integer")
        for k, v in degrees.items()
        if v < 1 and not (k == "dp_shard" and v == -1)
    ]
    if world < 1:
        problems.append(Problem("world_size", f"nodes x devices_per_node = {world} must be >= 1"))
    if problems:
        return degrees, problems
    others = degrees["dp_replicate"] * degrees["tp"] * degrees["pp"] * degrees["cp"]
    product = " x ".join(f"{k}={degrees[k]}" for k in ("dp_replicate", "tp", "pp", "cp"))
    if degrees["dp_shard"] == -1:
        if world % others:
            problems.append(
                Problem(
                    "world_size",
                    f"parallel.dp_shard=-1 cannot be inferred: {product} = {others} does not "
                    f"divide nodes x devices_per_node = {world}",
                )
            )
            return degrees, problems
        degrees["dp_shard"] = world // others
    elif others * degrees["dp_shard"] != world:
        problems.append(
            Problem(
                "world_size",
                f"{product} x dp_shard={degrees['dp_shard']} = {others * degrees['dp_shard']} "
                f"but nodes x devices_per_node = {world}: the product of the degrees must equal "
                "the world size",
            )
        )
    return degrees, problems


@dataclass(frozen=True)
class Rule:
    """One layout rule: its name (the Problem's), the Layout fields it reads (degrees and layout
    options), and its check, which yields a message per way the layout breaks it. While a
    degree is unresolved (parallel.dp_shard=-1 that does not divide the world, or a degree
    below 1) make_plan still checks, with 1 in its place, the rules that read none of the
    unresolved ones (tests/plan/test_rules.py holds each rule to the fields it declares)."""

    name: str
    reads: tuple[str, ...]
    check: Callable[[Config, Layout], Iterable[str]]
    warning: bool = False


LAYOUT_RULES: list[Rule] = []
DP = ("dp_replicate", "dp_shard")
STAGES = ("schedule", "stages_per_rank")


def rule(name: str, reads: tuple[str, ...], warning: bool = False):
    """Register the decorated check as a layout rule (in order: the first error of a kind
    reads best first)."""

    def register(check):
        LAYOUT_RULES.append(Rule(name, reads, check, warning))
        return check

    return register


def _model(cfg: Config) -> str:
    return f"model={cfg.model.name}"


@rule("tp_heads", ("tp",))
def tp_heads(cfg, lay):
    if lay.tp > 1 and cfg.model.n_heads % lay.tp:
        yield f"tp={lay.tp} must divide n_heads={cfg.model.n_heads} ({_model(cfg)})"


@rule("tp_kv_heads", ("tp",))
def tp_kv_heads(cfg, lay):
    m, tp = cfg.model, lay.tp
    kv = m.n_heads if m.kv_lora_rank else m.n_kv_heads
    if tp > 1 and kv % tp and m.n_heads % tp == 0:
        yield (
            f"tp={tp} must divide n_kv_heads={kv} ({_model(cfg)}): kv heads are "
            "sharded across tp ranks, never replicated, so tp may not exceed them"
        )


@rule("tp_ffn", ("tp",))
def tp_ffn(cfg, lay):
    m, tp = cfg.model, lay.tp
    dense_mlp = not m.n_routed_experts or m.n_dense_layers
    if tp > 1 and dense_mlp and m.ffn_dim % tp:
        yield f"tp={tp} must divide ffn_dim={m.ffn_dim} ({_model(cfg)})"


@rule("tp_vocab", ("tp",))
def tp_vocab(cfg, lay):
    if lay.tp > 1 and cfg.model.vocab_size % lay.tp:
        yield f"tp={lay.tp} must divide vocab_size={cfg.model.vocab_size} ({_model(cfg)})"


@rule("sp_seq", ("tp", "cp", "sequence_parallel"))
def sp_seq(cfg, lay):
    seq, tp, cp = cfg.train.seq_len, lay.tp, lay.cp
    if lay.sequence_parallel and tp > 1 and (seq % cp or (seq // cp) % tp):
        yield (
            f"train.seq_len={seq} must be divisible by tp={tp} x cp={cp} "
            "with tensor.sequence_parallel=true (each tp rank holds a slice of the sequence)"
        )


@rule("tp_routed_seq", ("tp",))
def tp_routed_seq(cfg, lay):
    seq, tp = cfg.train.seq_len, lay.tp
    if tp > 1 and cfg.model.n_routed_experts and seq % tp:
        yield (
            f"train.seq_len={seq} must be divisible by tp={tp} with routed experts: "
            "each tp rank routes its own slice of every sequence"
        )


@rule("cp_seq", ("cp",))
def cp_seq(cfg, lay):
    cp, seq = lay.cp, cfg.train.seq_len
    chunks = 2 * cp if cfg.context.load_balance else cp
    if cp > 1 and seq % chunks:
        why = "2 x cp load-balanced chunks" if cfg.context.load_balance else "cp chunks"
        yield f"train.seq_len={seq} must be divisible by {chunks} ({why}, cp={cp})"


@rule("ep_dense", ("ep",))
def ep_dense(cfg, lay):
    if lay.ep > 1 and not cfg.model.n_routed_experts:
        yield f"ep={lay.ep} needs routed experts; {_model(cfg)} is dense"


@rule("ep_experts", ("ep",))
def ep_experts(cfg, lay):
    n = cfg.model.n_routed_experts
    if lay.ep > 1 and n and n % lay.ep:
        yield f"ep={lay.ep} must divide n_routed_experts={n} ({_model(cfg)})"


@rule("ep_degree", ("ep", "dp_shard", "cp", "tp"))
def ep_degree(cfg, lay):
    borrow = lay.dp_shard * lay.cp * lay.tp
    if lay.ep > 1 and borrow % lay.ep:
        yield (
            f"ep={lay.ep} must divide dp_shard x cp x tp = {lay.dp_shard} x {lay.cp} x "
            f"{lay.tp} = {borrow}: expert-parallel ranks are carved from those"
        )


@rule("pp_stages", ("pp", *STAGES))
def pp_stages(cfg, lay):
    v, sched, pp = lay.stages_per_rank, lay.schedule, lay.pp
    if v < 1:
        yield f"pipeline.stages_per_rank={v} must be >= 1"
    elif sched in V_SCHEDULES and v != 2:  # with pp = 1 too: the V is then one rank's
        yield (
            f"pipeline.schedule={sched} places exactly 2 stages per rank in a V; "
            f"got pipeline.stages_per_rank={v}"
        )
    elif pp > 1 and sched in LOOPED and v < 2:
        yield (
            f"pipeline.schedule={sched} needs pipeline.stages_per_rank >= 2 "
            f"(got {v}); use 1f1b for one stage per rank"
        )
    elif pp > 1 and sched in SINGLE and v != 1:
        yield (
            f"pipeline.schedule={sched} runs one stage per rank; got "
            f"pipeline.stages_per_rank={v} (use interleaved_1f1b)"
        )
    elif pp == 1 and v != 1 and sched not in V_SCHEDULES:
        yield f"pipeline.stages_per_rank={v} needs pp > 1"


def _pipelined(lay) -> bool:
    """pp > 1 with a stage shape the schedule takes: what the split, layer and micro-batch
    rules check (a wrong shape is pp_stages' error alone)."""
    v = lay.stages_per_rank
    return lay.pp > 1 and v >= 1 and not (lay.schedule in V_SCHEDULES and v != 2)


@rule("pp_split", ("pp", *STAGES, "stage_layers"))
def pp_split(cfg, lay):
    split, pp, v, n = lay.stage_layers, lay.pp, lay.stages_per_rank, cfg.model.n_layers
    if _pipelined(lay) and split and (len(split) != pp * v or sum(split) != n or min(split) < 1):
        p = cfg.pipeline
        yield (
            f"layers per stage {list(split)} (pipeline.first_stage_layers="
            f"{p.first_stage_layers}, last_stage_layers={p.last_stage_layers}, "
            f"layers_per_stage={list(p.layers_per_stage)}) must give each of the pp x "
            f"stages_per_rank = {pp * v} stages at least one layer and sum to "
            f"n_layers={n} ({_model(cfg)})"
        )


@rule("pp_layers", ("pp", *STAGES))
def pp_layers(cfg, lay):
    pp, v, n = lay.pp, lay.stages_per_rank, cfg.model.n_layers
    if _pipelined(lay) and pp * v > n:
        yield (
            f"pp={pp} x stages_per_rank={v} = {pp * v} stages need at least one "
            f"layer each; {_model(cfg)} has n_layers={n}"
        )


@rule(
    "pp_microbatches", ("pp", *DP, *STAGES, "microbatches")
)  # micro-batches per step: global / (micro x dp)
def pp_microbatches(cfg, lay):
    pp, mb, sched = lay.pp, lay.microbatches, lay.schedule
    if not _pipelined(lay):
        return
    if mb < pp:
        yield (
            f"{mb} micro-batches per step are fewer than pp={pp} stages: "
            "the pipeline never fills (raise train.global_batch_size or lower "
            "train.micro_batch_size)"
        )
    elif sched == "dualpipev" and mb < 2 * pp:
        yield (
            f"pipeline.schedule=dualpipev needs at least one micro-batch per stage "
            f"(2 x pp = {2 * pp}); got {mb}"
        )
    elif sched in LOOPED and mb % pp:
        yield (
            f"pipeline.schedule={sched} needs the micro-batches per step "
            f"({mb}) to be a multiple of pp={pp}"
        )


@rule("pp_reshard", ("pp", "dp_shard", "cp", "reshard_each_microbatch", "zero_stage", "schedule"))
def pp_reshard(cfg, lay):
    if not lay.reshard_each_microbatch:
        return
    if lay.pp == 1 or lay.zero_stage < 2 or lay.dp_shard * lay.cp == 1:
        yield (
            "pipeline.reshard_each_microbatch=true applies to FSDP or ZeRO-2 under a "
            f"pipeline (pp > 1, data_parallel zero_stage >= 2, dp_shard > 1); got pp={lay.pp}, "
            f"zero_stage={lay.zero_stage}, dp_shard={lay.dp_shard}"
        )
    elif lay.schedule in SPLIT_BACKWARD:
        yield (
            "pipeline.reshard_each_microbatch=true needs a schedule with a full backward "
            f"(gpipe, 1f1b, interleaved_1f1b): {lay.schedule} computes the weight gradients "
            "in a separate pass, after FSDP's post-backward hook would have resharded"
        )


@rule("batch", (*DP, "micro_batch_size"))  # global = micro x accumulation x data-parallel size
def batch(cfg, lay):
    dp, b, gb = lay.dp, lay.micro_batch_size, cfg.train.global_batch_size
    mbs = cfg.pipeline.microbatches
    if b >= 1 and gb % (b * dp):
        yield (
            f"train.global_batch_size={gb} must be divisible by "
            f"train.micro_batch_size={b} x data-parallel size {dp} (dp_replicate="
            f"{lay.dp_replicate} x dp_shard={lay.dp_shard}) = {b * dp}: "
            + batch_fix(gb, b, dp, mbs)
        )
    elif mbs and mbs * b * dp != gb:
        fix = gb // (b * dp) if b >= 1 else 0
        yield (
            f"pipeline.microbatches={mbs} x micro_batch_size={b} "
            f"x data-parallel size {dp} must equal global_batch_size={gb}"
            + (f": set pipeline.microbatches={fix} (or 0 to derive it)" if fix else "")
        )


# Warnings: placement and efficiency.
def _spans_nodes(axis: str, traffic: str) -> None:
    """Warn when `axis`'s groups are wider than a node: their `traffic` crosses the network."""

    @rule(f"{axis}_node", (axis,), warning=True)
    def check(cfg, lay):
        n, per_node = getattr(lay, axis), cfg.hardware.devices_per_node
        if n > per_node:
            yield f"{axis}={n} spans more than one node of {per_node} devices: {traffic}"


_spans_nodes("tp", "TP traffic crosses the network")
_spans_nodes("ep", "all-to-alls cross the network")


@rule("bubble", ("pp", *DP, *STAGES, "microbatches"), warning=True)
def bubble(cfg, lay):
    pp, sched, v = lay.pp, lay.schedule, lay.stages_per_rank
    # Only for a pipeline the error rules accept (an unknown schedule is a config error).
    if pp == 1 or sched not in SCHEDULES or v < 1 or lay.microbatches < 1:
        return
    fraction = pl.bubble_fraction(sched, pp, v, lay.microbatches)
    if fraction > 0.2:
        yield (
            f"pipeline bubble {fraction:.0%} of compute (schedule={sched}, pp={pp}, "
            f"micro-batches={lay.microbatches}): add micro-batches or stages_per_rank"
        )


# A recipe's recompute.every stays when recompute=none is chosen to compare against it: not
# an error, but recompute.every alone recomputes nothing, which a user should hear.
@rule("recompute_every", ("recompute", "recompute_every"), warning=True)
def recompute_every(cfg, lay):
    k = lay.recompute_every
    if lay.recompute == "none" and k > 1:
        yield (
            f"recompute.every={k} has no effect with recompute=none "
            f"(nothing recomputes): set recompute=full, op or selective to recompute blocks "
            f"0, {k}, {2 * k}, ..., or recompute.every=1"
        )


@rule("recompute_matmuls", ("recompute", "recompute_matmuls"))
def recompute_matmuls(cfg, lay):
    kind = alternate_unpriced(cfg.model)
    if lay.recompute_matmuls == "alternate" and lay.recompute == "op" and kind:
        yield (
            f"recompute.matmuls=alternate keeps every other matmul of a block with attention "
            f"and MLP projections only; {_model(cfg)} has {kind}, whose matmuls the planner "
            f"does not count one by one: use recompute.matmuls=all"
        )


@rule("recompute_matmuls_mode", ("recompute", "recompute_matmuls"), warning=True)
def recompute_matmuls_mode(cfg, lay):
    if lay.recompute_matmuls == "alternate" and lay.recompute != "op":
        yield (
            f"recompute.matmuls=alternate has no effect with recompute={lay.recompute} (it "
            f"chooses which matmul outputs recompute=op keeps): set recompute=op"
        )


@rule("micro_batch", ("cp", "micro_batch_size"), warning=True)
def micro_batch(cfg, lay):
    tokens = cfg.train.seq_len // max(1, lay.cp)
    if cfg.hardware.device_type.value == "cuda" and lay.micro_batch_size * tokens < 1024:
        yield (
            f"micro-batch of {lay.micro_batch_size} x {tokens} "
            "tokens per rank is too small to keep a GPU busy"
        )


def layout_problems(cfg: Config, lay) -> tuple[list[Problem], list[Problem]]:
    """Divisibility, pipeline and batch rules of one layout (LAYOUT_RULES); returns (errors,
    warnings). The bubble warning only for a layout without errors."""
    errors = [
        Problem(r.name, msg) for r in LAYOUT_RULES if not r.warning for msg in r.check(cfg, lay)
    ]
    warnings = [
        Problem(r.name, msg)
        for r in LAYOUT_RULES
        if r.warning and not (errors and r.name == "bubble")
        for msg in r.check(cfg, lay)
    ]
    return errors, warnings


def batch_fix(global_batch: int, micro: int, dp: int, microbatches: int = 0) -> str:
    """What to set so that global = micro x accumulation x dp, in words: the nearest larger
    global batch that works, or the largest smaller micro-batch that divides it."""
    step = micro * dp
    target = microbatches * step if microbatches > 0 else -(-global_batch // step) * step
    fix = f"set train.global_batch_size={target}"
    if microbatches <= 0:
        fix += f" (or another multiple of {step})"
    smaller = [
        m
        for m in range(micro - 1, 0, -1)
        if global_batch % (m * dp) == 0 and microbatches in (0, global_batch // (m * dp))
    ]
    return fix + (f" or train.micro_batch_size={smaller[0]}" if smaller else "")


# The Layout fields each layout rule reads, from the rules themselves.
FIELDS_READ: dict[str, tuple[str, ...]] = {r.name: r.reads for r in LAYOUT_RULES}


def reads_any(problem: Problem, degrees) -> bool:
    """Whether the rule behind `problem` reads any of `degrees` (see FIELDS_READ)."""
    return bool(set(FIELDS_READ.get(problem.rule, AXES)) & set(degrees))


def readers(name: str) -> list[str]:
    """The layout rules and engine limitations that read a Layout field, by name."""
    found = [r.name for r in LAYOUT_RULES if name in r.reads]
    return found + [x.name for x in LIMITATIONS if name in x.reads]


NOT_AVAILABLE = "not_available"  # the rule of every engine limitation's problem


def engine_problems(cfg: Config, lay) -> list[Problem]:
    """What the planner accepts but launcher.train cannot run yet, refused by name: the
    limitations of launcher/plan/limitations.py that apply to this layout."""
    return [Problem(NOT_AVAILABLE, message) for _, message in refusals(cfg, lay)]
