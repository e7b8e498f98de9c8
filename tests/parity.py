"""Parity harness: run a layout on N local processes and compare it with one process.

Per-step losses and gradient norms, and the final parameters (gathered from every shard), are
compared against the single-process run of the same seed, data and global batch. Add a row by
naming its overrides; a failing row says which step (or which parameter) and how far off.
"""

from __future__ import annotations

from pathlib import Path

from conftest import read_metrics, run_cli

# Same seed, data and global batch for every layout; fp32 so that only summation order differs.
BASE = [
    "train.steps=6",
    "train.warmup_steps=2",
    "train.eval_interval=0",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "precision=fp32",
    "logging.wandb.mode=disabled",
    "train.save_final=true",
]


def run_layout(run_dir: Path, overrides: list[str], key: str = "loss") -> list[float]:
    """Per-step `key` of one training run of the layout (the CLI, exactly as a user runs it)."""
    result = run_cli("launcher.train", *BASE, *overrides, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, (
        f"layout {overrides} failed (exit {result.returncode}):\n{result.stderr[-4000:]}"
    )
    return [row[key] for row in read_metrics(run_dir)]


def read_layout(run_dir: Path, key: str) -> list[float]:
    """Another metric of a run already made by run_layout."""
    return [row[key] for row in read_metrics(run_dir)]


def assert_parity(reference: list[float], got: list[float], rtol: float, label: str) -> None:
    assert len(got) == len(reference), f"{label}: {len(got)} steps, reference {len(reference)}"
    bad = [
        f"step {i + 1}: reference {r:.8f} vs {g:.8f} (relative {abs(g - r) / abs(r):.2e})"
        for i, (r, g) in enumerate(zip(reference, got, strict=True))
        if abs(g - r) > rtol * abs(r)
    ]
    assert not bad, f"{label} differs from the single process beyond {rtol:g}:\n" + "\n".join(bad)


def assert_params_match(ref_dir: Path, run_dir: Path, rtol: float, atol: float, label: str):
    """Every final parameter of the layout against the single process, worst first."""
    import torch

    ref = torch.load(ref_dir / "final_model.pt")
    got = torch.load(run_dir / "final_model.pt")
    assert ref.keys() == got.keys(), f"{label}: parameter names differ: {ref.keys() ^ got.keys()}"
    bad = []
    for name, r in ref.items():
        diff = (got[name] - r).abs()
        limit = atol + rtol * r.abs()
        if (diff > limit).any():
            bad.append((float(diff.max()), name))
    bad.sort(reverse=True)
    assert not bad, f"{label}: final parameters differ (max abs diff, name): {bad[:5]}"


def assert_layout_matches(
    ref_dir: Path,
    ref_losses: list[float],
    run_dir: Path,
    overrides: list[str],
    label: str,
    param_atol: float = 1e-4,
) -> None:
    """Run a layout and hold it to the reference: losses within 1e-5 relative, gradient norms
    within 5e-4 (a vocab-parallel loss sums its softmax in another order, and the norm squares
    and adds every gradient), final parameters within 1e-4 relative + `param_atol` (Adam divides
    by each gradient's running RMS, so near-zero gradients carry rounding into the update at the
    scale of lr)."""
    assert_parity(ref_losses, run_layout(run_dir, overrides), rtol=1e-5, label=label)
    assert_parity(
        read_layout(ref_dir, "grad_norm"),
        read_layout(run_dir, "grad_norm"),
        rtol=5e-4,
        label=f"{label} grad_norm",
    )
    assert_params_match(ref_dir, run_dir, rtol=1e-4, atol=param_atol, label=label)
