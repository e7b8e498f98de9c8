"""Record the compute actions the engine's pipeline schedules really run, per rank. A job of
tests/group.py on P processes (`jobs.mesh_job("parallel.schedule_order:job", (P,), ("pp",))`):
each rank's OUT/RANK.json maps each schedule to its [kind, stage, micro-batch] list.

The stages and schedules come from the engine's own launcher.parallel.pipeline_parallel (split and
build_schedule); the recording wraps torch's stage methods, so what is logged is what ran:
F = forward_one_chunk, B = backward_one_chunk (full), I = backward_one_chunk(full_backward=
False), W = backward_weight_one_chunk. The helpers are shared with reshard_check.py.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from jobs import patched
from torch.distributed.pipelining.stage import _PipelineStageBase

from launcher import models
from launcher.layout import SINGLE
from launcher.parallel import pipeline_parallel

MICROBATCHES, SEQ, VOCAB = 8, 16, 64
LOG: list = []


def record(name: str, entry):
    """Torch's stage method `name`, appending entry(stage, chunk, kwargs) to LOG at each call
    (a context manager)."""
    method = getattr(_PipelineStageBase, name)

    def wrapped(self, chunk, *args, **kwargs):
        LOG.append(entry(self, chunk, kwargs))
        return method(self, chunk, *args, **kwargs)

    return patched(_PipelineStageBase, name, wrapped)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tiny_llama(n_layers: int):
    torch.manual_seed(0)
    return models.build(
        "llama",
        dict(dim=32, n_layers=n_layers, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB,
             max_seq_len=SEQ),
    )  # fmt: skip


def step(sched, stages, n_stages: int, microbatches: int) -> list:
    """One schedule step on random tokens; what LOG gathered during it."""
    x = torch.randint(0, VOCAB, (microbatches, SEQ))
    first = any(s == 0 for s, _ in stages)
    last = any(s == n_stages - 1 for s, _ in stages)
    LOG.clear()
    sched.step(*((x,) if first else ()), **({"target": x, "losses": []} if last else {}))
    return list(LOG)


def run(schedule: str, mesh) -> list:
    p, rank = mesh.size(), mesh.get_local_rank()
    v = 1 if schedule in SINGLE else 2
    stages = pipeline_parallel.split(tiny_llama(p * v), rank, p, v, schedule)
    sched = pipeline_parallel.build_schedule(
        stages, p * v, schedule, MICROBATCHES, loss_fn, mesh, torch.device("cpu")
    )
    return step(sched, stages, p * v, MICROBATCHES)


def job(mesh) -> dict:
    with contextlib.ExitStack() as stack:
        for name, kind in (("forward_one_chunk", "F"), ("backward_weight_one_chunk", "W")):
            stack.enter_context(
                record(name, lambda stage, chunk, kw, kind=kind: (kind, stage.stage_index, chunk))
            )
        stack.enter_context(
            record(
                "backward_one_chunk",
                lambda stage, chunk, kw: (
                    "B" if kw.get("full_backward", True) else "I",
                    stage.stage_index,
                    chunk,
                ),
            )
        )
        return {s: run(s, mesh) for s in pipeline_parallel.SCHEDULES}
