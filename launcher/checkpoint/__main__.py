"""`python -m launcher.checkpoint list RUN_DIR` and `... export CKPT OUT.pt`.

list: every checkpoint under RUN_DIR/checkpoints (or a checkpoint directory given directly):
step, complete or not, the layout it was saved under, size on disk.
export: the model of one complete checkpoint as a plain `torch.save` state dict of full
tensors, keyed by the plain model's parameter names (loadable with `model.load_state_dict`
on one process, whatever layout saved it). It streams: one tensor in memory at a time, read
from the checkpoint's shard files, so a model larger than this machine's memory exports.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

from launcher.runtime.imports import uncollected

with uncollected():  # torch's distributed checkpoint
    from launcher.checkpoint import reader, stream
from launcher.checkpoint.store import (
    CheckpointError,
    list_checkpoints,
    open_checkpoint,
    resolve_checkpoint_dir,
)
from launcher.cli import USAGE_ERROR, fail
from launcher.runtime.scratch import command, output_problem, writing

# One process (no process group) is a supported way to save and load, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return ""


def list_command(path: Path) -> int:
    if not path.is_dir():
        fail(f"{path} is not a directory")
    directory = resolve_checkpoint_dir(path)
    entries = list_checkpoints(directory)
    console = Console(width=None if Console().is_terminal else 120)
    if not entries:
        console.print(f"no checkpoints in {directory}")
        return 0
    table = Table(title=f"checkpoints in {directory}", title_justify="left")
    for col in ("step", "status", "saved under", "size", "saved at", "path"):
        table.add_column(col, justify="right" if col in ("step", "size") else "left")
    for e in entries:
        table.add_row(
            str(e.step),
            "complete" if e.complete else "[red]incomplete[/red]",
            e.layout,
            size(e.size_bytes),
            (e.meta or {}).get("saved_at", "-"),
            e.path.name,
        )
    console.print(table)
    return 0


def export_command(path: Path, out: Path) -> int:
    if problem := output_problem(out, "OUT"):
        fail(problem)
    # Nothing is written over: not a file of the checkpoint read, nor one the launcher did not
    # make (the run's metrics.jsonl, an earlier export a user keeps).
    if out.exists() or out.is_symlink():
        fail(f"OUT {out} already exists; choose another path or remove it")
    if out.absolute().is_relative_to(path.absolute()):
        fail(f"OUT {out} is inside the checkpoint it exports ({path}); choose a path outside it")
    try:
        entry = open_checkpoint(path)
    except CheckpointError as e:
        fail(str(e))
    from rich.progress import track

    damaged = reader.checkpoint_damage(entry)  # files, checksums, the metadata's allow-list
    if damaged:
        fail(f"{entry.path} is damaged: {'; '.join(damaged)}")
    tensors = stream.model_tensors(entry)
    shapes = {name: (tuple(m.size), m.properties.dtype) for name, m in tensors.items()}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only or full disk
        fail(f"OUT {out} cannot be written: {e.strerror or e} ({e.filename})")
    # One tensor in memory at a time (launcher/checkpoint/stream.py), written under a
    # temporary name, removed however the export ends: OUT appears whole or not at all.
    with writing(out) as partial:
        stream.save_streamed(
            partial,
            shapes,
            lambda name: stream.read_tensor(entry, name, tensors[name]),
            lambda names: track(names, description="exporting", transient=True),
        )
        partial.replace(out)
    n = sum(math.prod(shape) for shape, _ in shapes.values())
    print(f"wrote {out}: {len(shapes)} tensors, {n:,} parameters, step {entry.step}")
    return 0


@command("nothing was written, and nothing half-written is left")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="list the checkpoints of a run directory")
    p_list.add_argument("run_dir", type=Path, help="RUN_DIR (or a checkpoints directory)")
    p_export = sub.add_parser("export", help="write one checkpoint's model as OUT.pt")
    p_export.add_argument("checkpoint", type=Path, help="a complete step_NNNNNNNN directory")
    p_export.add_argument("out", type=Path, help="the .pt file to write")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return USAGE_ERROR if e.code else 0
    if args.command == "list":
        return list_command(args.run_dir)
    return export_command(args.checkpoint, args.out)


if __name__ == "__main__":
    sys.exit(main())
