"""`plan.draw=FILE.png`: the pipeline schedule of a plan as a picture, ranks x time.

Each rank's row shows the blocks its schedule runs (launcher/plan/timeline.py: the engine's
own action lists), on a time axis whose unit is a micro-batch's forward through all of a
rank's layers, so that schedules with one and with v stages per rank compare; coloured by kind
(forward, full backward, input-gradient and weight-gradient backward), the later virtual
stages of a rank in a lighter shade, micro-batch numbers inside when they fit. The gaps are the
bubble, shaded grey; the title gives their share of the compute, measured on the drawn boxes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from launcher.layout import rank_stages
from launcher.plan.timeline import Timeline, simulate

COLOURS = {"F": "#4c72b0", "B": "#c44e52", "I": "#dd8452", "W": "#55a868"}
LIGHT = {"F": "#a5c0e6", "B": "#e6a3a5", "I": "#f2c29e", "W": "#a9d9b5"}
NAMES = {
    "F": "F: forward",
    "B": "B: backward (input and weight gradients)",
    "I": "I: backward, input gradient",
    "W": "W: backward, weight gradient",
}
BUBBLE = "#d0d0d0"
LABEL_LIMIT = 160  # units of makespan up to which micro-batch numbers are written in the boxes


@dataclass(frozen=True)
class Drawing:
    path: Path
    bubble_fraction: float  # grey area over coloured area, as drawn


def draw(timeline: Timeline, path: str | Path, planner_bubble: float | None = None) -> Drawing:
    """Write the schedule drawing to `path` (format from its suffix: png, svg, pdf)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tl, p = timeline, timeline.pp
    span = tl.makespan  # in stage units: how many blocks a row holds
    unit = 1 / tl.stages_per_rank  # x unit: a rank's forward through all of its layers
    fig, ax = plt.subplots(figsize=(min(24.0, max(10.0, span * 0.11)), 1.9 + 0.42 * p))
    drawn_busy = drawn_idle = 0.0
    kinds: set[str] = set()
    for rank in range(p):
        y = p - 1 - rank  # rank 0 on top
        stages = rank_stages(rank, p, tl.stages_per_rank, tl.schedule)
        gaps = tl.idle(rank)
        ax.broken_barh(
            [(a * unit, (b - a) * unit) for a, b in gaps], (y - 0.4, 0.8), facecolors=BUBBLE,
            hatch="//", edgecolor="#a0a0a0", linewidth=0.0,
        )  # fmt: skip
        drawn_idle += sum(b - a for a, b in gaps)
        boxes: dict[str, list[tuple[float, float]]] = {}  # colour -> (start, width)
        for blk in (b for b in tl.blocks if b.rank == rank):
            later = blk.stage != stages[0]  # the rank's later virtual stages
            width = blk.end - blk.start
            box = (blk.start * unit, width * unit)
            boxes.setdefault((LIGHT if later else COLOURS)[blk.kind], []).append(box)
            drawn_busy += width
            kinds.add(blk.kind)
            if span <= LABEL_LIMIT:
                ax.text(
                    (blk.start + width / 2) * unit, y, str(blk.microbatch), ha="center",
                    va="center", fontsize=7 if span <= 80 else 5,
                    color="black" if later else "white",
                )  # fmt: skip
        for colour, spans in boxes.items():
            ax.broken_barh(
                spans, (y - 0.4, 0.8), facecolors=colour, edgecolor="white",
                linewidth=0.6 if span <= LABEL_LIMIT else 0.0,
            )  # fmt: skip
    fraction = drawn_idle / drawn_busy
    ax.set_yticks(range(p), [f"rank {r}" for r in reversed(range(p))])
    ax.set_xlim(0, span * unit)
    ax.set_ylim(-0.6, p - 0.4)
    ax.set_xlabel(
        "time (unit: one micro-batch's forward through a rank's layers; its backward takes 2)"
    )
    v = tl.stages_per_rank
    title = (
        f"{tl.schedule}: pp={p}, {v} stage{'s' if v > 1 else ''} per rank, "
        f"{tl.microbatches} micro-batches; bubble {fraction:.1%} of compute"
    )
    if planner_bubble is not None:
        title += f" (planner {planner_bubble:.1%})"
    ax.set_title(title, fontsize=11)
    handles = [Patch(facecolor=COLOURS[k], label=NAMES[k]) for k in NAMES if k in kinds]
    if v > 1:
        handles.append(Patch(facecolor=LIGHT["F"], label="lighter: the rank's later stages"))
    handles.append(Patch(facecolor=BUBBLE, hatch="//", edgecolor="#a0a0a0", label="bubble (idle)"))
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / p),
        ncol=3, fontsize=8, frameon=False,
    )  # fmt: skip
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return Drawing(path, fraction)


def draw_plan(plan, path: str | Path) -> Drawing:
    """The drawing for a valid plan with pp > 1."""
    lay = plan.layout
    timeline = simulate(lay.schedule, lay.pp, lay.stages_per_rank, lay.microbatches)
    return draw(timeline, path, plan.estimate.time.bubble_fraction if plan.estimate else None)
