"""Muon (launcher/training/muon.py) on one process against torch.optim.Muon: the same updates
over 10 steps, for both learning-rate adjustments, on a matrix, a wide and a tall one, and on a
stack of experts (each against its own torch.optim.Muon)."""

from __future__ import annotations

import pytest
import torch
from group import Job

from launcher.training.muon import Muon

TORCH_ADJUST = {"original": "original", "match_rms_adamw": "match_rms_adamw"}


def train(make, params, steps: int = 10, seed: int = 0) -> list[torch.Tensor]:
    """`steps` steps of an optimizer over params on a fixed quadratic loss; the final values."""
    opt = make(params)
    gen = torch.Generator().manual_seed(seed)
    targets = [torch.randn(p.shape, generator=gen) for p in params]
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(
            ((p - t) ** 2 * (1 + i)).sum()
            for i, (p, t) in enumerate(zip(params, targets, strict=True))
        )
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(48, 48), (32, 80), (96, 24)])
def test_a_matrix_steps_as_torch_muon(shape, adjust):
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    start = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours = train(lambda ps: Muon(ps, adjust_lr=adjust, **kw), [start.clone().requires_grad_()])
    theirs = train(lambda ps: torch.optim.Muon(ps, adjust_lr_fn=TORCH_ADJUST[adjust], **kw),
                   [start.clone().requires_grad_()])  # fmt: skip
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
    assert not torch.equal(ours[0], start)


def test_without_nesterov_too():
    kw = dict(lr=0.02, weight_decay=0.0, momentum=0.9, nesterov=False)
    start = torch.randn(40, 56, generator=torch.Generator().manual_seed(2))
    ours = train(lambda ps: Muon(ps, adjust_lr="original", **kw), [start.clone().requires_grad_()])
    theirs = train(lambda ps: torch.optim.Muon(ps, **kw), [start.clone().requires_grad_()])
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)


def test_a_stack_of_experts_is_each_expert_alone():
    """A (E, A, B) stack steps as E matrices each with its own torch.optim.Muon (one batched
    iteration rounds as the single ones do, but for bf16's last bit here and there)."""
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    gen = torch.Generator().manual_seed(3)
    start, target = torch.randn(4, 24, 40, generator=gen), torch.randn(4, 24, 40, generator=gen)
    stack = start.clone().requires_grad_()
    singles = [start[e].clone().requires_grad_() for e in range(4)]
    ours = Muon([stack], adjust_lr="match_rms_adamw", **kw)
    theirs = torch.optim.Muon(singles, adjust_lr_fn="match_rms_adamw", **kw)
    for _ in range(10):
        for opt, loss in ((ours, ((stack - target) ** 2).sum()),
                          (theirs, sum(((w - target[e]) ** 2).sum()
                                       for e, w in enumerate(singles)))):  # fmt: skip
            opt.zero_grad()
            loss.backward()
            opt.step()
    for e, w in enumerate(singles):
        torch.testing.assert_close(stack[e].detach(), w.detach(), rtol=0, atol=2e-3)
    assert not torch.equal(stack.detach(), start)


def test_a_vector_is_refused():
    with pytest.raises(ValueError, match="matrices and stacks of them"):
        Muon([torch.zeros(8, requires_grad=True)])


SHARDS = Job("parallel.muon_shards:job", 4, (), "muon on DTensor shards")


@pytest.mark.dist
@pytest.mark.jobs(SHARDS)
def test_a_split_matrix_steps_as_the_whole_one(group):
    """Each matrix split over ranks (rows, columns, both on a 2 x 2 mesh, a stack of experts by
    rows or whole, HSDP's copies) or copied whole (DDP) is orthogonalised whole: its final value
    equals one process's Muon on the whole tensor (bitwise: the owner computes what one process
    does), and each matrix once a step over all the ranks, not once on each holder."""
    from parallel.muon_shards import MATRICES, SHAPES, STEPS, start, stepped

    got = torch.load(group.result(SHARDS) / "muon.pt")
    assert got["results"].keys() == SHAPES.keys()
    for name in SHAPES:
        value, target = start(name)
        param = torch.nn.Parameter(value.clone())
        stepped(param, target)
        torch.testing.assert_close(got["results"][name], param.detach(), rtol=0, atol=0, msg=name)
        assert got["counts"][name] == [MATRICES[name]] * STEPS, name


def test_owners_spread_the_newton_schulz_work_over_the_holders():
    """Eight equal matrices split by rows over 4 ranks: two owned by each rank, each assembled
    from all four pieces; a stack whose experts each rank holds whole is orthogonalised where
    it lies; pieces that do not tile their matrix are refused by name."""
    from launcher.training import spread

    rows = {r: ((slice(8 * r, 8 * r + 8), slice(0, 16)), (0, ())) for r in range(4)}
    units = spread.plan([((32, 16), rows)] * 8, steps=5)
    assert sorted(u.owner for u in units) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(sorted(u.sources) == [0, 1, 2, 3] for u in units)
    whole = {r: ((slice(2 * r, 2 * r + 2), slice(0, 32), slice(0, 16)), (0, ())) for r in range(4)}
    stack = spread.plan([((8, 32, 16), whole)], steps=5)
    assert [(u.index, u.owner, list(u.sources)) for u in stack] == [
        (e, e // 2, [e // 2]) for e in range(8)
    ]
    gap = {0: ((slice(0, 8), slice(0, 16)), (0, ())), 1: ((slice(16, 32), slice(0, 16)), (0, ()))}
    with pytest.raises(ValueError, match=r"\[32, 16\] matrix on ranks \[0, 1\] do not tile it"):
        spread.plan([((32, 16), gap)], steps=5)
