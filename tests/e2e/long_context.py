"""Bytes one rank keeps for backward on the long-context recipe, measured on the real Trainer.

A job of tests/group.py on cp processes: `job(OUT_DIR, *OVERRIDES)` (the overrides set
parallel.cp and hardware.devices_per_node). Builds the Trainer for recipe=llama3_debug_long,
prepares the first micro-batch of step 1 exactly as training does (this rank's load-balanced
chunks), runs its forward and loss under saved-tensor hooks and writes OUT_DIR/RANK.json with
the bytes autograd saved (each storage once; parameters and buffers excluded), the tokens this
rank holds and the planner's figures for the layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from launcher.cli import compose
from launcher.plan import make_plan
from launcher.runtime import distributed
from launcher.training.trainer import Trainer


def job(out: Path, *overrides: str) -> None:
    cfg = compose(["recipe=llama3_debug_long", *overrides])
    plan = make_plan(cfg)
    assert plan.ok, plan.errors
    d = distributed.init("cpu", plan.layout)
    trainer = Trainer(cfg, plan, str(out), OmegaConf.structured(cfg), d)
    x, y, docs, _ = trainer.prepare(trainer.train_batches.at(0))[0]
    # Parameters and buffers (the RoPE table) are not activations. FSDP computes with unsharded
    # parameters that exist only from its pre-forward hook on, so each module's are noted when
    # the module itself is called.
    constant: set[int] = set()
    kept: dict[int, int] = {}

    def note(module: torch.nn.Module, _args) -> None:
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            t = t.to_local() if isinstance(t, DTensor) else t
            constant.add(t.untyped_storage().data_ptr())

    for part in trainer.parts:
        for module in part.modules():
            module.register_forward_pre_hook(note)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in constant:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.forward_loss(x, y, docs)
    loss.backward()
    mem = plan.memory
    record = {
        "saved_bytes": sum(kept.values()),
        "tokens": x.numel(),
        "planned_activations": mem.activations,
        "planned_other": mem.other,
    }
    (out / f"{d.rank}.json").write_text(json.dumps(record))
