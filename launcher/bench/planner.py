"""The planner's benchmarks and the CPU's matmul rate (rows of `make bench`).

- fp32 matmul throughput of one CPU thread: the `peak_tflops` of conf/hardware/cpu.yaml.
- planner: full plans per second (rules, memory, time) and layouts evaluated per second by
  the search, and the wall time of a full search for Llama 3 405B on 16,384 H100s.
"""

from __future__ import annotations

import time

import torch

from launcher.cli import compose
from launcher.plan import make_plan
from launcher.plan.search import search

SEARCH_405B = [
    "model=llama3_405b",
    "hardware=h100_80g",
    "hardware.nodes=2048",
    "train.seq_len=8192",
    "train.global_batch_size=2048",
]


def matmul_tflops(n: int = 2048, threads: int = 1, seconds: float = 3.0) -> float:
    """Sustained fp32 n^3 matmul rate of `threads` CPU threads, in TFLOP/s."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - start) / 1e12


def plans_per_second(seconds: float = 2.0) -> float:
    cfg = compose(["recipe=llama3_405b_8192gpu"])
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        make_plan(cfg)
        count += 1
    return count / (time.perf_counter() - start)


def search_405b() -> tuple[int, int, float]:
    """(layouts evaluated, layouts that fit, seconds) for the full 405B search."""
    cfg = compose(SEARCH_405B)
    start = time.perf_counter()
    evaluated, fitting = search(cfg)
    return evaluated, len(fitting), time.perf_counter() - start
