"""The rules a run must satisfy. Each broken rule becomes a Problem naming values and rule.

Three sets: `config_problems` (model, training, precision, data: independent of the layout),
`layout_problems` (degrees, divisibility, pipeline, batch: evaluated for every searched
layout, so kept cheap) and `engine_problems` (what `launcher.train` cannot run yet: the
records of launcher/plan/limitations.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from launcher.config import Config, DType, ParallelConfig
from launcher.data.batches import data_sizes, split_sizes
from launcher.data.sources import run_sources, validation_sources
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
from launcher.plan.limitations import refusals
from launcher.plan.ranges import range_problems
from models import families

PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Problem:
    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


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


def config_problems(cfg: Config) -> list[Problem]:
    """Rules on model, training, data, precision and hardware that no layout changes."""
    errors: list[Problem] = []
    err = lambda rule, msg: errors.append(Problem(rule, msg))
    m, t, prec = cfg.model, cfg.train, cfg.precision
    name = f"model={m.name}"
    if m.family not in families.FAMILIES:
        err("model", f"model.family={m.family} is not one of {', '.join(families.FAMILIES)}")
    if not PLAIN_NAME.fullmatch(m.name) or m.name.startswith("."):
        # The run directory is outputs/<model.name>-<hash>: a name never places it elsewhere.
        err(
            "model",
            f"model.name={m.name!r} must be a plain name (letters, digits, '.', '_', '-'; not "
            "starting with '.'): it names the run directory outputs/<model.name>-<hash>",
        )
    # Every value in its range first: the rules below divide by and compare these.
    for group, message in range_problems(cfg):
        err(group, message)
    if errors:
        return errors
    fam = families.of(m)
    if m.head_dim is None and m.dim % m.n_heads:
        err("model", f"model.dim={m.dim} must be divisible by n_heads={m.n_heads} ({name})")
    if m.n_heads % m.n_kv_heads:
        err(
            "model", f"n_heads={m.n_heads} must be a multiple of n_kv_heads={m.n_kv_heads} ({name})"
        )
    if bool(m.n_routed_experts) != fam.moe:
        err(
            "model",
            f"model.n_routed_experts={m.n_routed_experts}: a {m.family} model "
            + ("needs routed experts (>= 1)" if fam.moe else "has no routed experts")
            + f" (the MoE families: {families.named_with('moe')}; {name})",
        )
    if m.n_routed_experts and (not 1 <= m.top_k <= m.n_routed_experts or m.moe_ffn_dim < 1):
        err(
            "model",
            f"an MoE needs 1 <= top_k={m.top_k} <= n_routed_experts="
            f"{m.n_routed_experts} and moe_ffn_dim={m.moe_ffn_dim} >= 1 ({name})",
        )
    if m.n_routed_experts and m.n_dense_layers and not fam.first_dense_layers:
        err(
            "model",
            f"model.n_dense_layers={m.n_dense_layers}: every layer of a {m.family} model is an "
            f"MoE one (dense first layers: {families.named_with('first_dense_layers')})",
        )
    elif m.n_routed_experts and not 0 <= m.n_dense_layers < m.n_layers:
        err(
            "model",
            f"model.n_dense_layers={m.n_dense_layers} must be in [0, n_layers={m.n_layers}): "
            f"the layers after the first n_dense_layers are the MoE ones ({name})",
        )
    if fam.mla and not (m.kv_lora_rank and m.qk_rope_head_dim and m.v_head_dim):
        err(
            "model",
            f"{m.family} (MLA) needs kv_lora_rank, qk_rope_head_dim and v_head_dim ({name})",
        )
    if m.n_routed_experts:
        errors.extend(_routing_problems(m, name))
    if m.rope_yarn_factor > 1 and not fam.yarn:
        err(
            "model",
            f"model.rope_yarn_factor={m.rope_yarn_factor:g}: YaRN RoPE is "
            f"{families.named_with('yarn')}'s "
            f"({name} is {m.family}; Llama 3 scaling is rope_scaling_factor)",
        )

    if t.seq_len > m.max_seq_len:
        err("seq_len", f"train.seq_len={t.seq_len} exceeds max_seq_len={m.max_seq_len} ({name})")
    if t.min_lr > t.lr:
        err("lr", f"train.min_lr={t.min_lr} must be <= train.lr={t.lr}")
    ck = cfg.checkpoint
    if ck.initial_load_weights_only and not ck.initial_load_path:
        err("checkpoint", "checkpoint.initial_load_weights_only=true needs initial_load_path")
    if ck.initial_load_format.value == "hf" and not ck.initial_load_path:
        err("checkpoint", "checkpoint.initial_load_format=hf needs initial_load_path=HF_DIR")
    if t.eval_interval and t.eval_batches < 1:
        err("train", f"train.eval_batches={t.eval_batches} must be >= 1 when evaluating")
    if cfg.data.sources or cfg.data.val_sources:
        source_problems(cfg, err)
    else:
        data = _data_sizes(cfg.data.path, err)
        val_fraction = cfg.data.val_fraction
        source = "the embedded corpus" if cfg.data.path is None else f"data.path={cfg.data.path}"
        if data is not None and m.vocab_size < data[1]:
            err(
                "vocab",
                f"model.vocab_size={m.vocab_size} is smaller than the vocabulary of {source}, "
                f"{data[1]:,} tokens ({name}): set model.vocab_size >= {data[1]}",
            )
        if data is not None:
            try:
                split_sizes(data[0], t.seq_len, val_fraction)
            except ValueError as e:
                err("data_size", f"{source}: {e}")
    if cfg.pipeline.schedule not in SCHEDULES:
        err(
            "schedule",
            f"pipeline.schedule={cfg.pipeline.schedule} is not one of {', '.join(SCHEDULES)}",
        )

    dtypes = {
        k: getattr(prec, f"{k}_dtype") for k in ("compute", "param", "grad", "master", "optimizer")
    }
    fp16 = [f"precision.{k}_dtype" for k, v in dtypes.items() if v == DType.fp16]
    if fp16:
        err(
            "precision",
            f"{', '.join(fp16)}=fp16 needs loss scaling, which is not available; use bf16",
        )
    # bf16 moments beside fp32 master weights are upcast for each update (optim.py); the reverse
    # would keep fp32 moments for an update rounded to bf16 weights, and is not implemented.
    if (prec.master_dtype, prec.optimizer_dtype) == (DType.bf16, DType.fp32):
        err(
            "precision",
            "precision.optimizer_dtype=fp32 needs master_dtype=fp32 (got bf16): Adam moments "
            "may be narrower than the master weights, not wider; set one of them to match",
        )
    errors.extend(Problem("launch", msg) for msg in launch_problems(cfg))
    outside = [s for s in cfg.profile.steps if not 1 <= s <= t.steps]
    if outside:
        err(
            "profile",
            f"profile.steps={cfg.profile.steps}: {outside} not in 1..train.steps={t.steps}",
        )
    if cfg.profile.memory and not cfg.profile.steps:
        err("profile", "profile.memory=true needs profile.steps=[N, ...]: the steps to record")
    if prec.compute_dtype != prec.param_dtype:
        err(
            "precision",
            f"precision.compute_dtype={prec.compute_dtype.value} must equal "
            f"param_dtype={prec.param_dtype.value}: forward runs in the parameters' dtype",
        )
    return errors


def launch_problems(cfg: Config) -> list[str]:
    """A rendezvous a launcher can meet at, and a node range a run can go on over (torchrun's
    elastic mode with a rendezvous, a SLURM job's --nodes=MIN-MAX under hydra/launcher=slurm):
    a world that shrinks needs parallel.auto=true to re-plan, and under torchrun a restart to
    regroup."""
    la, nodes = cfg.launch, cfg.hardware.nodes
    out = []
    if la.rendezvous:
        host, _, port = la.rendezvous.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            out.append(f"launch.rendezvous={la.rendezvous} must be HOST:PORT (port 1-65535)")
    if la.min_nodes > nodes:
        out.append(f"launch.min_nodes={la.min_nodes} exceeds hardware.nodes={nodes}")
    elif 0 < la.min_nodes < nodes:
        elastic = f"launch.min_nodes={la.min_nodes} < hardware.nodes={nodes} (elastic)"
        if not cfg.parallel.auto:
            out.append(
                f"{elastic} needs parallel.auto=true: the group that goes on with fewer nodes "
                "re-plans its layout for them"
            )
        if la.rendezvous and cfg.train.max_restarts < 1:
            out.append(
                f"{elastic} needs train.max_restarts >= 1: a node that leaves fails the "
                "others' step, and torchrun restarts them into the smaller group"
            )
    return out


def _routing_problems(m, name: str) -> list[Problem]:
    """The router's settings (models/moe.py): a score function it has, and groups that split
    the experts evenly and leave top_k of them to choose from."""
    out = []
    if m.score_func not in ("softmax", "sigmoid"):
        out.append(f"model.score_func={m.score_func} is not softmax or sigmoid ({name})")
    elif m.score_func == "softmax" and m.n_group > 1:
        out.append(
            f"model.n_group={m.n_group} with score_func=softmax: the softmax router picks its "
            f"top_k greedily, group-limited routing is the sigmoid router's ({name})"
        )
    elif m.score_func == "sigmoid" and m.n_group > 1:
        if m.n_routed_experts % m.n_group:
            out.append(
                f"n_group={m.n_group} must divide n_routed_experts={m.n_routed_experts} ({name})"
            )
        elif not 1 <= m.topk_group <= m.n_group:
            out.append(f"need 1 <= topk_group={m.topk_group} <= n_group={m.n_group} ({name})")
        elif m.n_routed_experts // m.n_group < 2:
            out.append(
                f"n_group={m.n_group} groups of {m.n_routed_experts} experts: a group needs "
                f"two, its score is the sum of its two best ({name})"
            )
        elif m.topk_group * (m.n_routed_experts // m.n_group) < m.top_k:
            out.append(
                f"top_k={m.top_k} experts cannot come from topk_group={m.topk_group} groups of "
                f"{m.n_routed_experts // m.n_group} ({name})"
            )
    return [Problem("model", msg) for msg in out]


def source_problems(cfg: Config, err) -> None:
    """A blend's sources and the named validation sets: readable, agreeing on the tokenizer,
    in the model's vocabulary, each large enough for its windows (launcher.data.sources)."""
    m, t = cfg.model, cfg.train
    train, problems = run_sources(cfg.data)
    vals, more = validation_sources(cfg.data, train) if train else ([], [])
    for message in problems + more:
        err("data", message)
    if not train or more:
        return
    vocab = train[0].vocab_size
    if m.vocab_size < vocab:
        err(
            "vocab",
            f"model.vocab_size={m.vocab_size} is smaller than the vocabulary of the data "
            f"sources, {vocab:,} tokens (model={m.name}): set model.vocab_size >= {vocab}",
        )
    for s in train:
        try:
            split_sizes(s.n_tokens, t.seq_len, cfg.data.val_fraction)
        except ValueError as e:
            err("data_size", f"{s.label}: {e}")
    for v in vals:
        if v.n_tokens < t.seq_len + 1:
            err(
                "data_size",
                f"data.val_sources.{v.label}: n_tokens={v.n_tokens:,} is too few for one "
                f"window of train.seq_len + 1 = {t.seq_len + 1} tokens",
            )


def _data_sizes(path: str | None, err) -> tuple[int, int] | None:
    """(n_tokens, vocabulary size) of the run's data from its header; None, and a problem,
    when it cannot be read."""
    try:
        return data_sizes(path)
    except (OSError, ValueError, KeyError) as e:
        err(
            "data",
            f"data.path={path} is not a readable token file ({e}); build one with "
            "`python -m launcher.prepare --out PATH FILES...`",
        )
        return None


@dataclass(frozen=True)
class Rule:
    """One layout rule: its name (the Problem's), the degrees it reads, and its check, which
    yields a message per way the layout breaks it. While a degree is unresolved
    (parallel.dp_shard=-1 that does not divide the world, or a degree below 1) make_plan still
    checks, with 1 in its place, the rules that read none of the unresolved ones
    (tests/plan/test_rules.py holds each rule to the degrees it declares)."""

    name: str
    reads: tuple[str, ...]
    check: Callable[[Config, Layout], Iterable[str]]
    warning: bool = False


LAYOUT_RULES: list[Rule] = []
DP = ("dp_replicate", "dp_shard")


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


@rule("sp_seq", ("tp", "cp"))
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


@rule("pp_stages", ("pp",))
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


@rule("pp_split", ("pp",))
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


@rule("pp_layers", ("pp",))
def pp_layers(cfg, lay):
    pp, v, n = lay.pp, lay.stages_per_rank, cfg.model.n_layers
    if _pipelined(lay) and pp * v > n:
        yield (
            f"pp={pp} x stages_per_rank={v} = {pp * v} stages need at least one "
            f"layer each; {_model(cfg)} has n_layers={n}"
        )


@rule("pp_microbatches", ("pp", *DP))  # micro-batches per step: global / (micro x dp)
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


@rule("pp_reshard", ("pp", "dp_shard", "cp"))
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


@rule("batch", DP)  # global = micro x accumulation x data-parallel size
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


@rule("bubble", ("pp", *DP), warning=True)
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
@rule("recompute_every", (), warning=True)
def recompute_every(cfg, lay):
    k = lay.recompute_every
    if lay.recompute == "none" and k > 1:
        yield (
            f"recompute.every={k} has no effect with recompute=none "
            f"(nothing recomputes): set recompute=full, op or selective to recompute blocks "
            f"0, {k}, {2 * k}, ..., or recompute.every=1"
        )


@rule("recompute_matmuls", ())
def recompute_matmuls(cfg, lay):
    fam = families.of(cfg.model)
    if lay.recompute_matmuls == "alternate" and lay.recompute == "op" and (fam.moe or fam.mla):
        kind = "routed experts" if fam.moe else "multi-head latent attention"
        yield (
            f"recompute.matmuls=alternate keeps every other matmul of a block with attention "
            f"and MLP projections only; {_model(cfg)} has {kind}, whose matmuls the planner "
            f"does not count one by one: use recompute.matmuls=all"
        )


@rule("recompute_matmuls_mode", (), warning=True)
def recompute_matmuls_mode(cfg, lay):
    if lay.recompute_matmuls == "alternate" and lay.recompute != "op":
        yield (
            f"recompute.matmuls=alternate has no effect with recompute={lay.recompute} (it "
            f"chooses which matmul outputs recompute=op keeps): set recompute=op"
        )


@rule("micro_batch", ("cp",), warning=True)
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


# The degrees each layout rule reads, from the rules themselves.
DEGREES_READ: dict[str, tuple[str, ...]] = {r.name: r.reads for r in LAYOUT_RULES}


def reads_any(problem: Problem, degrees) -> bool:
    """Whether the rule behind `problem` reads any of `degrees` (see DEGREES_READ)."""
    return bool(set(DEGREES_READ.get(problem.rule, AXES)) & set(degrees))


NOT_AVAILABLE = "not_available"  # the rule of every engine limitation's problem


def engine_problems(cfg: Config, lay) -> list[Problem]:
    """What the planner accepts but launcher.train cannot run yet, refused by name: the
    limitations of launcher/plan/limitations.py that apply to this layout."""
    return [Problem(NOT_AVAILABLE, message) for _, message in refusals(cfg, lay)]
