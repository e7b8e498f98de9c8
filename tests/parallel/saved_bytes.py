"""Measure the bytes each block keeps for backward, per token, on the engine's own
`parallelize` (tensor and sequence parallelism, experts split over tp, recompute) for every
family: `measure` in the test's own process (tp=1), or `job` of tests/group.py (tp = the
group's size; a case is `family,recompute,sp,precision`), each rank writing OUT/RANK.json, a
list of rows, one per case and block.

Counted: every tensor autograd saves during the block's forward (saved-tensor hooks; torch
2.13's checkpoint packs the inputs it keeps to recompute from through them too), and what a
per-op selective checkpoint caches (the outputs its policy saves), each storage once,
parameters and buffers excluded. DTensors count their local shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy

from launcher import models
from launcher.cli import CONF_DIR, hydra_app
from launcher.models.families import DENSE_FIRST, FAMILIES
from launcher.parallel import parallelize
from launcher.parallel import recompute as activation_recompute
from launcher.plan import make_plan
from launcher.plan.estimate import layer_activation
from launcher.runtime import distributed

PRESETS = {name: f.debug for name, f in FAMILIES.items()}
BATCH, SEQ = 2, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def overrides(family: str, recompute: str, tp: int, sp: bool, precision: str = "fp32"):
    """The config measured: one block of the family's debug preset (a dense one and an MoE one
    where the first layers are dense). fp32: fused attention except under selective (which
    only differs without it); bf16: Korthikanti et al.'s setting, 16-bit activations,
    attention unfused, dropout.
    `recompute` "op:alternate": recompute=op keeping every other matmul's output."""
    recompute, _, matmuls = recompute.partition(":")
    fused = recompute != "selective" and precision == "fp32"
    out = [
        f"model={PRESETS[family]}",
        f"model.n_layers={2 if FAMILIES[family].feed_forward == DENSE_FIRST else 1}",
        f"model.flash_attention={str(fused).lower()}",
        f"train.seq_len={SEQ}",
        f"recompute={recompute}",
        f"recompute.matmuls={matmuls or 'all'}",
        f"parallel.tp={tp}",
        "parallel.dp_shard=1",
        f"tensor.sequence_parallel={str(sp).lower()}",
        f"train.micro_batch_size={BATCH}",
        f"train.global_batch_size={BATCH}",
        f"hardware.devices_per_node={tp}",
    ]
    if family == "gpt" and fused:  # torch's CPU kernel fuses attention without dropout only
        out.append("model.dropout=0")
    if precision == "bf16":
        out.append("precision=bf16_mixed")
    return out


def config(args: list[str]):
    hydra_app(lambda cfg: None)  # registers the schema
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return OmegaConf.to_object(compose("config", overrides=args))


def planned(cfg) -> dict[str, float]:
    """The planner's bytes per token for each block of `cfg`'s model."""
    plan = make_plan(cfg)
    assert plan.valid, plan.errors
    dense = plan.context.shape.n_dense_layers
    return {
        str(i): layer_activation(plan.context, plan.layout, i < dense, plan.layout.recompute)
        for i in range(cfg.model.n_layers)
    }


def storage(t: torch.Tensor):
    local = t._local_tensor if isinstance(t, DTensor) else t
    if isinstance(local, AsyncCollectiveTensor):  # a collective's output not waited for yet
        local = local.elem
    st = local.untyped_storage()
    return st.data_ptr(), st.nbytes()


class Recorder:
    """{storage: bytes} of what a block keeps for backward (see the module docstring)."""

    def __init__(self, shared: list[torch.Tensor]):
        self.constant = {storage(t)[0] for t in shared}
        self.kept: dict[int, int] = {}
        self.active = True  # off: forwards that are not the one measured

    def keep(self, t) -> None:
        if self.active and isinstance(t, torch.Tensor):
            ptr, nbytes = storage(t)
            if ptr not in self.constant:
                self.kept[ptr] = nbytes

    def pack(self, t):
        self.keep(t)
        return t


RECORDING: list[Recorder] = []  # the recorder of the block running forward, if any


def _recording_policy(policy):
    """The engine's per-op policy, also counting what it saves: the outputs of those ops are
    kept by the checkpoint's caching mode, out of autograd's sight."""

    def recording(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        if RECORDING and decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            tree_map(RECORDING[-1].keep, ctx.op_output)
        return decision

    return recording


activation_recompute._op_policy = _recording_policy(activation_recompute._op_policy)


def measure(cfg, d) -> dict[str, float]:
    """Bytes per token each block keeps for backward, on this rank."""
    plan = make_plan(cfg)
    torch.manual_seed(0)
    model = models.build(cfg.model.family, vars(cfg.model))
    model.init_weights(0)
    dtype = DTYPES[cfg.precision.compute_dtype.value]
    model = parallelize(model.to(dtype), plan.layout, cfg, d)
    tp = plan.layout.tp
    extra = (None,) if cfg.model.family == "gpt" else (model.rope, None)
    out = {}
    for name, block in model.layers.items():
        recorder = Recorder([*model.parameters(), *model.buffers()])
        x = torch.randn(BATCH, SEQ, cfg.model.dim, dtype=dtype)
        if tp > 1:
            # What the vocab-parallel embedding hands a block: the sequence shard under SP.
            mesh = d.mesh["tp"]
            placement = Shard(1) if plan.layout.sequence_parallel else Replicate()
            x = DTensor.from_local(x, mesh, [Replicate()]).redistribute(mesh, [placement])
            x = x.to_local()
        x.requires_grad_(True)
        RECORDING.append(recorder)
        try:
            with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
                y = block(x, *extra)
        finally:
            RECORDING.pop()
        y = y.to_local() if isinstance(y, DTensor) else y
        y.float().sum().backward()  # the graph is sound (and checkpoints really recompute)
        out[name] = sum(recorder.kept.values()) / (BATCH * SEQ)
    return out


def job(out: Path, *cases: str) -> None:
    tp = dist.get_world_size()
    d, rows = None, []
    for case in cases:
        family, recompute, sp, precision = case.split(",")
        cfg = config(overrides(family, recompute, tp, sp == "sp", precision))
        if d is None:
            d = distributed.init("cpu", make_plan(cfg).layout)
        row = dict(family=family, recompute=recompute, tp=tp, sp=sp == "sp", precision=precision)
        for block, per_token in measure(cfg, d).items():
            rows.append({**row, "block": block, "bytes_per_token": per_token})
    (out / f"{d.rank}.json").write_text(json.dumps(rows))
