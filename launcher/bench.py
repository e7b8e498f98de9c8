"""`make bench`: the measurements behind figures the project quotes.

- fp32 matmul throughput of one CPU thread: the `peak_tflops` of conf/hardware/cpu.yaml.
- plan checks per second: how fast the planner validates a layout.
"""

from __future__ import annotations

import time

import torch
from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

from launcher.cli import CONF_DIR, hydra_app, to_config
from launcher.plan import make_plan


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
    hydra_app(lambda cfg: None)  # registers the schema and resolvers
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = to_config(compose("config", overrides=["model=llama3_405b", "hardware=h100_80g"]))
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        make_plan(cfg)
        count += 1
    return count / (time.perf_counter() - start)


def main() -> None:
    console = Console()
    table = Table(title="bench", title_justify="left")
    table.add_column("measurement")
    table.add_column("value", justify="right")
    with console.status("fp32 matmul, 1 thread"):
        table.add_row("fp32 matmul 2048^3, 1 CPU thread", f"{matmul_tflops():.3f} TFLOP/s")
    with console.status("planner"):
        table.add_row("plan checks (llama3_405b on h100_80g)", f"{plans_per_second():,.0f} / s")
    console.print(table)


if __name__ == "__main__":
    main()
