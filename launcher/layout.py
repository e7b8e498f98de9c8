"""The one vocabulary the planner and the engine share: axes, mesh order, schedules, stage
placement and the `Layout` of a run (torchtitan's ParallelDims, as a frozen dataclass).

Pure Python: no torch import. `launcher/plan` evaluates Layouts, `launcher/parallel` and the
trainer build exactly what a Layout says; neither reads the degrees from anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

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

# Override keys that choose a layout (what parallel.auto=true sets): the run directory's name
# leaves them out, so that the same command resumes whatever world and layout a start gets.
LAYOUT_OVERRIDES = (
    "parallel.",
    "data_parallel",
    "pipeline",
    "recompute",
    "tensor.",
    "train.micro_batch_size",
    "hardware.nodes",
    "hardware.devices_per_node",
)


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
class Layout:
    """One way to lay a run out on its ranks: degrees, data-parallel sharding, pipeline shape,
    micro-batching, recompute and tensor-parallel options."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    zero_stage: int
    schedule: str
    stages_per_rank: int
    micro_batch_size: int
    microbatches: int  # per pipeline and step: the gradient-accumulation count
    recompute: str
    sequence_parallel: bool
    stage_layers: tuple[int, ...] = ()  # layers per stage; () = the even default split
    reshard_each_microbatch: bool = False  # FSDP under pp: reshard after every backward
    loss_parallel: bool = False  # vocab-sharded logits and loss (tp > 1)
    recompute_every: int = 1  # recompute blocks 0, k, 2k, ... only
    recompute_matmuls: str = "all"  # under op: "all" matmul outputs kept, or "alternate" ones

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
    def seq_len_divisor(self) -> int:
        """What train.seq_len must be a multiple of: tp with sequence parallelism, 2 cp chunks."""
        return (self.tp if self.sequence_parallel else 1) * (2 * self.cp if self.cp > 1 else 1)

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def overrides(self) -> list[str]:
        """The `launcher.train` overrides that give this layout (degrees and layout options)."""
        out = [f"parallel.{a}={getattr(self, a)}" for a in AXES]
        out.append(f"data_parallel.zero_stage={self.zero_stage}")
        out.append(f"train.micro_batch_size={self.micro_batch_size}")
        out.append(f"recompute={self.recompute}")
        if self.recompute_every > 1:
            out.append(f"recompute.every={self.recompute_every}")
        if self.recompute_matmuls != "all":
            out.append(f"recompute.matmuls={self.recompute_matmuls}")
        out.append(f"tensor.sequence_parallel={str(self.sequence_parallel).lower()}")
        out.append(f"tensor.loss_parallel={str(self.loss_parallel).lower()}")
        if self.pp > 1:
            out.append(f"pipeline={self.schedule}")
            out.append(f"pipeline.stages_per_rank={self.stages_per_rank}")
            if self.stage_layers:
                out.append(f"pipeline.layers_per_stage=[{','.join(map(str, self.stage_layers))}]")
            if self.reshard_each_microbatch:
                out.append("pipeline.reshard_each_microbatch=true")
        return out


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
