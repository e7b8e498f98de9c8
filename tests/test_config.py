"""Every shipped config composes; typos and wrong types are errors with exit status 2."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest
from conftest import CONF, REFUSED_RECIPES, ROOT, compose_config, run_cli

from launcher import cli
from launcher.config import Config, DType
from launcher.plan import make_plan
from launcher.plan.limitations import refusals

# conf/hydra holds Hydra's own groups (hydra/launcher=slurm), tested below.
GROUPS = sorted(p for p in CONF.iterdir() if p.is_dir() and p.name not in ("recipe", "hydra"))
OPTIONS = [(g.name, f.stem) for g in GROUPS for f in sorted(g.rglob("*.yaml"))]
RECIPES = sorted(
    p.relative_to(CONF / "recipe").with_suffix("").as_posix()
    for p in (CONF / "recipe").rglob("*.yaml")
)


def test_found_configs():
    assert {"model", "hardware", "data_parallel", "precision"} <= {g.name for g in GROUPS}
    assert RECIPES, "no recipes found"


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes(group, option):
    cfg = compose_config([f"{group}={option}"])
    assert isinstance(cfg, Config)
    if hasattr(getattr(cfg, group), "name"):
        assert getattr(cfg, group).name == option


@pytest.mark.parametrize("group", ["data_parallel", "recompute", "context"])
def test_help_lists_every_option_of_a_group_it_names(group):
    """`launcher.train --help`'s "GROUP=a|b|c" lines (conf/hydra/help/train.yaml) name exactly
    the group's options (it once listed recompute=none|selective|full, without op)."""
    import re

    help_text = (CONF / "hydra" / "help" / "train.yaml").read_text()
    (listed,) = re.findall(rf"\b{group}=([a-z0-9_|]+)", help_text)
    assert sorted(listed.split("|")) == sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_the_slurm_launcher_config_composes():
    from hydra import compose, initialize_config_dir

    from launcher.cli import hydra_app

    hydra_app(lambda cfg: None)  # the schema and resolvers
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.llm_launcher_slurm.slurm.PlannedSlurmLauncher"
    assert launcher.signal_delay_s == 120 and launcher.max_num_timeout == 3
    assert "partition" in launcher and "additional_parameters" in launcher


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes(recipe):
    assert isinstance(compose_config([f"recipe={recipe}"]), Config)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_is_valid_and_fits_its_hardware(recipe):
    plan = make_plan(compose_config([f"recipe={recipe}"]))
    assert plan.valid, plan.errors
    assert plan.fits, plan.errors


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_passes_the_engines_limitations_at_full_size(recipe):
    cfg = compose_config([f"recipe={recipe}"])
    refused = [x.name for x, _ in refusals(cfg, make_plan(cfg).layout)]
    assert refused == ([REFUSED_RECIPES[recipe]] if recipe in REFUSED_RECIPES else []), refused


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_cluster_recipe_checkpoints_periodically(recipe):
    cfg = compose_config([f"recipe={recipe}"])
    if cfg.hardware.device_type.value == "cuda":
        plan = make_plan(cfg)
        every = cfg.checkpoint.interval
        minutes = every * plan.estimate.time.step / 60
        assert 10 < minutes < 60, f"checkpoint.interval={every}: every {minutes:.0f} min"


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_opens_with_its_command(recipe):
    head = (CONF / "recipe" / f"{recipe}.yaml").read_text().split("defaults:")[0]
    assert f"recipe={recipe}" in head and "python -m launcher." in head


def test_cli_override_beats_recipe():
    recipe = RECIPES[0]
    base = compose_config([f"recipe={recipe}"])
    cfg = compose_config([f"recipe={recipe}", f"train.steps={base.train.steps + 7}"])
    assert cfg.train.steps == base.train.steps + 7


def test_precision_follows_device():
    assert compose_config([]).precision.compute_dtype == DType.fp32
    assert compose_config(["hardware=h100_80g"]).precision.compute_dtype == DType.bf16
    assert (
        compose_config(["hardware=h100_80g", "precision=fp32"]).precision.param_dtype == DType.fp32
    )


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.stpes=5", "train has no setting 'stpes' (did you mean train.steps?)"),
        ("+train.foo=1", "foo"),
        ("train.steps=abc", "error: train.steps=abc: train.steps takes an integer, not 'abc'"),
        ("model=llama3_dbug", "error: model=llama3_dbug: no such model (did you mean llama3_debug"),
        ("hardwre=h100_80g", "error: hardwre=h100_80g: no config group 'hardwre' (did you mean"),
        ("train.steps=[1", "error: train.steps=[1: not an override"),
        ("train.lr=range(1,3)", "error: train.lr=range(1,3): a sweep runs with -m (--multirun)"),
    ],
)
def test_bad_override_exits_2(override, expected):
    """One line, exit 2, none of Hydra's own wording (its option lists, search path and
    HYDRA_FULL_ERROR hint)."""
    result = run_cli("launcher.train", override)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr and "HYDRA_FULL_ERROR" not in result.stderr


@pytest.mark.e2e
def test_a_sweep_with_a_bad_value_exits_2_before_any_job():
    result = run_cli("launcher.train", "-m", "model=llama3_debug,llama3_dbug", "train.steps=1")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: model=llama3_debug,llama3_dbug: model=llama3_dbug")
    assert "Launching" not in result.stdout + result.stderr  # no job started
    assert "Traceback" not in result.stderr and "HYDRA_FULL_ERROR" not in result.stderr


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("hardware.devics_per_node=4", "did you mean hardware.devices_per_node"),
        ("model=no_such_model", "model=no_such_model: no such model; the model options: "),
        ("pipeline=1f1c", "no such pipeline (did you mean 1f1b?); the pipeline options: 1f1b, "),
        ("+recompute=ful", "no such recompute (did you mean full?)"),
        ("train.compile=maybe", "train.compile takes true or false, not 'maybe'"),
        ("train.lr=fast", "train.lr takes a number, not 'fast'"),
        ("precision.param_dtype=fp64", "precision.param_dtype takes one of fp32, "),
        ("data.attention=docment", "data.attention takes one of "),
        ("hardwre=h100_80g", "no config group 'hardwre' (did you mean hardware=?)"),
        ("+modle=llama3_8b", "no config group 'modle' (did you mean model=?); the groups: "),
        ("--stpes", "--stpes: no such flag; settings are key=value"),
        ("--cfgg", "no such flag (did you mean --cfg?)"),
        ("model=llama3_dbug,llama3_debug", "model=llama3_dbug: no such model (did you mean"),
        ("train.steps=abc,2", "train.steps=abc: train.steps takes an integer, not 'abc'"),
        ("train.steps=[1", "train.steps=[1: not an override (no viable alternative at input"),
        ("train.lr='0.1", "train.lr='0.1: not an override"),
    ],
)
def test_bad_override_is_named_before_hydra_composes(override, expected):
    """The checks launcher.train runs on each override before Hydra: the message it exits 2
    with (test_bad_override_exits_2 runs the command)."""
    found = cli.override_problem(override)
    assert found is not None and expected in found, found


@pytest.mark.parametrize(
    "override",
    [
        "model=llama3_debug",
        "hydra/job_logging=disabled",  # Hydra's own group, from its package
        "hydra/launcher=slurm",
        "recipe=null",
        "train.steps=10",
        "train.lr=1e-3",
        "train.compile=true",
        "train.steps=${oc.env:STEPS}",
        "train.steps=1,2,3",
        "train.steps=range(1,5,2)",
        "model=glob(llama3_*)",
        "train.lr=interval(0.1,0.2)",
        "precision.param_dtype=bf16",
        "hydra/launcher=slurm",
        "parallel.tp=-1",
        "--cfg",
        "-m",
        "--config-dir=conf",
        "-1",
    ],
)
def test_good_overrides_pass_the_checks(override):
    assert cli.override_problem(override) is None


def test_every_setting_is_in_the_config_docs():
    """docs/config.md's table names every field of every group of the schema (its row is the
    one that names the group)."""
    rows = [
        line for line in (ROOT / "docs" / "config.md").read_text().splitlines() if line[:3] == "| `"
    ]
    missing = []
    for group in dataclasses.fields(Config):
        schema = typing.get_type_hints(Config)[group.name]
        if not dataclasses.is_dataclass(schema):
            continue
        text = " ".join(r for r in rows if f"`{group.name}." in r or f"`{group.name}=" in r)
        missing += [
            f"{group.name}.{f.name}"
            for f in dataclasses.fields(schema)
            if f.name != "name" and not re.search(rf"\b{f.name}\b", text)
        ]
    assert not missing, f"docs/config.md does not name {missing}"
