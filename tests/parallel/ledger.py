"""The memory ledger of the real engine, per rank, beside the planner's categories.

A job of tests/group.py: `job(OUT_DIR, "LAYOUT;RECOMPUTE", ...)` builds the engine's Trainer
for each case (space-separated overrides on both sides of the `;`), runs one training step and
writes OUT_DIR/RANK.json: {case: {category: [measured, planned] bytes}}.

- params: the parameters this rank holds (FSDP and TP shards as local tensors);
- grads: their gradients after the step's backward, before the optimizer step;
- optimizer: the Adam moments after the optimizer step (the step counters left out);
- activations: what this rank's blocks keep for backward for one micro-batch (counted as in
  saved_bytes.py, during the step's first forward of each block), times the micro-batches
  the planner says the schedule holds in flight on this rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from launcher.cli import CONF_DIR, hydra_app
from launcher.plan import bubble as pl
from launcher.plan import engine_plan
from launcher.plan.estimate import layer_activation, layout_ranks, layout_recomputed, rank_memory
from launcher.runtime import distributed
from launcher.training.trainer import Trainer
from parallel import saved_bytes
from parallel.expert_bias import BATCH


def nbytes(t: torch.Tensor) -> int:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def record_first_forward(trainer: Trainer) -> list[saved_bytes.Recorder]:
    """A recorder per block of this rank, filled by the block's first training forward."""
    shared = [t for part in trainer.parts for t in (*part.parameters(), *part.buffers())]
    recorders = []
    for part in trainer.parts:
        plain = getattr(part, "module", part)  # inside DDP's wrapper
        # The layers, and multi-token prediction's depths whole (deepseek: their own norms
        # and projection, their block, the norm before the head).
        for block in [*plain.layers.values(), *getattr(plain, "mtp", {}).values()]:
            recorders.append(saved_bytes.Recorder(shared))
            watch(block, recorders[-1])
    return recorders


def watch(block: torch.nn.Module, recorder: saved_bytes.Recorder) -> None:
    """Record what `block` keeps in its first forward that builds a graph (not a pipeline's
    shape inference under no_grad, nor a recompute in backward)."""
    hooks = torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t)
    recorder.active, state = False, {"done": False}

    def pre(module, _args):
        first = torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
        if first and not state["done"]:
            # FSDP has gathered the block's parameters by now: what backward keeps of them
            # is FSDP's (freed after forward), not activations.
            recorder.constant |= {saved_bytes.storage(p)[0] for p in module.parameters()}
            recorder.active = True
            saved_bytes.RECORDING.append(recorder)
            hooks.__enter__()

    def post(_module, _args, _out):
        if recorder.active:
            hooks.__exit__(None, None, None)
            saved_bytes.RECORDING.pop()
            recorder.active, state["done"] = False, True

    block.register_forward_pre_hook(pre)
    block.register_forward_hook(post)


def ledger(trainer: Trainer) -> dict[str, list[float]]:
    recorders = record_first_forward(trainer)
    params = [p for part in trainer.parts for p in part.parameters()]
    batch = trainer.prepare(trainer.train_batches.at(0))
    loss = trainer.forward_backward(batch)
    grads = sum(nbytes(p.grad) for p in params if p.grad is not None)
    trainer.optimizer_step(1, loss)
    optimizer = sum(
        nbytes(v)
        for opt in trainer.optimizers.optimizers
        for state in opt.state.values()
        for k, v in state.items()
        if k != "step"
    )
    lay, ctx = trainer.plan.layout, trainer.plan.context
    rank = trainer.d.local_rank_of("pp")
    planned = rank_memory(ctx, lay, rank, *layout_ranks(ctx, lay)[rank])
    inflight = pl.inflight_microbatches(
        lay.schedule, lay.pp, lay.stages_per_rank, lay.microbatches, rank
    )
    activations = inflight * sum(sum(r.kept.values()) for r in recorders)
    # The planner's activations less the block it adds for the one being recomputed.
    kept = planned.activations
    if lay.recompute in ("full", "op") and sum(layout_recomputed(ctx, lay)[rank]):
        tokens = lay.micro_batch_size * ctx.seq / lay.cp
        kept -= tokens * layer_activation(ctx, lay, True, "none")
    return {
        "params": [sum(nbytes(p) for p in params), planned.params],
        "grads": [grads, planned.grads],
        "optimizer": [optimizer, planned.optimizer + planned.master],
        "activations": [activations, kept],
    }


def job(out: Path, *cases: str) -> None:
    """Each case ("LAYOUT;RECOMPUTE" overrides) in turn, its meshes over this group; writes
    OUT/RANK.json {case: ledger}."""
    hydra_app(lambda cfg: None)  # registers the schema
    result = {}
    for case in cases:
        layout, mode = case.split(";")
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            model = [] if "model=" in layout else ["model=llama3_debug"]
            args = [*BATCH, *model, *layout.split(), *mode.split()]
            dcfg = compose("config", overrides=args)
        cfg = OmegaConf.to_object(dcfg)
        plan = engine_plan(cfg)
        assert plan.ok, plan.errors
        d = distributed.init("cpu", plan.layout)
        trainer = Trainer(cfg, plan, str(out / f"run{d.rank}_{len(result)}"), dcfg, d)
        result[case] = ledger(trainer)
    (out / f"{d.rank}.json").write_text(json.dumps(result))
