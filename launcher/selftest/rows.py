"""The correctness rows of `python -m launcher.selftest`, as data: each axis, and compositions of
them, on a tiny model, laid out over the whole world the self-test is given.

A row names the axes it exercises and the overrides that lay it out; data parallelism
(dp_shard) takes whatever ranks the row's other degrees leave. A row whose degrees do not
divide the world is not drawn for it; one the planner refuses (a limitation of the engine,
a shape that does not split) is reported with the planner's reason and not run.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.models import families

# The models the rows train: every dense axis on a Llama, expert parallelism on a Mixtral.
DENSE = ("model=llama3_debug",)
MOE = ("model=mixtral_debug",)

MICRO = 2  # sequences per micro-batch: a global batch of 2 x dp x k (batch_for)

# What every row and its reference share: fp32 (only the summation order differs between
# layouts), one global batch that each layout splits, warmup then the cosine, the gathered
# final parameters written, nothing but metrics.jsonl logged.
BASE = (
    "precision=fp32",
    "train.warmup_steps=1",
    "train.eval_interval=0",
    f"train.micro_batch_size={MICRO}",
    "train.save_final=true",
    "checkpoint.interval=0",
    "logging.wandb.mode=disabled",
    "logging.tensorboard=false",
)


@dataclass(frozen=True)
class Row:
    """One row: its name, the mesh dimensions it exercises, the model and layout overrides."""

    name: str
    axes: tuple[str, ...]
    model: tuple[str, ...]
    layout: tuple[str, ...]  # every degree, and the styles
    batch: int  # the global batch (its reference trains the same one)

    @property
    def reference(self) -> tuple[str, ...]:
        """What its one-process reference trains: the model and the batch."""
        return (*self.model, f"train.global_batch_size={self.batch}")


@dataclass(frozen=True)
class Shape:
    """A row's shape before the world is known: the product of its degrees besides data
    parallelism (`needs`), the product of those that split a sequence or the model rather
    than the batch (`splits`: tp, pp, cp), and the least world it makes sense on (`least`)."""

    name: str
    axes: tuple[str, ...]
    layout: tuple[str, ...]
    needs: int
    least: int = 2
    splits: int = 1
    multiple: int = 1  # the world must be a multiple of it (ep: carved from dp_shard)
    micro_batches: int = 1  # at least this many per data-parallel rank (pp: to fill it)
    model: tuple[str, ...] = DENSE
    replicated: bool = False  # dp_replicate takes the rest of the world, not dp_shard


SHAPES = (
    Shape("fsdp", ("dp_shard",), (), 1),
    Shape("hsdp dp_replicate=2", ("dp_replicate", "dp_shard"), ("parallel.dp_replicate=2",), 2, 4),
    Shape("ddp", ("dp_replicate",), ("data_parallel=ddp",), 1, replicated=True),
    Shape("zero1", ("dp_shard",), ("data_parallel=zero1",), 1),
    Shape("tp=2 sp", ("tp",), ("parallel.tp=2", "tensor=sequence_parallel"), 2, splits=2),
    Shape("pp=2 1f1b", ("pp",), ("parallel.pp=2", "pipeline=1f1b"), 2, splits=2, micro_batches=2),
    Shape("cp=2 ring", ("cp",), ("parallel.cp=2", "context=ring"), 2, splits=2),
    Shape("mixtral ep=2", ("ep",), ("parallel.ep=2",), 1, model=MOE, multiple=2),
    Shape(
        "tp=2 sp x pp=2",
        ("tp", "pp"),
        ("parallel.tp=2", "parallel.pp=2", "tensor=sequence_parallel"),
        4,
        least=8,
        splits=4,
        micro_batches=2,
    ),
    Shape(
        "cp=2 x tp=2",
        ("cp", "tp"),
        ("parallel.cp=2", "parallel.tp=2", "context=ring"),
        4,
        least=8,
        splits=4,
    ),
)


def batch_for(dp: int, micro_batches: int) -> int:
    """A global batch every data-parallel rank takes whole micro-batches of, at least
    `micro_batches` of them: at least 8 sequences, so that one process (and a small dp)
    accumulates several."""
    return MICRO * dp * max(-(-4 // dp), micro_batches)


def rows_for(world: int) -> list[Row]:
    """The rows laid out over `world` ranks: each shape whose degrees divide it, the rest
    data parallel (dp_shard; dp_replicate for DDP)."""
    out = []
    for s in SHAPES:
        if world < s.least or world % s.needs or world % s.multiple:
            continue
        rest = world // s.needs
        fill = {"dp_replicate": rest, "dp_shard": 1} if s.replicated else {"dp_shard": rest}
        shown = " ".join(f"{k}={v}" for k, v in fill.items() if v > 1)
        layout = (*s.layout, *(f"parallel.{k}={v}" for k, v in fill.items()))
        batch = batch_for(world // s.splits, s.micro_batches)
        out.append(Row(f"{s.name} {shown}".strip(), s.axes, s.model, layout, batch))
    return out


# The styles a recipe's row takes from it (its Hydra choices), each with the axis it styles
# (None: every layout has it); a style of an axis the row does not keep is left at its default.
STYLES = {"data_parallel": None, "recompute": None, "tensor": "tp", "pipeline": "pp",
          "context": "cp"}  # fmt: skip
CUT = ("dp_replicate", "tp", "pp", "cp", "ep")  # the axes a recipe's row keeps, at degree 2


def recipe_row(recipe: str, cfg, choices: dict, world: int) -> Row | None:
    """The composition a recipe uses, cut to fit `world`: each of its axes split 2 ways (as
    many as the world holds, in CUT's order), with its styles, on its family's debug model;
    data parallelism takes the rest. None when it uses no axis but data parallelism."""
    used = [a for a in CUT if getattr(cfg.parallel, a) > 1]
    kept, splits, needs = [], 1, 1
    for axis in used:
        if axis == "ep":  # carved from dp_shard x cp x tp: those ranks must split 2 ways
            carved = world // needs * 2 ** len({"cp", "tp"} & set(kept))
            if carved % 2 == 0:
                kept.append(axis)
            continue
        if world % (needs * 2) == 0:
            kept.append(axis)
            needs *= 2
            splits *= 2 if axis != "dp_replicate" else 1
    if not kept:
        return None
    rest = world // needs
    layout = (
        *(f"parallel.{a}=2" for a in kept),
        f"parallel.dp_shard={rest}",
        *(f"{g}={choices[g]}" for g, a in STYLES.items() if g in choices and a in (None, *kept)),
    )
    debug = families.of(cfg.model).debug
    pp = 2 if "pp" in kept else 1
    name = f"{recipe}: {debug} " + " x ".join(f"{a}=2" for a in kept)
    if rest > 1:
        name += f" dp_shard={rest}"
    batch = batch_for(world // splits, 2 * pp)
    return Row(name, tuple(kept), (f"model={debug}",), layout, batch)
