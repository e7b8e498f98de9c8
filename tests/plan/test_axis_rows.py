"""The plan's rows for the axes say what the engine builds (issue 65): launcher.layout's
axis_rows, from the Layout, held over 200 random layouts to the meshes the engine builds for
them (launcher.runtime.distributed.mesh_dist over a fake process group of the layout's world)
and to the branches the engine takes (launcher/parallel/__init__.py: fully_shard where
fsdp_enabled, DDP or the trainer's average over dp x cp otherwise; launcher/training/optim.py:
ZeRO-1's optimizer where zero1_enabled; the TP plan's sequence parallelism under tp > 1)."""

from __future__ import annotations

import random
from dataclasses import replace

import torch
import torch.distributed as dist
from conftest import compose_config
from torch.testing._internal.distributed.fake_pg import FakeStore

from launcher.layout import SCHEDULES, Layout, axis_rows
from launcher.plan import engine_plan
from launcher.runtime.distributed import mesh_dist

DEGREES = (1, 2, 4)


def random_layouts(n: int, seed: int = 0):
    rng = random.Random(seed)
    base = engine_plan(compose_config([])).layout
    for _ in range(n):
        degrees = {a: rng.choice(DEGREES) for a in ("dp_replicate", "dp_shard", "tp", "pp", "cp")}
        yield replace(
            base,
            **degrees,
            ep=1,
            zero_stage=rng.choice((0, 1, 2, 3)),
            recompute=rng.choice(("none", "selective", "op", "full")),
            recompute_every=rng.choice((1, 2)),
            recompute_matmuls=rng.choice(("all", "alternate")),
            sequence_parallel=rng.choice((False, True)),
            schedule=rng.choice(SCHEDULES),
            stages_per_rank=rng.choice((1, 2)),
        )


def engine_meshes(lay: Layout) -> dict[str, tuple[int, ...]]:
    """The shapes of the data-parallel meshes the engine builds for `lay`."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=lay.world)
    try:
        d = mesh_dist(lay, "cpu", torch.device("meta"), rank=0)
        return {
            "fsdp": tuple(d.fsdp_mesh.shape),
            "shard": tuple(d.shard_mesh.shape),
            "dp_cp": tuple(d.dp_cp_mesh.shape),
        }
    finally:
        dist.destroy_process_group()


def test_the_axis_rows_name_what_the_engine_builds_over_200_random_layouts():
    seen = set()
    for lay in random_layouts(200):
        rows, meshes = axis_rows(lay), engine_meshes(lay)
        dp = rows["data parallel"]
        if lay.dp_cp == 1:
            kind = "none"
            assert dp.startswith("none"), (dp, lay)
        elif lay.fsdp_enabled:  # fully_shard over d.fsdp_mesh
            kind = "fsdp"
            name = "FSDP" if lay.zero_stage == 3 else "ZeRO-2"
            assert name in dp and ("HSDP" in dp) == (len(meshes["fsdp"]) == 2), (dp, lay)
            if len(meshes["fsdp"]) == 2:
                assert f"({meshes['fsdp'][0]} x {meshes['fsdp'][1]})" in dp, (dp, meshes)
        elif lay.zero1_enabled:  # ZeRO-1's states over d.shard_mesh
            kind = "zero1"
            assert dp.startswith("ZeRO-1") and meshes["shard"] == (lay.dp_shard_cp,), (dp, lay)
        else:  # DDP (or the trainer's average) over d.dp_cp_mesh
            kind = "ddp"
            assert dp.startswith("DDP") and meshes["dp_cp"] == (lay.dp_cp,), (dp, lay)
            if lay.cp > 1:
                assert f"({meshes['dp_cp'][0]} ranks)" in dp, (dp, meshes)
        seen.add(kind)
        assert ("pipeline" in rows) == (lay.pp > 1), (rows, lay)
        if lay.pp > 1:
            assert rows["pipeline"].startswith(f"{lay.schedule}, {lay.stages_per_rank} stage"), rows
        recompute = rows["recompute"]
        assert recompute.split(",")[0].split(" on ")[0] == lay.recompute, (recompute, lay)
        sp = lay.sequence_parallel and lay.tp > 1  # apply_tp's sequence parallelism
        assert ("sequence parallel" in recompute) == sp, (recompute, lay)
    assert seen == {"none", "fsdp", "zero1", "ddp"}


def test_the_plan_prints_the_rows_of_its_layout(capsys):
    from launcher.plan.report import print_plan

    plan = engine_plan(
        compose_config(["hardware.devices_per_node=2", "parallel.tp=2", "parallel.dp_shard=1",
                        "tensor.sequence_parallel=true", "parallel.pp=1"])
    )  # fmt: skip
    print_plan(plan)
    out = capsys.readouterr().out
    for name, text in axis_rows(plan.layout).items():
        assert any(name in line and text in line for line in out.splitlines()), (name, text)
    # Sequence parallelism asked for at tp=1 is not built, and not said.
    flat = engine_plan(compose_config(["tensor.sequence_parallel=true", "parallel.tp=1"]))
    assert "sequence parallel" not in axis_rows(flat.layout)["recompute"]
