"""Where the processes come from: join torchrun or SLURM, or relaunch under torchrun locally."""

from __future__ import annotations

import os
import subprocess
import sys

from launcher.cli import fail

# Set by relaunch() in the children, so that they do not print the plan a second time.
CHILD_ENV = "LAUNCHER_CHILD"


def slurm_env() -> None:
    """Map a SLURM task (srun without torchrun) onto torch.distributed's env:// variables."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    if int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
        hosts = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True
        ).stdout.split()
        os.environ["MASTER_ADDR"] = hosts[0] if hosts else "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", 0)) % 1000))


def in_distributed_env() -> bool:
    """True inside torchrun (or another env:// launcher) or a multi-task SLURM step."""
    slurm_env()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_child() -> bool:
    return os.environ.get(CHILD_ENV) == "1"


def relaunch(nodes: int, devices_per_node: int, overrides: list[str], run_dir: str) -> int:
    """Run this command again under torchrun with one process per device; return its status."""
    if nodes > 1:
        fail(
            f"hardware.nodes={nodes}: a multi-node run starts on every node under SLURM or "
            "torchrun; launched by hand it can only use one node (use launcher.plan to check "
            "a multi-node layout)"
        )
    env = dict(os.environ, **{CHILD_ENV: "1"})
    # One BLAS thread pool per process sharing the cores, not one per core per process.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // devices_per_node)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={devices_per_node}",
        "-m",
        "launcher.train",
        *overrides,
        f"hydra.run.dir='{run_dir}'",
        "hydra.output_subdir=null",
    ]
    return subprocess.call(cmd, env=env)
