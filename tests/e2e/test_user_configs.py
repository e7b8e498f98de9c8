"""A team's own configs, kept outside the repository: a model, a cluster preset, a data source and
a recipe that uses them, in a directory of their own, used from another working directory by
every command (launcher/configs.py). The SLURM sweep's jobs find them too:
tests/slurm/test_sweep.py runs its sweep with --config-dir."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env, read_metrics

from launcher.bench.prepare_speed import embedded_paragraphs

pytestmark = pytest.mark.e2e

MODEL = """\
defaults:
  - llama3_debug  # a built-in preset, extended
  - _self_
name: my_llama
n_layers: 2
"""
CLUSTER = """\
defaults:
  - cpu
  - _self_
name: my_cluster
memory_gib: 4
"""
# A built-in preset's name: this directory's file wins over launcher/conf/hardware/h100_80g.yaml.
SHADOW = """\
defaults:
  - h200
  - _self_
name: h100_80g
memory_gib: 70
"""
RECIPE = """\
# @package _global_
defaults:
  - override /model: my_llama
  - override /hardware: my_cluster
  - override /data: my_text
train:
  steps: 6
  eval_interval: 0
checkpoint:
  interval: 2
logging:
  wandb:
    mode: disabled
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """/tmp/.../site: conf/ (the team's configs), tokens/ (their data) and work/ (where they
    run the commands), none inside the repository."""
    site = tmp_path_factory.mktemp("site")
    conf = site / "conf"
    for rel, text in {
        "model/my_llama.yaml": MODEL,
        "hardware/my_cluster.yaml": CLUSTER,
        "hardware/h100_80g.yaml": SHADOW,
        "recipe/my_recipe.yaml": RECIPE,
    }.items():
        (conf / rel).parent.mkdir(parents=True, exist_ok=True)
        (conf / rel).write_text(text)
    (site / "work").mkdir()
    text = site / "text.txt"
    text.write_text("\n\n".join(embedded_paragraphs()[:400]))
    prepared = cli(site, "launcher.prepare", "--out", str(site / "tokens" / "mine"), str(text))
    assert prepared.returncode == 0, prepared.stderr
    (conf / "data").mkdir()
    (conf / "data" / "my_text.yaml").write_text(
        f"sources:\n  - path: {site / 'tokens' / 'mine.bin'}\n    weight: 1.0\n"
    )
    return site


def cli(site: Path, module: str, *args: str, env: dict | None = None):
    """`python -m module args` from the site's own working directory."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=site / "work",
        env=cli_env(env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def ways(conf: Path) -> dict[str, tuple[list[str], dict]]:
    """Each way of naming the directory: (arguments, environment)."""
    return {
        "--config-dir": (["--config-dir", str(conf)], {}),
        "-cd=": ([f"-cd={conf}"], {}),
        "hydra.searchpath": ([f"hydra.searchpath=[file://{conf}]"], {}),
        "LAUNCHER_CONFIG_PATH": ([], {"LAUNCHER_CONFIG_PATH": str(conf)}),
    }


@pytest.mark.parametrize("way", list(ways(Path())))
def test_each_way_of_naming_the_directory_plans_its_recipe(site, way):
    conf = site / "conf"
    args, env = ways(conf)[way]
    result = cli(site, "launcher.plan", *args, "recipe=my_recipe", "plan.format=json", env=env)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["config_files"] == {
        "data=my_text": str(conf / "data" / "my_text.yaml"),
        "hardware=my_cluster": str(conf / "hardware" / "my_cluster.yaml"),
        "model=my_llama": str(conf / "model" / "my_llama.yaml"),
        "recipe=my_recipe": str(conf / "recipe" / "my_recipe.yaml"),
    }
    assert plan["params"]["total"] == 475_776  # llama3_debug's shape with 2 layers
    assert plan["data"][0]["label"] == f"data.sources[0].path={site / 'tokens' / 'mine.bin'}"
    assert not list((site / "work").iterdir()), "launcher.plan wrote into the working directory"


def test_a_user_preset_shadows_a_built_in_one_by_name(site):
    conf = site / "conf"
    one = "hardware.devices_per_node=1"
    result = cli(site, "launcher.plan", "--config-dir", str(conf), "hardware=h100_80g", one)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "h100_80g: 1 node(s) x 1 cuda = 1 ranks, 70 GiB each" in result.stdout
    assert "│   config           │ hardware=h100_80g from " in result.stdout
    as_json = cli(
        site, "launcher.plan", "-cd", str(conf), "hardware=h100_80g", one, "plan.format=json"
    )
    shadow = str(conf / "hardware" / "h100_80g.yaml")
    assert json.loads(as_json.stdout)["config_files"] == {"hardware=h100_80g": shadow}
    builtin = cli(site, "launcher.plan", "hardware=h100_80g", one)
    assert builtin.returncode == 0, builtin.stdout + builtin.stderr
    assert "79.6 GiB each" in builtin.stdout and "  config " not in builtin.stdout


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model=my_lama", "error: model=my_lama: no such model (did you mean my_llama?)"),
        ("recipe=my_recpie", "no such recipe (did you mean my_recipe?)"),
        ("hardware=my_clustr", "no such hardware (did you mean my_cluster?)"),
        ("hardwre=my_cluster", "no config group 'hardwre' (did you mean hardware=?)"),
    ],
)
def test_a_misspelt_user_preset_gets_the_users_names(site, override, expected):
    result = cli(site, "launcher.train", "--config-dir", str(site / "conf"), override)
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_directory_is_named(site):
    missing = site / "nowhere"
    for args, env in ways(missing).values():
        result = cli(site, "launcher.plan", *args, env=env)
        assert result.returncode == 2, result.stderr
        assert f"{missing} is not a directory of configs" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_the_users_recipe_trains_restarts_sweeps_and_is_listed(site):
    """Two CPU ranks under torchrun, rank 1 killed at step 5 and restarted (the ranks find the
    directory through the environment the launcher hands them); a `-m` sweep of two
    one-process points; the recipes list and `launcher.runs` from the same directory."""
    conf, work = site / "conf", site / "work"
    env = {"LAUNCHER_CONFIG_PATH": str(conf), "LAUNCHER_FAULT_INJECT": "1:5:kill"}
    result = cli(site, "launcher.train", "recipe=my_recipe", "train.max_restarts=1", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    # Step 4's, or step 2's where the kill came before step 4's sums landed (issue 66).
    assert re.search(r"starting from step [24] of", result.stdout), result.stdout[-2000:]
    (run_dir,) = (work / "outputs").iterdir()
    assert [r["step"] for r in read_metrics(run_dir)][-1] == 6
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["config_files"]["model=my_llama"] == str(conf / "model" / "my_llama.yaml")
    # Run again: the launcher itself answers, before torchrun and any rank start.
    again = cli(site, "launcher.train", "recipe=my_recipe", env={"LAUNCHER_CONFIG_PATH": str(conf)})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing left to train: the checkpoint is at step 6 of train.steps=6" in again.stdout
    assert "starting from" not in again.stdout, again.stdout  # a rank's line: none started

    sweep = cli(
        site,
        "launcher.train",
        "--config-dir",
        str(conf),
        "-m",
        "recipe=my_recipe",
        "hardware.devices_per_node=1",
        "train.steps=2",
        "train.lr=1e-3,2e-3",
    )
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    jobs = sorted((work / "multirun").glob("*/[0-9]"))
    assert len(jobs) == 2 and all(len(read_metrics(j)) == 2 for j in jobs)

    recipes = cli(site, "launcher.plan.recipes", "--config-dir", str(conf))
    assert recipes.returncode == 0, recipes.stderr
    assert f"| my_recipe ({conf / 'recipe' / 'my_recipe.yaml'}) | my_llama |" in recipes.stdout

    compare = cli(
        site,
        "launcher.plan.compare",
        "-cd",
        str(conf),
        "recipe=my_recipe",
        "--rows",
        "",
        "model.n_layers=4",
    )
    assert compare.returncode == 0, compare.stderr
    assert "| as written |" in compare.stdout and "| `model.n_layers=4` |" in compare.stdout

    runs = cli(site, "launcher.runs", env={"COLUMNS": "250"})
    assert runs.returncode == 0, runs.stderr
    listed = [line for line in runs.stdout.splitlines() if "my_llama" in line]
    assert len(listed) == 3 and all("finished" in line for line in listed), runs.stdout
    assert f"outputs/{run_dir.name}" in runs.stdout
    assert "train.lr=0.001" in runs.stdout and "train.lr=0.002" in runs.stdout
