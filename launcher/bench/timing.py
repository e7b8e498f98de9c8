"""Timing steps on a shared, noisy machine.

Whole runs on this machine land up to 40% slower at random (other jobs share its cores). A
ratio of two figures measured minutes apart is then mostly noise. So the contenders of a
comparison take turns: round r runs `steps` steps of each, in an order rotated every round, so
that a slow spell falls on all of them alike. Every step is timed on its own (synchronised
at both ends), and a contender's figure is its fastest step: the least disturbed one, as noise
only ever adds time, and every step does the same work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from launcher.bench.peers import Step


@contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's CPU threads set to `n` for the timed work (torchrun: 1 a process), then back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; CPU does not)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_step(step: Step, steps: int, device: torch.device) -> float:
    """Mean wall time of `steps` steps, synchronised only at both ends."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def interleaved(
    contenders: dict[str, Step],
    rounds: int,
    steps: int,
    warmup: int,
    device: torch.device,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, list[list[float]]]:
    """Each contender's seconds for every step of every round (see the module docstring)."""
    names = list(contenders)
    for name in names:
        progress(f"warm-up: {name}")
        for _ in range(warmup):
            contenders[name]()
    out: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            progress(f"round {r + 1}/{rounds}: {name}")
            out[name].append([seconds_per_step(contenders[name], 1, device) for _ in range(steps)])
    return out


def least_disturbed(rounds: list[list[float]]) -> float:
    """The fastest step of all rounds."""
    return min(min(r) for r in rounds)
