"""Measure the bytes one Llama block keeps for backward, per token, under the engine's own
tensor parallelism and recompute. Run directly (tp=1) or under torchrun (tp = world size);
prints one JSON line per setting on rank 0.

Counted: every tensor autograd saves during the block's forward (saved-tensor hooks), plus the
inputs a checkpoint keeps to recompute from (they are held by the checkpoint, not by autograd),
each storage once, parameters and buffers excluded. DTensors count their local shard.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import models
from launcher.parallel.checkpointing import apply_ac
from launcher.parallel.tensor_parallel import apply_tp

DIM, LAYERS, HEADS, KV, FFN, VOCAB = 128, 1, 8, 4, 384, 320
BATCH, SEQ = 2, 64
SETTINGS = [("none", True), ("selective", False), ("full", True)]  # (recompute, fused attention)


def storage(t: torch.Tensor):
    local = t._local_tensor if isinstance(t, DTensor) else t
    st = local.untyped_storage()
    return st.data_ptr(), st.nbytes()


def block_overrides(tp: int, sp: bool, recompute: str) -> list[str]:
    """The config of the block measured here (one llama3_debug layer, fp32), for the planner."""
    return [
        "model=llama3_debug",
        "model.n_layers=1",
        f"model.max_seq_len={SEQ}",
        f"train.seq_len={SEQ}",
        "precision=fp32",
        f"recompute={recompute}",
        f"parallel.tp={tp}",
        "parallel.dp_shard=1",
        f"tensor.sequence_parallel={str(sp).lower()}",
        f"train.micro_batch_size={BATCH}",
        f"train.global_batch_size={BATCH}",
    ]


def recorder(block: torch.nn.Module, shared: list[torch.Tensor]):
    """(pack hook, {storage: bytes}) counting what `block` keeps for backward: what autograd
    saves, plus the inputs a checkpoint keeps to recompute from; tensors sharing a storage
    with `shared` (parameters, buffers) left out."""
    constant = {storage(t)[0] for t in shared}
    kept: dict[int, int] = {}

    def keep(t):
        if isinstance(t, torch.Tensor):
            ptr, nbytes = storage(t)
            if ptr not in constant:
                kept[ptr] = nbytes

    def pack(t):
        keep(t)
        return t

    for module in block.modules():
        if isinstance(module, CheckpointWrapper):
            module.register_forward_pre_hook(lambda _m, args: [keep(a) for a in args] and None)
    return pack, kept


def measure(recompute: str, fused: bool, tp: int, sp: bool, mesh) -> float:
    torch.manual_seed(0)
    model = models.build(
        "llama",
        dict(
            dim=DIM,
            n_layers=LAYERS,
            n_heads=HEADS,
            n_kv_heads=KV,
            ffn_dim=FFN,
            vocab_size=VOCAB,
            max_seq_len=SEQ,
            flash_attention=fused,
        ),
    )
    model.init_weights(0)
    if tp > 1:
        apply_tp(model, mesh, "llama", sequence_parallel=sp, loss_parallel=False)
    if recompute != "none":
        apply_ac(model, recompute)
    block = model.layers["0"]
    pack, kept = recorder(block, [*model.parameters(), *model.buffers()])

    x = torch.randn(BATCH, SEQ, DIM)
    if tp > 1:
        # What the vocab-parallel embedding hands the first block: the local sequence shard.
        x = (
            DTensor.from_local(x, mesh, [Replicate()])
            .redistribute(mesh, [Shard(1) if sp else Replicate()])
            .to_local()
        )
    x.requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, model.rope)
    out = out.to_local() if isinstance(out, DTensor) else out
    out.sum().backward()  # the graph is sound (and the checkpoint really recomputes)
    return sum(kept.values()) / (BATCH * SEQ)


def main() -> None:
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = None
    if tp > 1:
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    for recompute, fused in SETTINGS:
        for sp in [False, True] if tp > 1 else [False]:
            per_token = measure(recompute, fused, tp, sp, mesh)
            if int(os.environ.get("RANK", "0")) == 0:
                print(
                    json.dumps(
                        {
                            "recompute": recompute,
                            "fused": fused,
                            "tp": tp,
                            "sp": sp,
                            "bytes_per_token": per_token,
                        }
                    ),
                    flush=True,
                )
    if tp > 1:
        dist.barrier()  # gloo aborts if a peer tears down while another still talks
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
