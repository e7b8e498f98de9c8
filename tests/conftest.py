"""Shared helpers: compose configs in-process, run the CLI as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from launcher.cli import compose

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def compose_config(overrides: list[str] | None = None):
    """The typed Config the CLI would build from these overrides."""
    return compose(overrides or [])


def run_cli(module: str, *args: str, env: dict | None = None, timeout: float = 600):
    """Run `python -m module args` from the repo root; returns the CompletedProcess."""
    full_env = {**os.environ, "WANDB_SILENT": "true", **(env or {})}
    full_env.pop("WANDB_API_KEY", None)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
