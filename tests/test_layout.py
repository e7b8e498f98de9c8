"""One vocabulary, written once: the engine builds from launcher.layout, never from the planner,
and the axis order and schedule names are spelled out in layout.py only."""

from __future__ import annotations

import ast
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
from conftest import ROOT, compose_config

from launcher.config import Config
from launcher.layout import (
    AXES,
    MESH_DIMS,
    OPTIONS,
    SCHEDULES,
    Layout,
    split_layers,
    stage_starts,
)

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
    assert lay.mesh_shape == (2, 2, 4, 2, 2)
    assert stage_starts(split_layers(10, lay.n_stages)) == [0, 5]


def schema_default(setting: str):
    """A setting's default in the config's schema, as a Layout holds it."""
    group, name = setting.split(".")
    node = next(f for f in fields(Config) if f.name == group).default_factory()
    value = getattr(node, name)
    value = getattr(value, "value", value)
    return tuple(value) if isinstance(value, list) else value


def test_every_option_is_a_setting_of_the_config_with_the_same_default():
    """A Layout field is a degree or a layout option with its record; the record's setting is
    one the config has, and the field's default is that setting's."""
    assert {f.name for f in fields(Layout)} == set(AXES) | {f.name for f, _ in OPTIONS}
    for f, opt in OPTIONS:
        if f.default is not MISSING:
            assert schema_default(opt.setting) == f.default, f.name


def test_each_search_sets_its_option_and_those_it_names():
    cfg = compose_config(["model=llama3_debug"])
    point = {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 2, "cp": 2, "ep": 1}
    for f, opt in OPTIONS:
        if opt.search is not None:
            values = opt.search(cfg, point)
            assert values, f.name
            assert all(set(v) == {f.name, *opt.also_sets} for v in values), f.name


@pytest.mark.parametrize(
    "options",
    [
        {"recompute": "op", "recompute_every": 2, "recompute_matmuls": "alternate"},
        {
            "pp": 2,
            "schedule": "interleaved_1f1b",
            "stages_per_rank": 2,
            "stage_layers": (1, 1, 1, 1),
        },
        {"pp": 2, "dp_shard": 1, "reshard_each_microbatch": True, "zero_stage": 2},
        {
            "cp": 2,
            "tp": 2,
            "context_method": "ring",
            "sequence_parallel": True,
            "loss_parallel": True,
        },
    ],
)
def test_a_layout_spelt_as_overrides_reads_back_the_same(options):
    """Layout.overrides and Layout.from_config are each other's inverse (every option spelt
    where it matters: the pipeline's only under pp > 1, the context method under cp > 1)."""
    degrees = {a: 1 for a in AXES} | {a: v for a, v in options.items() if a in AXES}
    lay = Layout(**degrees, **{k: v for k, v in options.items() if k not in AXES},
                 micro_batch_size=2, microbatches=8)  # fmt: skip
    cfg = compose_config(["model=llama3_debug", *lay.overrides()])
    assert Layout.from_config(cfg, lay.degrees) == lay


@pytest.mark.parametrize(
    "overrides",
    [
        ["hardware.devices_per_node=2", "parallel.cp=2", "parallel.dp_shard=1"],
        ["hardware.devices_per_node=4", "parallel.cp=2", "parallel.dp_shard=1",
         "parallel.dp_replicate=2"],
        ["hardware.devices_per_node=4", "parallel.cp=2", "parallel.dp_shard=2"],
        ["hardware.devices_per_node=2", "parallel.cp=2", "parallel.dp_shard=1",
         "data_parallel=ddp"],
        ["hardware.devices_per_node=2", "parallel.cp=2", "parallel.dp_shard=1",
         "data_parallel=zero1"],
        ["hardware.devices_per_node=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"],
        ["hardware.devices_per_node=2", "parallel.tp=2", "parallel.dp_shard=1"],
        ["hardware.devices_per_node=2"],
    ],
)  # fmt: skip
def test_the_plans_data_parallel_row_names_what_the_layout_builds(overrides):
    """The plan's data-parallel row (Plan.data_parallel_strategy) says what the engine builds
    by the Layout's own tests (launcher/parallel: fully_shard where fsdp_enabled, ZeRO-1 where
    zero1_enabled, else DDP over dp x cp), context-parallel ranks included."""
    from launcher.plan import engine_plan

    plan = engine_plan(compose_config(overrides))
    assert not plan.errors, plan.errors
    lay, said = plan.layout, plan.data_parallel_strategy
    if lay.dp_cp == 1:
        assert said.startswith("none"), said
    elif lay.fsdp_enabled:
        assert "FSDP" in said and ("HSDP" in said) == (lay.dp_replicate > 1), said
    elif lay.zero1_enabled:
        assert said.startswith("ZeRO-1"), said
    else:
        assert said.startswith("DDP"), said
