"""The plan as text (rich tables) or as one JSON object, and its problems as one message."""

from __future__ import annotations

import dataclasses

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from launcher.data.sources import document_attention
from launcher.layout import AXES, MESH_DIMS, SCHEDULES, axis_rows
from launcher.plan import Plan
from launcher.plan import bubble as pl
from launcher.plan.checkpoint_size import CheckpointSize, checkpoint_size
from launcher.plan.memory import GIB


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f} GiB"


def _size(x: float) -> str:
    """GiB, or MiB below one GiB (a debug model's checkpoint is a few MiB)."""
    return _gib(x) if x >= GIB else f"{x / 2**20:,.1f} MiB"


def plan_checkpoint(plan: Plan) -> CheckpointSize | None:
    """What one checkpoint save of this plan writes (None when the plan has no layout)."""
    if plan.context is None or plan.layout is None:
        return None
    return checkpoint_size(plan.context, plan.layout)


def mesh_rows(plan: Plan) -> list[tuple[str, str]]:
    """For each mesh dimension: its size, and whether its groups stay inside a node."""
    per_node = plan.cfg.hardware.devices_per_node
    rows, stride = [], 1
    if per_node < 1:
        return rows  # no node to place them in: the hardware rule names it
    for dim in reversed(MESH_DIMS):  # innermost (tp) first: consecutive ranks
        size = plan.degrees[dim]
        if size < 1:
            break  # unresolved: the dimensions outside it have unknown strides
        if size > 1:
            span = (size - 1) * stride + 1
            if span <= per_node and per_node % (size * stride) == 0:
                where = "inside one node"
            else:
                nodes = size if stride >= per_node else -(-span // per_node)
                where = f"across {nodes} nodes"
            members = ", ".join(str(r * stride) for r in range(min(size, 4)))
            more = ", ..." if size > 4 else ""
            rows.append(
                (dim, f"{size} ranks {stride} apart (rank 0 with {members}{more}); {where}")
            )
        stride *= size
    if plan.degrees["ep"] > 1:
        ep = plan.degrees["ep"]
        where = "inside one node" if ep <= per_node else f"across {-(-ep // per_node)} nodes"
        rows.append(("ep", f"{ep} consecutive ranks carved from dp_shard x cp x tp; {where}"))
    return rows


def precision_line(cfg) -> str:
    """The precision row: the preset's name, its compute and master dtypes and, under
    precision.fp8, which matmuls run in float8 and how the plan prices them."""
    prec = cfg.precision
    line = f"{prec.name} (compute {prec.compute_dtype.value}, master {prec.master_dtype.value})"
    if prec.fp8.value == "none":
        return line
    hw = cfg.hardware
    if hw.device_type.value == "cpu" or hw.peak_tflops_fp8 <= 0:
        priced = "emulated: their GEMMs at the usual rate, their casts paid"
    else:
        priced = (
            f"their GEMMs at the FP8 peak ({hw.peak_tflops_fp8:g} TFLOP/s, "
            f"efficiency_scale_fp8 {hw.efficiency_scale_fp8:g}), their casts as memory traffic"
        )
    return (
        f"{line}\nthe blocks' linear layers in float8 ({prec.fp8.value} scales; {priced}); "
        "embeddings, output, norms, router and grouped experts in "
        f"{prec.compute_dtype.value}, as are FSDP's gathers and TP's collectives; activations "
        f"kept in {prec.compute_dtype.value} (torchao saves the linears' inputs unconverted)"
    )


def data_line(u, steps: int) -> str:
    """One training source: its tokens, its weight, and how often the run reads it."""
    name = u.label.split("=", 1)[-1]  # the path, without data.path= or data.sources[i].path=
    files = f" ({u.files} files)" if u.files > 1 else ""
    weight = f", weight {u.weight:.3g}" if u.weight < 1 else ""
    chat, c = "", u.chat
    if c is not None:  # a chat set: what its loss is taken on, and how its windows hold it
        said = {"truncated": "cut to a window", "dropped": "too long, dropped"}
        left = [f", {c[k]:,} {what}" for k, what in said.items() if c[k]]
        chat = (
            f" ({c['trained_tokens']:,} trained on: the answers), {c['conversations']:,} "
            f"conversations in {c['windows']:,} windows{''.join(left)}"
        )
    return (
        f"{name}{files}: {u.n_tokens:,} tokens{chat}{weight}, {u.epochs:.2g} epochs in "
        f"{steps} steps"
    )


def evaluation_line(cfg) -> str:
    """The named validation sets the run evaluates, and how often."""
    t = cfg.train
    sets = ", ".join(f"eval/{name} ({path})" for name, path in cfg.data.val_sources.items())
    if t.eval_interval <= 0:
        return f"{sets}: never (train.eval_interval=0)"
    return f"{sets}, every {t.eval_interval} steps, {t.eval_batches} global batches each"


def plan_table(plan: Plan) -> Group:
    cfg, t, hw = plan.cfg, plan.cfg.train, plan.cfg.hardware
    main = Table(title="plan", show_header=False, title_justify="left")
    main.add_column("what", style="bold")
    main.add_column("value")
    main.add_row("model", f"{cfg.model.name} ({cfg.model.family})")
    for choice, path in plan.config_files.items():  # the groups a user's directory supplied
        main.add_row("  config", escape(f"{choice} from {path}"))
    main.add_row(
        "hardware",
        f"{hw.name}: {hw.nodes} node(s) x {hw.devices_per_node} "
        f"{hw.device_type.value} = {plan.world_size} ranks, {hw.memory_gib:g} GiB each",
    )
    if hw.fitted:
        main.add_row("  fitted", escape(hw.fitted))
    main.add_row("degrees", "  ".join(f"{a}={plan.degrees[a]}" for a in AXES))
    for dim, text in mesh_rows(plan):
        main.add_row(f"  mesh {dim}", text)
    if plan.layout is not None:  # what the engine builds, from its own Layout
        for name, text in axis_rows(plan.layout).items():
            main.add_row(name, text)
    else:
        main.add_row("data parallel", plan.data_parallel_strategy)
        main.add_row("recompute", cfg.recompute.mode.value)
    main.add_row("precision", precision_line(cfg))
    if plan.data:
        main.add_row("data", "\n".join(data_line(u, cfg.train.steps) for u in plan.data))
    if document_attention(cfg):
        main.add_row(
            "attention",
            "document masking: a token attends within its own document (the kernels compute "
            "the causal square; FLOPs counted as causal)",
        )
    if cfg.data.val_sources:  # the default (each source's held-out tail) goes unsaid
        main.add_row("evaluation", evaluation_line(cfg))
    lay = plan.layout
    if lay is not None:
        main.add_row(
            "batch",
            f"global {t.global_batch_size} seqs = micro {lay.micro_batch_size} "
            f"x accumulation {lay.microbatches} x dp {lay.dp}; seq_len {t.seq_len}; "
            f"{t.global_batch_size * t.seq_len:,} tokens/step",
        )
        if (
            lay.pp > 1
            and lay.schedule in SCHEDULES
            and min(lay.stages_per_rank, lay.microbatches) >= 1
        ):
            shape = (lay.schedule, lay.pp, lay.stages_per_rank, lay.microbatches)
            main.add_row(
                "  pipeline",
                f"{lay.microbatches} micro-batches per step through "
                f"{lay.pp * lay.stages_per_rank} stages; bubble {pl.bubble_fraction(*shape):.1%} "
                f"of compute; rank 0 holds {pl.inflight_microbatches(*shape):g} micro-batches' "
                "activations at its peak",
            )
    ctx = plan.context
    if ctx is not None:
        s = ctx.shape
        ahead = f" ({s.ahead:,} of them multi-token prediction's)" if s.ahead_layers else ""
        main.add_row(
            "parameters",
            f"{s.total:,} total{ahead}, {ctx.active_params:,.0f} active matmul weights per token",
        )
        main.add_row("FLOPs/token", f"{ctx.model_flops_per_token:.4g} (6N + causal attention)")
        if ctx.moe:
            main.add_row("experts", experts_line(ctx))
    m = plan.memory
    if plan.estimate is not None and not plan.valid:
        main.add_row(
            "estimate",
            "of the layout as configured, which breaks the rules below: indicative only",
            style="yellow",
        )
    if m is not None:
        main.add_row(
            f"memory (pp rank {m.rank})",
            f"params {_gib(m.params)}, grads {_gib(m.grads)}, master {_gib(m.master)}, "
            f"optimizer {_gib(m.optimizer)}, activations {_gib(m.activations)}, "
            f"other {_gib(m.other)}",
        )
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        verdict += "" if plan.valid else " (invalid layout)"
        low, high = plan.estimate.memory_band
        main.add_row(
            "  total",
            f"{_gib(m.total)} of {hw.memory_gib:g} GiB, band {low / GIB:,.2f}-{high / GIB:,.2f}:"
            f" {verdict}",
        )
        main.add_row("  at start", f"{_gib(m.start)} before the first step (parameters as built)")
    est = plan.estimate
    if est is not None and est.time is not None:
        tm = est.time
        main.add_row("step time", f"{tm.step:.4g} s = " + time_sum(tm))
        main.add_row(
            "throughput",
            f"{est.tokens_per_s_per_device:,.0f} tokens/s per device, MFU {est.mfu:.1%}",
        )
        b = est.band
        main.add_row(
            "  band",
            f"step {b.step_s[0]:.4g}-{b.step_s[1]:.4g} s, {b.tokens_per_s[0]:,.0f}-"
            f"{b.tokens_per_s[1]:,.0f} tokens/s per device: the 90% interval of "
            f"{b.speed_from}; memory from {b.memory_from}",
        )
    ck = plan_checkpoint(plan)
    if ck is not None:
        main.add_row(
            "checkpoint",
            f"{_size(ck.total)} in total, {_size(ck.rank)} on the most loaded rank, "
            f"{_size(ck.node)} on the most loaded node; save ~{ck.save_seconds:.3g} s at "
            f"{ck.storage_gbps:g} GB/s per node",
        )
    for w in plan.warnings:
        main.add_row("warning", escape(str(w)), style="yellow")
    for e in plan.errors:
        main.add_row("error", escape(str(e)), style="red")
    return Group(main)


def print_plan(plan: Plan, console: Console | None = None) -> None:
    # A log file gets a fixed width, not the 80 columns rich assumes without a terminal.
    console = console or Console(width=None if Console().is_terminal else 110)
    console.print(plan_table(plan))


def problems_message(plan: Plan) -> str:
    n = len(plan.errors)
    lines = [f"the plan has {n} problem{'s' if n > 1 else ''}:"]
    lines += [f"  - {p}" for p in plan.errors]
    return "\n".join(lines)


def experts_line(ctx) -> str:
    """How the engine will run the routed experts (launcher/models/expert_kernel.py)."""
    m = ctx.model
    head = f"{m.n_routed_experts} routed (top {m.top_k}) per MoE layer: "
    if ctx.expert_loop:
        return head + f"one at a time, {ctx.expert_loop}"
    return head + "one grouped matmul per weight stack"


def experts_json(ctx) -> dict | None:
    if ctx is None or not ctx.moe:
        return None
    return {"kernel": "loop" if ctx.expert_loop else "grouped", "why": ctx.expert_loop}


def memory_json(m, capacity_gib: float) -> dict:
    """A Memory in GiB ("optimizer" includes the master weights)."""
    return {
        "params": m.params / GIB,
        "grads": m.grads / GIB,
        "optimizer": (m.master + m.optimizer) / GIB,
        "activations": m.activations / GIB,
        "other": m.other / GIB,
        "total": m.total / GIB,
        "start": m.start / GIB,
        "capacity": capacity_gib,
    }


def time_sum(tm) -> str:
    """The step's terms as a sum: "compute 16.9 + tp 1.44 + pp 4.3 (bubble 23.4%) + ..."."""
    parts = []
    for t in tm.terms:
        part = f"{t.name} {t.exposed:.3g}"
        if t.name == "pp":
            part += f" (bubble {tm.bubble_fraction:.1%})"
        if t.hidden > 0 and t.exposed < t.work:
            part += f" (of {t.work:.3g}, hidden by {t.overlaps})"
        parts.append(part)
    return " + ".join(parts)


def predicted_json(est) -> dict:
    return {
        "step_time_s": est.time.step,
        "tokens_per_s_per_device": est.tokens_per_s_per_device,
        "mfu": est.mfu,
        "bubble_fraction": est.time.bubble_fraction,
        "band": band_json(est),
        # Each cost term: seconds it adds to the step, seconds of its work before overlap.
        "terms": {
            t.name: {"exposed_s": t.exposed, "work_s": t.work, "overlaps": t.overlaps}
            for t in est.time.terms
        },
    }


def band_json(est) -> dict:
    """Each figure's low and high (launcher/plan/bands.py) and the runs they come from."""
    b = est.band
    return {
        "step_time_s": list(b.step_s),
        "tokens_per_s_per_device": list(b.tokens_per_s),
        "memory_gib": [x / GIB for x in b.memory],
        "speed_from": b.speed_from,
        "memory_from": b.memory_from,
    }


def estimate_json(est, capacity_gib: float) -> dict:
    """One searched layout: its degrees, settings, memory and predicted speed."""
    return {
        "degrees": est.layout.degrees,
        "layout": layout_json(est.layout),
        "memory_gib": memory_json(est.memory, capacity_gib),
        "predicted": predicted_json(est),
    }


def checkpoint_json(ck: CheckpointSize) -> dict:
    return {
        "total_bytes": round(ck.total),
        "rank_bytes": round(ck.rank),
        "node_bytes": round(ck.node),
        "save_seconds": ck.save_seconds,
        "storage_gbps": ck.storage_gbps,
    }


def plan_json(plan: Plan) -> dict:
    """The plan as the JSON object `plan.format=json` prints."""
    m, est, ctx, ck = plan.memory, plan.estimate, plan.context, plan_checkpoint(plan)
    params = None
    if ctx is not None:
        params = {
            "total": ctx.shape.total,
            "multi_token_prediction": ctx.shape.ahead,  # of the total
            "active": round(ctx.active_params),
            "per_device": round(m.params / ctx.param_b) if m else None,
        }
    # Figures of a layout that breaks a rule are still given, marked: the layout as configured.
    invalid = {"from_invalid_layout": not plan.valid}
    return {
        "valid": plan.valid,
        "fits": plan.fits,
        "errors": [{"rule": p.rule, "message": p.message} for p in plan.errors],
        "warnings": [{"rule": p.rule, "message": p.message} for p in plan.warnings],
        "world_size": plan.world_size,
        "data": [vars(u) for u in plan.data],
        "degrees": {a: plan.degrees[a] for a in AXES},
        "layout": layout_json(plan.layout) if plan.layout else None,
        "params": params,
        "experts": experts_json(ctx),
        "memory_gib": {**memory_json(m, plan.cfg.hardware.memory_gib), **invalid} if m else None,
        "predicted": {**predicted_json(est), **invalid} if est is not None and est.time else None,
        "checkpoint": checkpoint_json(ck) if ck is not None else None,
        "config_files": plan.config_files,
    }


def layout_json(lay) -> dict:
    """Every setting of a Layout but its degrees (those are "degrees"), from its fields."""
    return {
        f.name: list(v) if isinstance(v := getattr(lay, f.name), tuple) else v
        for f in dataclasses.fields(lay)
        if f.name not in AXES
    }
