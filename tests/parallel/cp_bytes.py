"""Measure what context parallelism costs one Llama block on one rank, under the engine's own CP
(and TP, and recompute): the bytes it keeps for backward per local token, and the bytes it sends
per layer, forward and backward. A job of tests/group.py on 2 or 4 processes
(`jobs.mesh_job("parallel.cp_bytes:job", (world,), ("cp",))`): each rank's OUT/RANK.json is a list
of rows {cp, tp, sp, method, recompute, bytes_per_token, sent}, one per setting this world size
allows (2 processes: cp=2; 4 processes: cp=4, and cp=2 x tp=2 with and without sequence
parallelism).

Saved bytes are counted as saved_bytes.py counts them (saved-tensor hooks, checkpoint inputs,
each storage once, parameters and buffers excluded), per token of the (B, S / cp) micro-batch
this cp rank holds. Also excluded: the positions and their RoPE angles (model.rope[positions]),
which the model computes once per forward and every block shares.

Bytes sent are counted at the collectives context_parallel.py calls, through a stand-in for its
`dist` module (the rest of torch.distributed, TP's DTensor collectives included, is untouched),
and defined independently of the collective's algorithm as what must leave this rank:
- all_gather_single: this rank's input must reach the cp - 1 others: (cp - 1) x input bytes;
- reduce_scatter_single: this rank's contribution to each other rank's output: (cp - 1) x
  output bytes;
- batch_isend_irecv: the bytes of each isend's tensor.
A ring implementation of either collective sends exactly that. `sent` splits them by pass
(forward: during the block's forward; backward: during its backward, recompute included) and by
kind ("kv": floating-point tensors, K/V and their gradients; "positions": integer tensors).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from jobs import patched
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from launcher import models
from launcher.parallel import context_parallel as cpa
from launcher.parallel.recompute import apply_ac
from launcher.parallel.tensor_parallel import apply_tp
from parallel.saved_bytes import BATCH, SEQ, Recorder

RECOMPUTE = ("none", "selective", "full")
DIM, HEADS, KV, FFN, VOCAB = 128, 8, 4, 384, 320  # one llama3_debug block


class CountingDist:
    """torch.distributed as context_parallel.py sees it, counting the bytes this rank sends."""

    def __init__(self):
        self.phase = "forward"
        self.sent = {}

    def __getattr__(self, name):
        return getattr(dist, name)

    def add(self, t: torch.Tensor, nbytes: int) -> None:
        kind = "kv" if t.is_floating_point() else "positions"
        self.sent[self.phase][kind] += nbytes

    def reset(self) -> None:
        self.phase = "forward"
        self.sent = {p: {"kv": 0, "positions": 0} for p in ("forward", "backward")}

    def all_gather_single(self, output, input, group=None, **kw):
        self.add(input, (dist.get_world_size(group) - 1) * input.nbytes)
        return dist.all_gather_single(output, input, group=group, **kw)

    def reduce_scatter_single(self, output, input, group=None, **kw):
        self.add(output, (dist.get_world_size(group) - 1) * output.nbytes)
        return dist.reduce_scatter_single(output, input, group=group, **kw)

    def batch_isend_irecv(self, ops):
        for op in ops:
            if op.op is dist.isend:
                self.add(op.tensor, op.tensor.nbytes)
        return dist.batch_isend_irecv(ops)


COUNTER = CountingDist()


def measure(mesh, tp: int, sp: bool, method: str, recompute: str) -> dict:
    cp_group = mesh["cp"].get_group()
    cp, rank = cp_group.size(), cp_group.rank()
    torch.manual_seed(0)
    model = models.build(
        "llama",
        dict(
            dim=DIM,
            n_layers=1,
            n_heads=HEADS,
            n_kv_heads=KV,
            ffn_dim=FFN,
            vocab_size=VOCAB,
            max_seq_len=SEQ,
        ),
    )
    model.init_weights(0)
    if tp > 1:
        apply_tp(model, mesh["tp"], "llama", sequence_parallel=sp, loss_parallel=False)
    cpa.apply_cp(model, cp_group, method)
    if recompute != "none":
        apply_ac(model, recompute)
    block = model.layers["0"]
    pos = cpa.chunk_positions(SEQ, cp, rank, load_balance=True)
    rope = model.rope[pos]  # (S / cp, 2, E), as Transformer.forward looks it up
    recorder = Recorder([*model.parameters(), *model.buffers(), pos, rope])

    # This cp rank's tokens (the same on every tp rank); under sequence parallelism the block
    # takes this tp rank's slice of them.
    x = torch.randn(BATCH, SEQ, DIM).index_select(1, pos)  # (B, S / cp, D)
    if tp > 1:
        x = (
            DTensor.from_local(x, mesh["tp"], [Replicate()])
            .redistribute(mesh["tp"], [Shard(1) if sp else Replicate()])
            .to_local()
        )
    x.requires_grad_(True)
    COUNTER.reset()
    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        out = block(x, rope, pos)
    out = out.to_local() if isinstance(out, DTensor) else out
    COUNTER.phase = "backward"
    out.sum().backward()
    return {
        "cp": cp,
        "tp": tp,
        "sp": sp,
        "method": method,
        "recompute": recompute,
        "bytes_per_token": sum(recorder.kept.values()) / (BATCH * SEQ / cp),
        "sent": COUNTER.sent,
    }


def run(mesh) -> list[dict]:
    """Every setting on the 1-D cp mesh of the whole world, and with 4 processes also on a
    (cp=2, tp=2) mesh, tp innermost as the engine lays it out."""
    meshes = [(mesh, 1, False)]
    if mesh.size() == 4:
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
        meshes += [(mesh2d, 2, False), (mesh2d, 2, True)]
    return [
        measure(m, tp, sp, method, recompute)
        for m, tp, sp in meshes
        for method in cpa.METHODS
        for recompute in RECOMPUTE
    ]


def job(mesh) -> list[dict]:
    if mesh.size() not in (2, 4):
        raise ValueError(f"cp_bytes runs on 2 or 4 processes, not {mesh.size()}")
    with patched(cpa, "dist", COUNTER):
        return run(mesh)
