"""`plan.search=true`: enumerate the layouts for a model, hardware and batch; rank those that fit.

The space: the degrees (degree_points: tp in powers of two inside a node, cp in chunks of at
least 1024 tokens, pp any divisor of what is left and at most the layers, HSDP or not, ep from
the ranks it borrows), then each layout option's search values, read from its record in
launcher/layout.py: ZeRO stage, micro-batch size, sequence parallelism (always on with tp > 1:
same traffic, less memory), the context-parallel method (all-gather or ring, where cp > 1), the
pipeline schedule and its stages per rank, and recompute, cheapest first (op keeping every other
matmul's output between op and full, where the blocks allow it). Dominated points are skipped
rather than evaluated: gpipe (1F1B's bubble, more memory), ZeRO-0 (ZeRO-1's traffic, more
memory), a costlier recompute once a cheaper one fits, and the time of a layout whose memory
does not fit.
"""

from __future__ import annotations

import json
from dataclasses import fields

from rich.console import Console
from rich.table import Table

from launcher.config import Config
from launcher.layout import AXES, OPTIONS, Layout, Option
from launcher.plan.config_rules import config_problems
from launcher.plan.estimate import Context, Estimate, evaluate
from launcher.plan.memory import GIB
from launcher.plan.model_size import alternate_unpriced
from launcher.plan.report import estimate_json
from launcher.plan.rules import engine_problems, layout_problems


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def powers_of_two(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def degree_points(cfg: Config):
    """Every set of degrees of the space: tp inside a node, cp in chunks of at least 1024
    tokens, pp at most the layers, dp_shard the whole data-parallel group or a node's worth
    (HSDP), ep carved from dp_shard x cp x tp."""
    m, hw, t = cfg.model, cfg.hardware, cfg.train
    world = hw.nodes * hw.devices_per_node
    for tp in powers_of_two(min(hw.devices_per_node, m.n_heads)):
        for cp in powers_of_two(max(1, t.seq_len // 1024)):
            if world % (tp * cp):
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > m.n_layers:
                    break
                dp = world // (tp * cp * pp)
                node_shard = max(1, hw.devices_per_node // (tp * cp))
                shards = {dp} | (
                    {node_shard} if dp % node_shard == 0 and node_shard < dp else set()
                )
                for dp_shard in sorted(shards):
                    eps = [1]
                    if m.n_routed_experts:
                        borrow = dp_shard * cp * tp
                        eps = [e for e in divisors(m.n_routed_experts) if borrow % e == 0]
                    for ep in eps:
                        yield dict(
                            zip(AXES, (dp // dp_shard, dp_shard, tp, pp, cp, ep), strict=True)
                        )


def _extend(cfg: Config, point: dict, options: list[Option]):
    """The point extended by every combination of the options' search values, in order."""
    if not options:
        yield point
        return
    for values in options[0].search(cfg, point):
        yield from _extend(cfg, {**point, **values}, options[1:])


SEARCHED = [opt for _, opt in OPTIONS if opt.search is not None and not opt.escalates]
ESCALATING = [opt for _, opt in OPTIONS if opt.escalates]


def candidates(cfg: Config):
    """Every layout of the space, as the list of its escalating variants (its recompute,
    cheapest first): the degrees, then each layout option's search values, in the Layout's
    order (launcher/layout.py); an option without them keeps its default."""
    for degrees in degree_points(cfg):
        for point in _extend(cfg, degrees, SEARCHED):
            yield [Layout(**variant) for variant in _extend(cfg, point, ESCALATING)]


def search(cfg: Config) -> tuple[int, list[Estimate]]:
    """(layouts evaluated, the valid ones that fit, fastest first)."""
    if config_problems(cfg):
        return 0, []
    ctx = Context(cfg)
    skip_selective = ctx.flash and not ctx.dropout  # identical to none: nothing to drop
    skip_alternate = bool(alternate_unpriced(cfg.model))
    evaluated, fitting = 0, []
    for variants in candidates(cfg):
        for lay in variants:
            if (lay.recompute == "selective" and skip_selective) or (
                lay.recompute_matmuls == "alternate" and skip_alternate
            ):
                continue
            evaluated += 1
            errors, _ = layout_problems(cfg, lay)
            if errors:
                break  # recompute changes no rule the search's layouts can break
            est = evaluate(ctx, lay, fitting_only=True)
            if est.time is not None:
                fitting.append(est)
                break  # a costlier recompute would only be slower
    fitting.sort(key=lambda e: -e.tokens_per_s_per_device)
    return evaluated, fitting


def runnable(cfg: Config) -> list[Estimate]:
    """The layouts of the search that fit and that launcher.train runs, fastest first."""
    return [e for e in search(cfg)[1] if not engine_problems(cfg, e.layout)]


def candidate_overrides(cfg: Config) -> tuple[list[str], str]:
    """plan.candidate=k: (the overrides that give the k-th fastest runnable layout, "") or
    ([], why there is none)."""
    k = cfg.plan.candidate
    found = runnable(cfg)
    if k >= len(found):
        return [], (
            f"plan.candidate={k}: the search found {len(found)} layout(s) that fit and that "
            f"launcher.train runs for model={cfg.model.name} on {cfg.hardware.nodes} x "
            f"{cfg.hardware.devices_per_node} {cfg.hardware.name} (0-based)"
        )
    return found[k].layout.overrides(), ""


def with_overrides(base: list[str], extra: list[str]) -> list[str]:
    """`base` with every key `extra` sets replaced by extra's value (Hydra refuses a key
    given twice)."""
    keys = {o.split("=", 1)[0] for o in extra}
    return [o for o in base if o.split("=", 1)[0] not in keys] + extra


def verdicts(cfg: Config, est: Estimate) -> dict[str, bool]:
    """A searched layout's `valid` and `fits`, as a plan of it has them (the search keeps only
    layouts with both, so they say so rather than assume it)."""
    errors, _ = layout_problems(cfg, est.layout)
    return {"valid": not errors, "fits": est.memory_high <= cfg.hardware.memory_gib * GIB}


def time_shares(est: Estimate, n: int = 3) -> str:
    """The step's largest terms as shares of it: "compute 68%, pp 19%, tp 6%"."""
    step = est.time.step
    terms = sorted(est.time.terms, key=lambda t: -t.exposed)[:n]
    return ", ".join(f"{t.name} {t.exposed / step:.0%}" for t in terms if t.exposed >= 0.01 * step)


SEARCH_WIDTH = 170  # the table's width when not printed to a terminal (logs, docs)


LAYOUT_FIELDS = tuple(f.name for f in fields(Layout))


def runner_up(ranked: list[Estimate]) -> int:
    """The index of the layout to explain the first against: the fastest whose degrees differ
    from the first's (layouts that differ only in schedule or ZeRO stage often tie), else the
    second."""
    first = ranked[0].layout.degrees
    return next((i for i, e in enumerate(ranked) if e.layout.degrees != first), 1)


def explain(first: Estimate, second: Estimate, rank: int = 2) -> str:
    """Why `first` ranks above `second` (#`rank`), in one line: what differs in the layouts
    and the terms that differ most."""
    a, b = first.layout, second.layout
    changed = [
        f"{f} {getattr(a, f)} vs {getattr(b, f)}"
        for f in LAYOUT_FIELDS
        if getattr(a, f) != getattr(b, f)
    ]
    names = dict.fromkeys(t.name for t in (*first.time.terms, *second.time.terms))
    deltas = sorted(((n, second.time[n] - first.time[n]) for n in names), key=lambda d: -abs(d[1]))
    terms = [f"{n} {abs(d):.3g} s {'less' if d > 0 else 'more'}" for n, d in deltas[:3] if d]
    gain = second.time.step / first.time.step - 1
    layout = ", ".join(changed) or "the same layout"
    versus = f"({first.time.step:.3g} s vs {second.time.step:.3g} s per step) with {layout}"
    band = separating_band(first, deltas)
    if second.time.step - first.time.step <= band:
        return (
            f"#1 and #{rank} tie: {gain:.1%} apart {versus}, within the band of the terms that "
            f"separate them (+-{band:.3g} s: {', '.join(terms) or 'no term differs'}); "
            "measure both before choosing"
        )
    return f"#1 over #{rank}: {gain:.1%} faster {versus}: {', '.join(terms) or 'no term differs'}"


def separating_band(first: Estimate, deltas: list[tuple[str, float]]) -> float:
    """How far the terms that differ between two layouts may be off against each other, in
    seconds: each term's difference times the relative half-width of the class's speed spread
    (launcher/plan/bands.py: what its held-out runs measured against their plans, less the
    offset they share, which moves both layouts alike)."""
    return first.band.spread * sum(abs(d) for _, d in deltas)


def why_first(ranked: list[Estimate]) -> str:
    """The first layout against its runner-up, or "" with fewer than two."""
    if len(ranked) < 2:
        return ""
    i = runner_up(ranked)
    return explain(ranked[0], ranked[i], i + 1)


def run_search(cfg: Config, as_json: bool) -> int:
    """Print the top plan.top_k layouts; exit status 0 when at least one fits."""
    console = Console(stderr=as_json, width=None if Console().is_terminal else SEARCH_WIDTH)
    with console.status(
        f"searching layouts of {cfg.model.name} on {cfg.hardware.nodes} x "
        f"{cfg.hardware.devices_per_node} {cfg.hardware.name}"
    ):
        evaluated, fitting = search(cfg)
    # The planner plans layouts launcher.train cannot run yet (refused by name when
    # launched): shown only under plan.planner_only=true.
    problems = [[str(p) for p in engine_problems(cfg, e.layout)] for e in fitting]
    if not cfg.plan.planner_only:
        fitting = [e for e, why in zip(fitting, problems, strict=True) if not why]
        problems = [[] for _ in fitting]
    top = fitting[: cfg.plan.top_k]
    refused = problems[: cfg.plan.top_k]
    if as_json:
        print(
            json.dumps(
                {
                    "evaluated": evaluated,
                    "fitting": len(fitting),
                    "planner_only": cfg.plan.planner_only,
                    "top": [
                        {
                            **verdicts(cfg, e),
                            **estimate_json(e, cfg.hardware.memory_gib),
                            "overrides": e.layout.overrides(),
                            "engine_problems": why,
                        }
                        for e, why in zip(top, refused, strict=True)
                    ],
                    "why_first": why_first(fitting),
                },
                indent=2,
            )
        )
        return 0 if top else 2
    which = "that fit" if cfg.plan.planner_only else "that fit and launcher.train runs"
    table = Table(
        title=f"{len(fitting):,} of {evaluated:,} layouts {which}; fastest "
        f"{len(top)} (model={cfg.model.name}, global batch "
        f"{cfg.train.global_batch_size} x {cfg.train.seq_len})",
        title_justify="left",
    )
    columns = [
        "#",
        "tp",
        "cp",
        "pp",
        "dp (rep x shard)",
        "ep",
        "zero",
        "schedule",
        "micro",
        "recompute",
        "GiB",
        "step s",
        "tok/s/dev",
        "MFU",
        "largest terms",
    ]
    if cfg.plan.planner_only:
        columns.append("trains")
    for col in columns:
        table.add_column(col, justify="left" if col == "largest terms" else "right")
    for i, (e, why) in enumerate(zip(top, refused, strict=True), 1):
        lay = e.layout
        sched = f"{lay.schedule}/{lay.stages_per_rank}" if lay.pp > 1 else "-"
        row = [
            str(i),
            str(lay.tp),
            str(lay.cp) + (f" {lay.context_method}" if lay.cp > 1 else ""),
            str(lay.pp),
            f"{lay.dp_replicate} x {lay.dp_shard}",
            str(lay.ep),
            str(lay.zero_stage),
            sched,
            str(lay.micro_batch_size),
            lay.recompute + ("/alternate" if lay.recompute_matmuls == "alternate" else ""),
            f"{e.memory.total / GIB:.1f}",
            f"{e.time.step:.3g}",
            f"{e.tokens_per_s_per_device:,.0f}",
            f"{e.mfu:.1%}",
            time_shares(e),
        ]
        if cfg.plan.planner_only:
            row.append("no" if why else "yes")
        table.add_row(*row)
    console.print(table)
    if len(fitting) > 1:
        console.print(why_first(fitting), soft_wrap=True, markup=False)
    for i, why in enumerate(refused, 1):
        if why:
            console.print(f"#{i} is planner only: {why[0]}", soft_wrap=True, markup=False)
            break
    # The fastest layout launcher.train runs (under planner_only possibly below the top_k).
    best = next((i for i, why in enumerate(problems) if not why), None)
    if best is not None:
        e = fitting[best]
        shown = "" if best < len(top) else f" ({e.time.step:.3g} s per step, {e.mfu:.1%} MFU)"
        # The same model, hardware and batch overrides as this search, plus the layout's own.
        console.print(
            f"launch #{best + 1}{shown}, the fastest that launcher.train runs, with the "
            "overrides of this search plus:\n  " + " ".join(e.layout.overrides()),
            soft_wrap=True,
        )
    if not top:
        console.print("no layout fits: more devices, a smaller global batch or shorter sequences")
    return 0 if top else 2
