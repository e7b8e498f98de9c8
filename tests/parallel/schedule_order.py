"""Record the compute actions the engine's pipeline schedules really run, per rank. Run under
torchrun with P processes: `schedule_order.py OUT_DIR`; writes OUT_DIR/RANK.json mapping each
schedule to its [kind, stage, micro-batch] list.

The stages and schedules come from the engine's own launcher.parallel.pipeline (split and
build_schedule); the recording wraps torch's stage methods, so what is logged is what ran:
F = forward_one_chunk, B = backward_one_chunk (full), I = backward_one_chunk(full_backward=
False), W = backward_weight_one_chunk.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining.stage import _PipelineStageBase

import models
from launcher.parallel import pipeline
from launcher.plan import pipeline as pl

MICROBATCHES, SEQ, VOCAB = 8, 16, 64
LOG: list[tuple[str, int, int]] = []


def record(method, kind_of):
    def wrapped(self, chunk, *args, **kwargs):
        LOG.append((kind_of(kwargs), self.stage_index, chunk))
        return method(self, chunk, *args, **kwargs)

    return wrapped


_PipelineStageBase.forward_one_chunk = record(_PipelineStageBase.forward_one_chunk, lambda kw: "F")
_PipelineStageBase.backward_one_chunk = record(
    _PipelineStageBase.backward_one_chunk, lambda kw: "B" if kw.get("full_backward", True) else "I"
)
_PipelineStageBase.backward_weight_one_chunk = record(
    _PipelineStageBase.backward_weight_one_chunk, lambda kw: "W"
)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def run(schedule: str, mesh) -> list[tuple[str, int, int]]:
    p, rank = mesh.size(), mesh.get_local_rank()
    v = 1 if schedule in pl.SINGLE else 2
    torch.manual_seed(0)
    model = models.build(
        "llama",
        dict(dim=32, n_layers=p * v, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB,
             max_seq_len=SEQ),
    )  # fmt: skip
    stages = pipeline.split(model, rank, p, v, schedule)
    sched = pipeline.build_schedule(
        stages, p * v, schedule, MICROBATCHES, loss_fn, mesh, torch.device("cpu")
    )
    x = torch.randint(0, VOCAB, (MICROBATCHES, SEQ))
    first = any(s == 0 for s, _ in stages)
    last = any(s == p * v - 1 for s, _ in stages)
    LOG.clear()
    sched.step(*((x,) if first else ()), **({"target": x, "losses": []} if last else {}))
    return list(LOG)


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    orders = {s: run(s, mesh) for s in pipeline.SCHEDULES}
    (out / f"{dist.get_rank()}.json").write_text(json.dumps(orders))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
