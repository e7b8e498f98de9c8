"""The rules a run must satisfy. Each broken rule becomes a Problem naming values and rule.

Three sets: `config_problems` (model, training, precision, data: independent of the layout),
`layout_problems` (degrees, divisibility, pipeline, batch: evaluated for every searched
layout, so kept cheap) and `engine_problems` (what `launcher.train` cannot run yet: the
records of launcher/limitations.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import Config, DType, ParallelConfig
from launcher.data import data_sizes, split_sizes
from launcher.layout import AXES, LOOPED, SCHEDULES, SINGLE, SPLIT_BACKWARD, V_SCHEDULES
from launcher.limitations import refusals
from launcher.plan import pipeline as pl


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
    m, t, hw, prec = cfg.model, cfg.train, cfg.hardware, cfg.precision
    name = f"model={m.name}"
    from launcher.plan.model_size import FAMILIES

    if m.family not in FAMILIES:
        err("model", f"model.family={m.family} is not one of {', '.join(FAMILIES)}")
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
        if getattr(m, key) < 1:
            err("model", f"model.{key}={getattr(m, key)} must be >= 1 ({name})")
    if errors:
        return errors
    if m.head_dim is None and m.dim % m.n_heads:
        err("model", f"model.dim={m.dim} must be divisible by n_heads={m.n_heads} ({name})")
    if m.n_heads % m.n_kv_heads:
        err(
            "model", f"n_heads={m.n_heads} must be a multiple of n_kv_heads={m.n_kv_heads} ({name})"
        )
    if m.n_routed_experts and (not 1 <= m.top_k <= m.n_routed_experts or m.moe_ffn_dim < 1):
        err(
            "model",
            f"an MoE needs 1 <= top_k={m.top_k} <= n_routed_experts="
            f"{m.n_routed_experts} and moe_ffn_dim={m.moe_ffn_dim} >= 1 ({name})",
        )
    if m.n_routed_experts and not 0 <= m.n_dense_layers < m.n_layers:
        err(
            "model",
            f"model.n_dense_layers={m.n_dense_layers} must be in [0, n_layers={m.n_layers}): "
            f"the layers after the first n_dense_layers are the MoE ones ({name})",
        )
    if m.family == "deepseek" and not (m.kv_lora_rank and m.qk_rope_head_dim and m.v_head_dim):
        err("model", f"deepseek (MLA) needs kv_lora_rank, qk_rope_head_dim and v_head_dim ({name})")
    if m.n_routed_experts:
        errors.extend(_routing_problems(m, name))
    if m.rope_yarn_factor > 1 and m.family != "deepseek":
        err(
            "model",
            f"model.rope_yarn_factor={m.rope_yarn_factor:g}: YaRN RoPE is deepseek's "
            f"({name} is {m.family}; Llama 3 scaling is rope_scaling_factor)",
        )
    if not 0 <= m.dropout < 1:
        err("model", f"model.dropout={m.dropout} must be in [0, 1)")

    for key in ("global_batch_size", "micro_batch_size", "seq_len", "steps"):
        if getattr(t, key) < 1:
            err("train", f"train.{key}={getattr(t, key)} must be >= 1")
    if t.seq_len > m.max_seq_len:
        err("seq_len", f"train.seq_len={t.seq_len} exceeds max_seq_len={m.max_seq_len} ({name})")
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        err("lr", f"need 0 <= train.min_lr={t.min_lr} <= train.lr={t.lr} and lr > 0")
    if t.warmup_steps < 0:
        err("schedule", f"train.warmup_steps={t.warmup_steps} must be >= 0")
    for key in ("eval_interval", "grad_clip", "weight_decay"):
        if getattr(t, key) < 0:
            err("train", f"train.{key}={getattr(t, key)} must be >= 0")
    if t.max_restarts < 0:
        err("train", f"train.max_restarts={t.max_restarts} must be >= 0")
    if t.timeout_s <= 0:
        err("train", f"train.timeout_s={t.timeout_s} must be > 0")
    for key in ("interval", "keep"):
        if getattr(cfg.checkpoint, key) < 0:
            err("checkpoint", f"checkpoint.{key}={getattr(cfg.checkpoint, key)} must be >= 0")
    ck = cfg.checkpoint
    if ck.initial_load_weights_only and not ck.initial_load_path:
        err("checkpoint", "checkpoint.initial_load_weights_only=true needs initial_load_path")
    if ck.initial_load_format.value == "hf" and not ck.initial_load_path:
        err("checkpoint", "checkpoint.initial_load_format=hf needs initial_load_path=HF_DIR")
    if t.eval_interval and t.eval_batches < 1:
        err("train", f"train.eval_batches={t.eval_batches} must be >= 1 when evaluating")
    data = _data_sizes(cfg.data.path, err)
    val_fraction = cfg.data.val_fraction
    source = "the embedded corpus" if cfg.data.path is None else f"data.path={cfg.data.path}"
    if data is not None and m.vocab_size < data[1]:
        err(
            "vocab",
            f"model.vocab_size={m.vocab_size} is smaller than the vocabulary of {source}, "
            f"{data[1]:,} tokens ({name}): set model.vocab_size >= {data[1]}",
        )
    if not 0 < val_fraction < 1:
        err("data", f"data.val_fraction={val_fraction} must be in (0, 1)")
    elif data is not None and t.seq_len >= 1:
        try:
            split_sizes(data[0], t.seq_len, val_fraction)
        except ValueError as e:
            err("data_size", f"{source}: {e}")
    if cfg.data_parallel.zero_stage not in (0, 1, 2, 3):
        err("zero_stage", f"data_parallel.zero_stage={cfg.data_parallel.zero_stage} must be 0-3")
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
    if prec.compute_dtype != prec.param_dtype:
        err(
            "precision",
            f"precision.compute_dtype={prec.compute_dtype.value} must equal "
            f"param_dtype={prec.param_dtype.value}: forward runs in the parameters' dtype",
        )
    for key in ("nodes", "devices_per_node"):
        if getattr(hw, key) < 1:
            err("hardware", f"hardware.{key}={getattr(hw, key)} must be >= 1")
    for key in ("memory_gib", "peak_tflops", "intra_node_gbps", "inter_node_gbps", "storage_gbps"):
        if getattr(hw, key) <= 0:
            err("hardware", f"hardware.{key}={getattr(hw, key)} must be > 0")
    if hw.efficiency_scale <= 0:
        err(
            "hardware",
            f"hardware.efficiency_scale={hw.efficiency_scale} must be > 0 (this generation's "
            "compute efficiency relative to the A100 fit)",
        )
    rc = cfg.recompute
    if rc.every < 1:
        err("recompute", f"recompute.every={rc.every} must be >= 1 (1: every block)")
    if not 0 <= hw.efficiency <= 1:
        err(
            "hardware",
            f"hardware.efficiency={hw.efficiency} must be in [0, 1] (a fraction of "
            "peak_tflops; 0: the Megatron-LM fit)",
        )
    return errors


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


def layout_problems(cfg: Config, lay) -> tuple[list[Problem], list[Problem]]:
    """Divisibility, pipeline and batch rules of one layout; returns (errors, warnings)."""
    errors: list[Problem] = []
    warnings: list[Problem] = []
    err = lambda rule, msg: errors.append(Problem(rule, msg))
    m, t, hw = cfg.model, cfg.train, cfg.hardware
    name = f"model={m.name}"
    tp, pp, cp, ep = lay.tp, lay.pp, lay.cp, lay.ep

    if tp > 1:
        heads = m.n_heads
        if heads % tp:
            err("tp_heads", f"tp={tp} must divide n_heads={heads} ({name})")
        kv = m.n_heads if m.kv_lora_rank else m.n_kv_heads
        if kv % tp and heads % tp == 0:
            err(
                "tp_kv_heads",
                f"tp={tp} must divide n_kv_heads={kv} ({name}): kv heads are "
                "sharded across tp ranks, never replicated, so tp may not exceed them",
            )
        dense_mlp = not m.n_routed_experts or m.n_dense_layers
        if dense_mlp and m.ffn_dim % tp:
            err("tp_ffn", f"tp={tp} must divide ffn_dim={m.ffn_dim} ({name})")
        if m.vocab_size % tp:
            err("tp_vocab", f"tp={tp} must divide vocab_size={m.vocab_size} ({name})")
    seq_cp = t.seq_len // cp if t.seq_len % cp == 0 else None
    if lay.sequence_parallel and tp > 1 and (seq_cp is None or seq_cp % tp):
        err(
            "sp_seq",
            f"train.seq_len={t.seq_len} must be divisible by tp={tp} x cp={cp} "
            "with tensor.sequence_parallel=true (each tp rank holds a slice of the sequence)",
        )
    if tp > 1 and m.n_routed_experts and t.seq_len % tp:
        err(
            "tp_routed_seq",
            f"train.seq_len={t.seq_len} must be divisible by tp={tp} with routed experts: "
            "each tp rank routes its own slice of every sequence",
        )
    if cp > 1:
        chunks = 2 * cp if cfg.context.load_balance else cp
        if t.seq_len % chunks:
            why = "2 x cp load-balanced chunks" if cfg.context.load_balance else "cp chunks"
            err(
                "cp_seq",
                f"train.seq_len={t.seq_len} must be divisible by {chunks} ({why}, cp={cp})",
            )
    if ep > 1:
        if not m.n_routed_experts:
            err("ep_dense", f"ep={ep} needs routed experts; {name} is dense")
        elif m.n_routed_experts % ep:
            err("ep_experts", f"ep={ep} must divide n_routed_experts={m.n_routed_experts} ({name})")
        borrow = lay.dp_shard * cp * tp
        if borrow % ep:
            err(
                "ep_degree",
                f"ep={ep} must divide dp_shard x cp x tp = {lay.dp_shard} x {cp} x "
                f"{tp} = {borrow}: expert-parallel ranks are carved from those",
            )

    # Pipeline: stages, schedule shape, micro-batches.
    v = lay.stages_per_rank
    sched = lay.schedule
    if v < 1:
        err("pp_stages", f"pipeline.stages_per_rank={v} must be >= 1")
    elif sched in V_SCHEDULES and v != 2:  # with pp = 1 too: the V is then one rank's
        err(
            "pp_stages",
            f"pipeline.schedule={sched} places exactly 2 stages per rank in a V; "
            f"got pipeline.stages_per_rank={v}",
        )
    elif pp > 1:
        if sched in LOOPED and v < 2:
            err(
                "pp_stages",
                f"pipeline.schedule={sched} needs pipeline.stages_per_rank >= 2 "
                f"(got {v}); use 1f1b for one stage per rank",
            )
        elif sched in SINGLE and v != 1:
            err(
                "pp_stages",
                f"pipeline.schedule={sched} runs one stage per rank; got "
                f"pipeline.stages_per_rank={v} (use interleaved_1f1b)",
            )
        split = lay.stage_layers
        if split and (len(split) != pp * v or sum(split) != m.n_layers or min(split) < 1):
            err(
                "pp_split",
                f"layers per stage {list(split)} (pipeline.first_stage_layers="
                f"{cfg.pipeline.first_stage_layers}, last_stage_layers="
                f"{cfg.pipeline.last_stage_layers}, layers_per_stage="
                f"{list(cfg.pipeline.layers_per_stage)}) must give each of the pp x "
                f"stages_per_rank = {pp * v} stages at least one layer and sum to "
                f"n_layers={m.n_layers} ({name})",
            )
        if pp * v > m.n_layers:
            err(
                "pp_layers",
                f"pp={pp} x stages_per_rank={v} = {pp * v} stages need at least one "
                f"layer each; {name} has n_layers={m.n_layers}",
            )
        mb = lay.microbatches
        if mb < pp:
            err(
                "pp_microbatches",
                f"{mb} micro-batches per step are fewer than pp={pp} stages: "
                "the pipeline never fills (raise train.global_batch_size or lower "
                "train.micro_batch_size)",
            )
        elif sched == "dualpipev" and mb < 2 * pp:
            err(
                "pp_microbatches",
                f"pipeline.schedule=dualpipev needs at least one micro-batch per stage "
                f"(2 x pp = {2 * pp}); got {mb}",
            )
        elif sched in LOOPED and mb % pp:
            err(
                "pp_microbatches",
                f"pipeline.schedule={sched} needs the micro-batches per step "
                f"({mb}) to be a multiple of pp={pp}",
            )
    elif v != 1 and sched not in V_SCHEDULES:
        err("pp_stages", f"pipeline.stages_per_rank={v} needs pp > 1")
    if lay.reshard_each_microbatch:
        if pp == 1 or lay.zero_stage < 2 or lay.dp_shard * cp == 1:
            err(
                "pp_reshard",
                "pipeline.reshard_each_microbatch=true applies to FSDP or ZeRO-2 under a "
                f"pipeline (pp > 1, data_parallel zero_stage >= 2, dp_shard > 1); got pp={pp}, "
                f"zero_stage={lay.zero_stage}, dp_shard={lay.dp_shard}",
            )
        elif sched in SPLIT_BACKWARD:
            err(
                "pp_reshard",
                "pipeline.reshard_each_microbatch=true needs a schedule with a full backward "
                f"(gpipe, 1f1b, interleaved_1f1b): {sched} computes the weight gradients in a "
                "separate pass, after FSDP's post-backward hook would have resharded",
            )

    # Batch: global = micro x accumulation x data-parallel size.
    dp, b = lay.dp, lay.micro_batch_size
    if b >= 1 and t.global_batch_size % (b * dp):
        err(
            "batch",
            f"train.global_batch_size={t.global_batch_size} must be divisible by "
            f"train.micro_batch_size={b} x data-parallel size {dp} (dp_replicate="
            f"{lay.dp_replicate} x dp_shard={lay.dp_shard}) = {b * dp}: "
            + batch_fix(t.global_batch_size, b, dp, cfg.pipeline.microbatches),
        )
    elif cfg.pipeline.microbatches and cfg.pipeline.microbatches * b * dp != t.global_batch_size:
        fix = t.global_batch_size // (b * dp) if b >= 1 else 0
        err(
            "batch",
            f"pipeline.microbatches={cfg.pipeline.microbatches} x micro_batch_size={b} "
            f"x data-parallel size {dp} must equal global_batch_size={t.global_batch_size}"
            + (f": set pipeline.microbatches={fix} (or 0 to derive it)" if fix else ""),
        )

    # Warnings: placement and efficiency.
    if tp > hw.devices_per_node:
        warnings.append(
            Problem(
                "tp_node",
                f"tp={tp} spans more than one node of "
                f"{hw.devices_per_node} devices: TP traffic crosses the network",
            )
        )
    if ep > hw.devices_per_node:
        warnings.append(
            Problem(
                "ep_node",
                f"ep={ep} spans more than one node of "
                f"{hw.devices_per_node} devices: all-to-alls cross the network",
            )
        )
    if pp > 1 and not errors and sched in SCHEDULES:  # an unknown one is a config error
        bubble = pl.bubble_fraction(sched, pp, v, lay.microbatches)
        if bubble > 0.2:
            warnings.append(
                Problem(
                    "bubble",
                    f"pipeline bubble {bubble:.0%} of compute "
                    f"(schedule={sched}, pp={pp}, micro-batches="
                    f"{lay.microbatches}): add micro-batches or stages_per_rank",
                )
            )
    # A recipe's recompute.every stays when recompute=none is chosen to compare against it:
    # not an error, but recompute.every alone recomputes nothing, which a user should hear.
    if lay.recompute == "none" and lay.recompute_every > 1:
        k = lay.recompute_every
        warnings.append(
            Problem(
                "recompute_every",
                f"recompute.every={k} has no effect with recompute=none "
                f"(nothing recomputes): set recompute=full, op or selective to recompute blocks "
                f"0, {k}, {2 * k}, ..., or recompute.every=1",
            )
        )
    if hw.device_type.value == "cuda" and b * t.seq_len // max(1, cp) < 1024:
        warnings.append(
            Problem(
                "micro_batch",
                f"micro-batch of {b} x {t.seq_len // max(1, cp)} "
                "tokens per rank is too small to keep a GPU busy",
            )
        )
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


# The degrees each layout rule (and warning) reads. While a degree is unresolved
# (parallel.dp_shard=-1 that does not divide the world, or a degree below 1) make_plan still
# checks, with 1 in its place, the rules that read none of the unresolved ones. A rule missing
# here counts as reading every degree.
DP = ("dp_replicate", "dp_shard")
DEGREES_READ: dict[str, tuple[str, ...]] = {
    "tp_heads": ("tp",),
    "tp_kv_heads": ("tp",),
    "tp_ffn": ("tp",),
    "tp_vocab": ("tp",),
    "sp_seq": ("tp", "cp"),
    "cp_seq": ("cp",),
    "ep_dense": ("ep",),
    "ep_experts": ("ep",),
    "ep_degree": ("ep", "dp_shard", "cp", "tp"),
    "pp_stages": ("pp",),
    "pp_split": ("pp",),
    "pp_layers": ("pp",),
    "pp_microbatches": ("pp", *DP),  # micro-batches per step: global / (micro x dp)
    "pp_reshard": ("pp", "dp_shard", "cp"),
    "batch": DP,
    "tp_node": ("tp",),
    "ep_node": ("ep",),
    "bubble": ("pp", *DP),
    "micro_batch": ("cp",),
    "recompute_every": (),
}


def reads_any(problem: Problem, degrees) -> bool:
    """Whether the rule behind `problem` reads any of `degrees` (see DEGREES_READ)."""
    return bool(set(DEGREES_READ.get(problem.rule, AXES)) & set(degrees))


def engine_problems(cfg: Config, lay) -> list[Problem]:
    """What the planner accepts but launcher.train cannot run yet, refused by name: the
    limitations of launcher/limitations.py that apply to this layout."""
    return [Problem("not_available", message) for _, message in refusals(cfg, lay)]
