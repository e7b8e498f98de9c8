"""What FSDP holds between micro-batches under the engine's pipeline, with and without
pipeline.reshard_each_microbatch. A job of tests/group.py on 4 processes (pp=2 x dp_shard=2,
`jobs.mesh_job("parallel.reshard_check:job", (2, 2), ("pp", "dp_shard"))`): each rank's
OUT/RANK.json maps "false"/"true" to one entry per
backward this rank ran (1f1b, 4 micro-batches), taken right after it: [FSDP parameter groups
still gathered, groups in all, parameters holding an unreduced (full-size) gradient,
parameters in all].
"""

from __future__ import annotations

import torch
from jobs import patched
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining.stage import _PipelineStageBase

from launcher.parallel import pipeline_parallel
from launcher.parallel.data_parallel import apply_fsdp
from parallel.schedule_order import LOG, loss_fn, step, tiny_llama

MICROBATCHES = 4


def holding(module: torch.nn.Module) -> list[int]:
    groups = [
        g
        for m in module.modules()
        if hasattr(m, "set_reshard_after_backward")
        for g in fully_shard.state(m)._fsdp_param_groups
    ]
    params = [fp for g in groups for fp in g.fsdp_params]
    unreduced = [
        fp
        for fp in params
        if fp.unsharded_accumulated_grad is not None
        or (hasattr(fp, "_unsharded_param") and fp._unsharded_param.grad is not None)
    ]
    return [sum(g.is_unsharded for g in groups), len(groups), len(unreduced), len(params)]


def after_backward():
    """Torch's backward_one_chunk, appending what its stage holds to LOG after each call (a
    context manager)."""
    method = _PipelineStageBase.backward_one_chunk

    def wrapped(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        LOG.append(holding(self.submod))
        return out

    return patched(_PipelineStageBase, "backward_one_chunk", wrapped)


def run(reshard: bool, mesh) -> list:
    p, rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    stages = [
        (s, apply_fsdp(m, mesh["dp_shard"], True, "fp32", "fp32"))
        for s, m in pipeline_parallel.split(tiny_llama(2 * p), rank, p, 1, "1f1b")
    ]
    sched = pipeline_parallel.build_schedule(
        stages, p, "1f1b", MICROBATCHES, loss_fn, mesh["pp"], torch.device("cpu"), reshard
    )
    return step(sched, stages, p, MICROBATCHES)


def job(mesh) -> dict:
    with after_backward():
        return {str(r).lower(): run(r, mesh) for r in (False, True)}
