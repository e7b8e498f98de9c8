"""One vocabulary, written once: the engine builds from launcher.layout, never from the planner,
and the axis order and schedule names are spelled out in layout.py only."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

from launcher.layout import MESH_DIMS, SCHEDULES, Layout, split_layers, stage_starts

LAUNCHER = ROOT / "launcher"


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_parallel_does_not_import_the_planner():
    for path in (LAUNCHER / "parallel").glob("*.py"):
        assert not {m for m in imports(path) if m.startswith("launcher.plan")}, path


def test_layout_is_pure_python():
    assert not {m for m in imports(LAUNCHER / "layout.py") if m.split(".")[0] == "torch"}


def test_schedule_names_and_mesh_order_are_written_once():
    """No other module lists schedule names or mesh dimensions in a collection of its own
    (a formula may still compare against one name)."""
    for path in LAUNCHER.rglob("*.py"):
        if path.name == "layout.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                names = {e.value for e in items if isinstance(e, ast.Constant)}
                assert len(names & set(SCHEDULES)) < 2, f"{path}:{node.lineno}"
                assert not set(MESH_DIMS) <= names, f"{path}:{node.lineno}"


def test_derived_groups():
    lay = Layout(
        dp_replicate=2, dp_shard=4, tp=2, pp=2, cp=2, ep=1, zero_stage=3, schedule="1f1b",
        stages_per_rank=1, micro_batch_size=1, microbatches=4, recompute="none",
        sequence_parallel=True,
    )  # fmt: skip
    assert (lay.dp, lay.dp_shard_cp, lay.dp_cp, lay.world) == (8, 8, 16, 64)
    assert lay.fsdp_enabled and not lay.zero1_enabled
    assert lay.seq_len_divisor == 2 * 2 * 2  # tp (sequence parallel) x 2 cp chunks
    assert lay.mesh_shape == (2, 2, 4, 2, 2)
    assert stage_starts(split_layers(10, lay.n_stages)) == [0, 5]
