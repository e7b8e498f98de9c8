"""What one checkpoint save writes, per rank, per node and in total, and how long it takes.

A checkpoint is one DCP save (torch.distributed.checkpoint) by every rank of the trainer's
state (launcher/checkpoint/saver.py): the parameters in precision.master_dtype, AdamW's exp_avg
and exp_avg_sq in precision.optimizer_dtype plus a scalar `step` per parameter tensor, the
train state, each rank's RNG state and meta.json. Gradients are not saved. DCP writes every
tensor shard once: FSDP and TP shards by their owner, replicated tensors (DDP, dp_replicate,
norms under TP) by one of the ranks holding them, spread over those ranks. So the states of a
pipeline rank's layers are written by the world / pp ranks that share that rank's stages,
evenly, and the checkpoint holds the model's states once. DCP hands each replicated tensor
whole to the least loaded of its holders so far, so under DDP or ZeRO-1 a rank may write up
to one tensor (an embedding, a stack of experts) more than its even share.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import ModelConfig
from launcher.layout import Layout, last_stage_rank
from launcher.models import families
from launcher.plan.context import Context, layout_ranks
from launcher.plan.memory import BYTES

# DCP's framing per parameter tensor, measured with torch 2.13 on the debug models (checked by
# tests/plan/test_checkpoint_size.py): its four tensors (parameter, exp_avg, exp_avg_sq, step)
# each torch.save'd as a small zip file (about 1.6 KB), its eleven AdamW options (lr, betas,
# ...) each pickled on its own (about 1.3 KB), and their entries in `.metadata`. It is 8% of
# the debug model's checkpoint and under 0.01% of an 8B model's. A sharded tensor is framed
# once per shard, about 1.8 KB more per tensor and rank than counted here: 2% of the debug
# model saved by 2 FSDP ranks, 0.1% of a Llama 3 405B rank's share.
BYTES_PER_TENSOR = 23_500
# Each rank's RNG state: the CPU generator's 5 KB and a CUDA generator's 16 bytes, framed as
# above (7.5 KB measured on CPU, 9 KB with a CUDA-sized state).
RANK_EXTRA_BYTES = 8_000
# Written once, by global rank 0: the train state (3 KB) and meta.json (the resolved config
# and the plan as JSON, 5 KB).
ONCE_EXTRA_BYTES = 8_000


@dataclass(frozen=True)
class CheckpointSize:
    """Bytes of one save, and the write bandwidth it is timed at."""

    total: float  # the whole checkpoint
    rank: float  # what the most loaded rank writes
    node: float  # what the most loaded node writes
    storage_gbps: float  # GB/s per node

    @property
    def save_seconds(self) -> float:
        """The save ends when the most loaded node has written its share."""
        return self.node / (self.storage_gbps * 1e9)


def block_tensors(m: ModelConfig) -> tuple[int, int, int, int]:
    """Parameter tensors of (a dense block, an MoE block, the embedding, the head) as
    launcher/models/ builds them (its family's parameters, launcher/models/shapes.py): experts
    stacked, one w1, w2 and w3 for all of them."""
    fam = families.of(m)
    moe = len(fam.block(m, moe=True)) if m.n_routed_experts else 0
    return len(fam.block(m, moe=False)), moe, len(fam.embedding.tensors(m)), len(fam.head(m))


def ahead_own_tensors(m: ModelConfig) -> int:
    """Multi-token prediction's own parameter tensors beside its blocks (which are layers)."""
    return sum(1 for name in families.of(m).ahead(m) if ".block." not in name)


def stage_bytes(ctx: Context, lay: Layout, rank: int, layers: int, dense: int) -> float:
    """Bytes of the states pipeline rank `rank` holds (summed over its data and tensor
    parallel ranks), for `layers` blocks of which `dense` are dense."""
    s, m = ctx.shape, ctx.model
    master = BYTES[ctx.cfg.precision.master_dtype]
    dense_t, moe_t, embedding_t, head_t = block_tensors(m)
    params = dense * s.dense_layer + (layers - dense) * s.moe_layer
    tensors = dense * dense_t + (layers - dense) * moe_t
    if rank == 0:
        params, tensors = params + s.embedding, tensors + embedding_t
    tied_copy = 0.0
    if rank == last_stage_rank(lay.pp, lay.schedule):
        params, tensors = params + s.head, tensors + head_t
        params, tensors = params + s.ahead_own, tensors + ahead_own_tensors(m)
        if (m.tie_embeddings or s.ahead_layers) and lay.pp > 1:
            # the last stage's own copy of the token table, with Adam states
            params, tensors = params + m.vocab_size * m.dim, tensors + 1
        elif m.tie_embeddings:  # the state dict names the shared weight twice: written twice
            tied_copy = m.vocab_size * m.dim * master
    return params * (master + ctx.optim_b) + tied_copy + tensors * BYTES_PER_TENSOR


def checkpoint_size(ctx: Context, lay: Layout) -> CheckpointSize:
    """Bytes one save writes in total, on the most loaded rank and on the most loaded node."""
    ranks = layout_ranks(ctx, lay)
    sharing = lay.world // lay.pp  # ranks that hold the same stages
    per_rank = [
        stage_bytes(ctx, lay, r, *held) / sharing + RANK_EXTRA_BYTES for r, held in enumerate(ranks)
    ]
    per_node = ctx.devices_per_node
    if sharing % per_node == 0:
        # Every node lies inside one pipeline rank's group: it writes per_node of its shares
        # (node 0 also global rank 0's extra).
        node = max(per_node * max(per_rank), per_node * per_rank[0] + ONCE_EXTRA_BYTES)
    else:
        nodes = node_bytes(per_rank, sharing, per_node, ctx.nodes)
        nodes[0] += ONCE_EXTRA_BYTES  # global rank 0's
        node = max(nodes)
    return CheckpointSize(
        total=sum(per_rank) * sharing + ONCE_EXTRA_BYTES,
        rank=max(max(per_rank), per_rank[0] + ONCE_EXTRA_BYTES),
        node=node,
        storage_gbps=ctx.cfg.hardware.storage_gbps,
    )


def node_bytes(per_rank: list[float], sharing: int, per_node: int, nodes: int) -> list[float]:
    """Bytes each node writes, given what each rank of every pipeline rank writes.

    Ranks are numbered with the pipeline outermost: pipeline rank r is global ranks
    [r sharing, (r + 1) sharing), and node n holds [n per_node, (n + 1) per_node).
    """
    out = []
    for n in range(nodes):
        lo, hi = n * per_node, (n + 1) * per_node
        held = range(lo // sharing, min(len(per_rank), -(-hi // sharing)))
        out.append(
            sum((min(hi, (r + 1) * sharing) - max(lo, r * sharing)) * per_rank[r] for r in held)
        )
    return out
