"""The loss's memory peak the planner counts on the last stage (LOSS_BYTES_PER_LOGIT per logit
element), against the CPU allocator's own events while the engine's loss_fn runs forward and
backward: what the planner missed on an H200 (docs/speed.md, "On one GPU")."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config
from torch.profiler import ProfilerActivity, profile

from launcher.plan import make_plan
from launcher.plan.estimate import LOSS_BYTES_PER_LOGIT
from launcher.training.trainer import loss_fn

TOKENS, DIM, VOCAB = 512, 8, 8192


def allocator_peak(run) -> int:
    """The largest number of bytes the CPU allocator held at once while `run()` ran, counted
    from the profiler's allocation and free events (those made before it started excluded)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loss_peak_per_logit(dtype, compiled):
    """Eager, LOSS_BYTES_PER_LOGIT; compiled (as the trainer runs it under train.compile),
    the logits and their gradient in the compute dtype."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, TOKENS, DIM, generator=gen).to(dtype).requires_grad_()
    head = torch.randn(VOCAB, DIM, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (1, TOKENS), generator=gen)
    loss = torch.compile(loss_fn) if compiled else loss_fn

    def step():
        loss(x @ head.T, targets).backward()

    step()  # compiles outside the measured step
    x.grad = head.grad = None
    # The head's input and weight gradients are allocated too: at most 0.2 bytes per logit.
    per_logit = allocator_peak(step) / (TOKENS * VOCAB)
    expected = 2 * dtype.itemsize if compiled else LOSS_BYTES_PER_LOGIT
    assert per_logit == pytest.approx(expected, rel=0.05)


def test_last_stage_counts_the_loss_peak():
    """The planner's last-stage memory grows by LOSS_BYTES_PER_LOGIT x tokens x vocabulary per
    micro-batch token: a micro-batch of twice the tokens adds exactly that much more `other`
    beyond what the layers add to `activations`."""
    base = [
        "model=llama3_2_1b",
        "hardware=h200",
        "hardware.devices_per_node=1",
        "train.micro_batch_size=1",
    ]
    small, large = (
        make_plan(compose_config([*base, f"train.seq_len={s}", "train.global_batch_size=8"]))
        for s in (2048, 4096)
    )
    grown = large.memory.other - small.memory.other
    assert grown == pytest.approx(2048 * 128_256 * LOSS_BYTES_PER_LOGIT)
    small, large = (
        make_plan(compose_config([*base, "train.compile=true", f"train.seq_len={s}"]))
        for s in (2048, 4096)
    )
    grown = large.memory.other - small.memory.other
    assert grown == pytest.approx(2048 * 128_256 * 2 * 2)  # bf16 logits and their gradient
    # Compiled blocks with the loss left eager (train.compile_loss=false): the eager peak.
    small, large = (
        make_plan(
            compose_config(
                [*base, "train.compile=true", "train.compile_loss=false", f"train.seq_len={s}"]
            )
        )
        for s in (2048, 4096)
    )
    grown = large.memory.other - small.memory.other
    assert grown == pytest.approx(2048 * 128_256 * LOSS_BYTES_PER_LOGIT)


def test_the_trainer_compiles_the_loss_only_when_asked(tmp_path):
    """train.compile compiles the loss with the blocks; train.compile_loss=false leaves it
    eager (the function itself, no compiled wrapper)."""
    from jobs import trainer_of

    from launcher.training.trainer import loss_fn

    base = ["model=llama3_debug", "hardware.devices_per_node=1", "train.compile=true"]
    for extra, compiled in (([], True), (["train.compile_loss=false"], False)):
        _, _, trainer = trainer_of(tmp_path / str(compiled), [*base, *extra])
        assert (trainer.loss is not loss_fn) == compiled, extra
