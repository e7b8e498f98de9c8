"""launcher.selftest's rows and its comparison, without a process group (the command itself:
tests/e2e/test_selftest.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from launcher.cli import compose
from launcher.plan import engine_plan
from launcher.selftest.compare import compare
from launcher.selftest.rows import BASE, recipe_row, rows_for


@pytest.mark.parametrize("world", [3, 4, 6, 8, 16])  # 2: tests/e2e/test_selftest.py
def test_each_row_fills_the_world_splits_the_axes_it_names_and_is_planned(world):
    """Every row drawn for a world uses all of it, splits each axis it names (so a row that
    passes proves that axis), and is a layout launcher.train runs: no row is drawn to be
    refused. On 2, 4 and 8 ranks every axis of the engine is drawn."""
    rows = rows_for(world)
    assert len({r.name for r in rows}) == len(rows)
    for row in rows:
        cfg = compose([f"hardware.devices_per_node={world}", *BASE, *row.reference, *row.layout])
        plan = engine_plan(cfg)
        assert plan.ok, (row.name, plan.errors)
        assert plan.world_size == world
        for axis in row.axes:
            assert getattr(plan.layout, axis) > 1, (row.name, axis)
    drawn = {axis for r in rows for axis in r.axes}
    if world in (4, 8, 16):
        assert drawn == {"dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"}
    assert rows_for(1) == []


def write_run(path, losses, norms, params):
    path.mkdir(parents=True)
    rows = [
        {"step": i, "loss": x, "grad_norm": g}
        for i, (x, g) in enumerate(zip(losses, norms, strict=True), 1)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.save(params, path / "final_model.pt")


def test_a_row_fails_on_each_kind_of_difference_and_says_where(tmp_path):
    """Losses beyond 1e-5 relative, a gradient norm beyond 5e-4, one parameter element beyond
    1e-4 + 1e-4 x |reference|, a missing parameter: each fails the row by itself, and the
    reason names the step or the parameter; differences inside every tolerance pass."""
    weight = torch.linspace(-1, 1, 12).reshape(3, 4)
    ref = tmp_path / "ref"
    write_run(ref, [5.0, 4.0], [2.0, 1.5], {"w": weight})

    def verdict(name, losses=(5.0, 4.0), norms=(2.0, 1.5), params=None):
        write_run(tmp_path / name, list(losses), list(norms), params or {"w": weight})
        return compare(ref, tmp_path / name, cp=1)

    near = weight.clone()
    near[0, 0] += 5e-5
    ok = verdict("ok", (5.0 * (1 + 5e-6), 4.0), (2.0 * (1 + 4e-4), 1.5), {"w": near})
    assert (
        ok.passed
        and ok.detail == ""
        and 0 < ok.loss < 1e-5
        and ok.params == pytest.approx(5e-5, rel=1e-3)
    )
    loss = verdict("loss", (5.0, 4.0 * (1 + 3e-5)))
    assert not loss.passed and "loss at step 2" in loss.detail
    norm = verdict("norm", norms=(2.0, 1.5 * (1 + 1e-3)))
    assert not norm.passed and "grad_norm at step 2" in norm.detail and "loss" not in norm.detail
    far = weight.clone()
    far[2, 3] += 2.5e-4  # |reference| 1.0: over 1e-4 + 1e-4, inside CP's 2e-4 + 1e-4
    param = verdict("param", params={"w": far})
    assert not param.passed and "final parameters, w: max difference 0.00025" in param.detail
    assert compare(ref, tmp_path / "param", cp=2).passed
    missing = verdict("missing", params={"v": weight})
    assert not missing.passed and "parameter names differ" in missing.detail
    short = verdict("short", (5.0,), (2.0,))
    assert not short.passed and "1 steps against the reference's 2" in short.detail


def recipe_choices(name: str, world: int):
    """A recipe composed as the command composes it (its Hydra choices too), on `world` CPU
    ranks of one node."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    from launcher.cli import CONF_DIR, hydra_app, to_config

    hydra_app(lambda cfg: None)
    overrides = [f"recipe={name}", "hardware=cpu", "hardware.nodes=1"]
    overrides.append(f"hardware.devices_per_node={world}")
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        d = hydra_compose("config", overrides=overrides, return_hydra_config=True)
    choices = dict(d.hydra.runtime.choices)
    with open_dict(d):
        del d["hydra"]
    return to_config(d), choices


# Recipes whose rows differ in every way a row can: all four axes (mixtral_8x22b_nemo,
# qwen3_235b_a22b_h100), pp x ep with DualPipeV and ZeRO-1 (deepseek_v3_h800), interleaved with
# ZeRO-2 (kimi_k2_h800), DDP with selective recompute and SP (korthikanti_gpt_175b), tp x pp x
# cp all-gather (llama3_405b_16384gpu_ctx128k), HSDP (llama3_debug_hsdp), data parallel only.
RECIPES = {
    "mixtral_8x22b_nemo": {"tp", "pp", "cp", "ep"},
    "qwen3_235b_a22b_h100": {"tp", "pp", "cp", "ep"},
    "deepseek_v3_h800": {"pp", "ep"},
    "kimi_k2_h800": {"pp", "ep"},
    "korthikanti_gpt_175b": {"tp", "pp"},
    "llama3_405b_16384gpu_ctx128k": {"tp", "pp", "cp"},
    "llama3_debug_hsdp": {"dp_replicate"},
    "megatron_gpt_1_7b": set(),
}


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_row_keeps_what_fits_of_its_axes_and_styles_and_is_planned(name):
    """On 8 ranks a recipe that splits more than the batch gets a row on its family's debug
    model with each of its axes at 2 that fits, its styles where their axis is kept, and the
    planner accepts it; one that only splits the batch gets none."""
    cfg, choices = recipe_choices(name, 8)
    row = recipe_row(name, cfg, choices, 8)
    if not RECIPES[name]:
        assert row is None
        return
    assert set(row.axes) == RECIPES[name], row
    plan = engine_plan(compose(["hardware.devices_per_node=8", *BASE, *row.reference, *row.layout]))
    assert plan.ok, (name, plan.errors)
    for axis in row.axes:
        assert getattr(plan.layout, axis) == 2, (name, axis)
    for group, axis in (("pipeline", "pp"), ("tensor", "tp"), ("context", "cp")):
        assert (f"{group}={choices[group]}" in row.layout) == (axis in row.axes), (name, group)
    assert f"data_parallel={choices['data_parallel']}" in row.layout


@pytest.mark.parametrize(("world", "per_node"), [(8, 8), (16, 8), (4, 2)])
def test_the_fabric_fit_recovers_the_constants_timings_were_made_with(world, per_node):
    """Timings the collective model itself computes for known constants (inside a node and,
    on several nodes, across them) fit back to those constants; every rank is in exactly one
    group of each shape the fabric times."""
    from launcher.selftest import fabric

    hw = compose([f"hardware.devices_per_node={per_node}", f"hardware.nodes={world // per_node}"])
    hw = hw.hardware
    true = {
        "collective_latency_us": 40.0,
        "intra_node_hop_us": 7.0,
        "intra_node_gbps": 150.0,
        "inter_node_hop_us": 25.0,
        "inter_node_gbps": 20.0,
    }
    made = fabric.links_of(dataclasses.replace(hw, **true))
    timings = []
    for spot in fabric.spots(world, per_node):
        groups = fabric.members(world, spot)
        assert sorted(r for g in groups for r in g) == list(range(world)), spot
        assert all(len(g) == spot.size for g in groups), spot
        for kind in fabric.KINDS:
            for nbytes in fabric.SIZES["cuda"]:
                t = fabric.Timing(spot, kind, nbytes, 0.0)
                t.seconds = fabric.predicted(made, t)
                timings.append(t)
    fitted = fabric.fit(fabric.links_of(hw), timings)
    expected = true if world > per_node else {k: v for k, v in true.items() if "inter" not in k}
    assert fitted.keys() == expected.keys()
    for key, value in expected.items():
        assert fitted[key] == pytest.approx(value, rel=1e-6), key


def test_the_preset_is_written_where_plans_find_it_and_never_over_a_foreign_file(tmp_path):
    from launcher.selftest import preset

    cfg = compose(["hardware.devices_per_node=4"])
    path = preset.write(cfg, {"intra_node_gbps": 2.5}, "on this machine", tmp_path)[0]
    assert path == tmp_path / "conf" / "hardware" / "cpu_selftest.yaml"
    text = path.read_text()
    assert text.startswith(preset.MARK) and "intra_node_gbps: 2.5\n" in text
    assert 'fitted: "on this machine"' in text and "devices_per_node: 4\n" in text
    again = preset.write(cfg, {"intra_node_gbps": 3.0}, "again", tmp_path)[
        0
    ]  # its own: kept up to date
    assert "intra_node_gbps: 3.0\n" in again.read_text()
    cfg.selftest.preset = "mine"
    (path.parent / "mine.yaml").write_text("name: mine\n")
    with pytest.raises(preset.PresetProblem, match="launcher.selftest did not write it"):
        preset.write(cfg, {}, "x", tmp_path)
    cfg.selftest.preset = "../up"
    with pytest.raises(preset.PresetProblem, match="letters, digits"):
        preset.target(cfg, tmp_path)


def test_the_speed_row_cuts_to_the_pipeline_s_fewest_layers_and_fits_the_efficiency():
    """The cut keeps the command line's run (its recipe, minus the self-test's and Hydra's
    own options) at the fewest layers its pipeline splits into; the fitted efficiency makes
    the planner's step time the measured one."""
    from launcher.plan import make_plan
    from launcher.selftest import speed

    cfg = compose(["recipe=mixtral_8x22b_debug"])
    given = ["recipe=mixtral_8x22b_debug", "selftest.steps=2", "hydra.run.dir=/x"]
    cut = speed.cut_overrides(cfg, given)
    assert cut[:2] == ["recipe=mixtral_8x22b_debug", "model.n_layers=4"]  # pp=2 x 2 stages
    assert not [o for o in cut if o.startswith(("selftest.", "hydra."))]
    plain = speed.cut_overrides(compose([]), [])
    assert plain[0] == "model.n_layers=1"
    cut_cfg = compose(plain)
    before = make_plan(cut_cfg).estimate.time.step
    for measured in (3 * before, 1.2 * before):
        efficiency, after = speed.fit_efficiency(cut_cfg, {}, measured, make_plan)
        assert 0 < efficiency < 1 and after == pytest.approx(measured, rel=1e-4)
    # Faster than the planner allows at every kernel's peak (its other terms): capped at 1.
    efficiency, after = speed.fit_efficiency(cut_cfg, {}, 0.1 * before, make_plan)
    assert efficiency == 1.0 and after > 0.1 * before


# What the speed row's cut of a recipe keeps on one node of 8 of its own devices (the rest of
# its overrides: the batch, the stage split), or the planner's reason it cannot run there.
CUTS = {
    # ep=8 carved from tp x cp at pp=1 beats pp=2 at ep=4: the experts' share is the memory
    "mixtral_8x22b_nemo": ("model.n_layers=1", "parallel.pp=1", "pipeline.stages_per_rank=1"),
    "qwen3_235b_a22b_h100": ("model.n_layers=1", "parallel.pp=1", "pipeline.layers_per_stage=[]"),
    # DualPipeV's V on one rank: two layers, one of them the routed experts (not all dense)
    "deepseek_v3_h800": ("model.n_layers=2", "model.n_dense_layers=1", "parallel.ep=8"),
    "kimi_k2_h800": ("model.n_layers=1", "model.n_dense_layers=0", "parallel.ep=8"),
    "llama3_405b_16384gpu_ctx128k": ("model.n_layers=1", "parallel.pp=1"),
    "llama3_debug_hsdp": ("model.n_layers=1", "parallel.dp_shard=4",
                          "train.global_batch_size=32"),
    "mixtral_8x22b_nemo_debug": ("model.n_layers=4",),  # every axis fits: nothing else cut
}  # fmt: skip
TOO_BIG = {  # the planner's reason, on 8 devices
    "deepseek_v3_h800": "[memory] model=deepseek_v3 needs",
    "llama3_405b_16384gpu_ctx128k": "tp=8 x pp=1 x cp=16 = 128 does not divide",
}


@pytest.mark.parametrize("name", CUTS)
def test_the_speed_row_cuts_a_recipe_to_what_one_node_holds_at_its_own_widths(name):
    """A recipe's cut keeps its widths, tp and cp; takes the pp (and its stages) that leaves
    the most of its ep carved, a layer a stage, an expert layer past the dense ones, and a
    batch of a few micro-batches; the planner runs it on 8 devices, or says why not."""
    from launcher.plan.report import problems_message
    from launcher.selftest import speed

    given = [f"recipe={name}", "hardware.nodes=1", "hardware.devices_per_node=8"]
    cfg = compose(given)
    cut = speed.cut_overrides(cfg, given)
    assert set(CUTS[name]) <= set(cut), cut
    plan = engine_plan(compose(cut))
    assert plan.ok == (name not in TOO_BIG), problems_message(plan)
    if not plan.ok:
        assert TOO_BIG[name] in problems_message(plan)
    else:
        assert compose(cut).model.dim == cfg.model.dim


@pytest.mark.parametrize("kind", ["all_to_all", "send"])
def test_a_fault_scales_floating_point_payloads_only_and_is_undone(kind, monkeypatch):
    """selftest.fault corrupts the activations and gradients a collective carries, never the
    integer counts and sizes beside them (the dispatch's splits, send_object_list's lengths:
    corrupting those crashes the row instead of failing it), and puts the collective back."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from launcher.selftest.run import fault

    name = {"all_to_all": "all_to_all_single", "send": "isend"}[kind]
    got = []

    def fake(tensor, *args, **kwargs):  # the collective: records what it was given
        got.append(tensor.clone())

    monkeypatch.setattr(dist, name, fake)
    monkeypatch.setattr(c10d, name, fake)
    floats, counts = torch.ones(4), torch.ones(4, dtype=torch.int64)
    with fault(kind):
        assert dist.__dict__[name] is c10d.__dict__[name] is not fake
        getattr(dist, name)(floats)
        getattr(dist, name)(counts)
    seen = got if kind == "send" else [floats, counts]  # all_to_all: its output, in place
    assert torch.equal(seen[0], torch.full((4,), 1.01)) and torch.equal(seen[1], counts)
    assert getattr(dist, name) is fake and getattr(c10d, name) is fake
