"""ZeRO-1: the Adam states sharded over the data-parallel ranks that hold the same parameters.

Each rank of the group owns a share of the parameters (whole tensors, or whole local shards of
tensor-parallel DTensors), keeps the Adam states of its share only, steps them, and broadcasts
the updated values to the other ranks; the gradients arrive averaged and whole on every rank
(DDP or the trainer). torch's ZeroRedundancyOptimizer does the same for plain tensors but
broadcasts the parameters themselves, which DTensor (tensor parallelism) has no rule for; this
one broadcasts each parameter's local tensor, so ZeRO-1 composes with tp as Megatron's
distributed optimizer does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from launcher.parallel.data_parallel import local_tensor as local


def owners(params: list[nn.Parameter], ranks: int, states: list[int] | None = None) -> list[int]:
    """The rank of the group that owns each parameter: largest first, each to the least loaded
    rank so far (ties to the lowest rank), so every rank of the group computes the same split.
    `states`: how many states per element each parameter's optimizer keeps (Muon's momentum
    1, Adam's moments 2), when the optimizers of one group are split together."""
    states = [1] * len(params) if states is None else states
    size = [n * local(p).numel() for p, n in zip(params, states, strict=True)]
    load = [0] * ranks
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -size[i]):
        r = min(range(ranks), key=lambda r: load[r])
        owner[i] = r
        load[r] += size[i]
    return owner


class Zero1:
    """An optimizer over the parameters of `param_groups` whose states live on their owners.

    `optim` is the inner optimizer over this rank's share (its param_groups and state are what
    checkpoints read and write); `param_groups` is that share's, so a learning rate set on them
    reaches every parameter this rank steps."""

    def __init__(self, param_groups: list[dict], optimizer_class, group, owner=None, **kwargs):
        """`owner`: the owning rank of each parameter, where a split over several optimizers
        of the group was made for them together (`owners`); else this one's own."""
        self.group = group
        self.params = [p for g in param_groups for p in g["params"]]
        ranks, me = dist.get_world_size(group), dist.get_rank(group)
        self.owner = owners(self.params, ranks) if owner is None else owner
        mine = {p for p, r in zip(self.params, self.owner, strict=True) if r == me}
        share = [{**g, "params": [p for p in g["params"] if p in mine]} for g in param_groups]
        self.optim = optimizer_class(share, **kwargs)
        # The global rank of each owner, for the broadcasts.
        self.sources = [dist.get_global_rank(group, r) for r in range(ranks)]

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

    @property
    def state(self) -> dict:
        """The Adam states this rank keeps (of its share only)."""
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Step this rank's share, then every owner broadcasts its updated share (one
        flattened broadcast per owner and dtype)."""
        self.optim.step()
        me = dist.get_rank(self.group)
        for r, src in enumerate(self.sources):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p, owner in zip(self.params, self.owner, strict=True):
                if owner == r:
                    by_dtype.setdefault(p.dtype, []).append(local(p))
            for tensors in by_dtype.values():
                sizes = [t.numel() for t in tensors]
                if r == me:
                    flat = torch.cat([t.reshape(-1) for t in tensors])
                else:
                    flat = tensors[0].new_empty(sum(sizes))
                dist.broadcast(flat, src=src, group=self.group)
                if r == me:
                    continue
                for t, part in zip(tensors, flat.split(sizes), strict=True):
                    t.copy_(part.view_as(t))
