"""`python -m launcher.train -m ... hydra/launcher=slurm` on a real cluster (two slurmd)."""

from __future__ import annotations

import json

import pytest
from conftest import read_metrics, run_cli
from jobs import train_job

from launcher.configs import BUILTIN

pytestmark = pytest.mark.e2e

RUN = [
    "train.steps=3",
    "train.eval_interval=0",
    "logging.wandb.mode=disabled",
    "hardware.devices_per_node=2",
]


# The local runs the SLURM jobs are held to, as jobs of tests/group.py (the engine's Trainer as
# launcher.train runs it; tests/e2e/test_train.py holds the two bitwise equal).
LOCAL = {
    tp: train_job([f"parallel.tp={tp}", *RUN], f"local run, sweep point tp={tp}") for tp in (1, 2)
}
ONE_SEED_2 = [*RUN[:3], "train.seed=2"]
SINGLE = train_job(["hardware.devices_per_node=1", *ONE_SEED_2], "local run, one process")


def slurm_sweep(cluster, sweep_dir, *overrides: str):
    """`python -m launcher.train -m OVERRIDES hydra/launcher=slurm` against `cluster`."""
    result = run_cli(
        "launcher.train",
        "-m",
        *overrides,
        "hydra/launcher=slurm",
        "hydra.launcher.timeout_min=10",
        f"hydra.sweep.dir={sweep_dir}",
        env=cluster.env,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:] + cluster.logs()
    return result


def summary(sweep_dir) -> dict[str, dict]:
    rows = [json.loads(x) for x in (sweep_dir / "summary.jsonl").read_text().splitlines()]
    return {r["job"]: r for r in rows}


# A team's own directory (tests/e2e/test_user_configs.py has the fuller one): a model that
# extends a built-in one, a cluster preset that shadows one by name, a data preset and a recipe
# that uses all three; same figures as the built-in ones, so the jobs train like LOCAL's runs.
USER_CONFIGS = {
    "model/my_llama.yaml": "defaults:\n  - llama3_debug\n  - _self_\nname: my_llama\n",
    "data/my_corpus.yaml": "# the embedded corpus, named by the team\npath: null\n",
    "recipe/my_sweep.yaml": (
        "# @package _global_\ndefaults:\n  - override /model: my_llama\n"
        "  - override /hardware: cpu\n  - override /data: my_corpus\n"
    ),
}


@pytest.mark.jobs(*LOCAL.values())
def test_invalid_point_never_queued_and_the_rest_match_local_runs(slurm_cluster, group, tmp_path):
    """The sweep names a configuration directory of the user's, whose recipe takes its model,
    data and cluster preset (hardware/cpu.yaml, shadowing the built-in one with the same
    figures) from there: each job, on its SLURM node, reads them from there (the directory
    travels with the job) and names each file in its plan.json."""
    sweep_dir, conf = tmp_path / "sweep", tmp_path / "conf"
    (conf / "hardware").mkdir(parents=True)
    shadow = conf / "hardware" / "cpu.yaml"
    shadow.write_text((BUILTIN / "hardware" / "cpu.yaml").read_text())
    for rel, text in USER_CONFIGS.items():
        (conf / rel).parent.mkdir(parents=True, exist_ok=True)
        (conf / rel).write_text(text)
    result = slurm_sweep(
        slurm_cluster,
        sweep_dir,
        "--config-dir",
        str(conf),
        "recipe=my_sweep",
        "parallel.tp=1,2,3",
        *RUN,
    )
    assert "rejected: recipe=my_sweep parallel.tp=3 " in result.stderr
    rows = summary(sweep_dir)
    assert {k: r["status"] for k, r in rows.items()} == {
        "0": "completed",
        "1": "completed",
        "2": "rejected",
    }
    assert "tp=3 must divide" in rows["2"]["reason"] or "[world_size]" in rows["2"]["reason"]
    # One job array of exactly the two valid points: tp=3 never reached the queue.
    submitted = {json.loads((sweep_dir / n / "status.json").read_text())["job_id"] for n in "01"}
    assert not (sweep_dir / "2" / "status.json").exists()
    array = {job.split("_")[0] for job in submitted}
    assert len(array) == 1 and len(submitted) == 2
    records = slurm_cluster.run("scontrol", "show", "job", "-o", array.pop()).stdout
    assert len(records.splitlines()) == 2
    # Each job ran as two SLURM tasks (one rank each) and trained like the local run.
    for n, tp in (("0", 1), ("1", 2)):
        want = [r["loss"] for r in read_metrics(group.result(LOCAL[tp]))]
        got = [r["loss"] for r in read_metrics(sweep_dir / n)]
        assert got == pytest.approx(want, rel=1e-6), (n, got, want)
        plan = json.loads((sweep_dir / n / "plan.json").read_text())
        assert plan["model"] == "my_llama", plan["model"]
        assert plan["config_files"] == {
            "hardware=cpu": str(shadow),
            **{
                f"{rel.split('/')[0]}={rel.split('/')[1][:-5]}": str(conf / rel)
                for rel in USER_CONFIGS
            },
        }, plan["config_files"]
    assert "measured / planned" in result.stdout


@pytest.mark.jobs(SINGLE)
def test_two_node_job_trains_like_one_process(slurm_cluster, group, tmp_path):
    """hardware.nodes=2: one task on n1 and one on n2 (MASTER_ADDR from SLURM's NodeAddr:
    the node names do not resolve here), dp_shard=2 over them."""
    sweep_dir = tmp_path / "sweep"
    two_nodes = ["hardware.nodes=2", "hardware.devices_per_node=1"]
    slurm_sweep(slurm_cluster, sweep_dir, *two_nodes, *ONE_SEED_2)
    assert summary(sweep_dir)["0"]["status"] == "completed"
    job_id = json.loads((sweep_dir / "0" / "status.json").read_text())["job_id"]
    record = slurm_cluster.job(job_id)
    assert record["NumNodes"] == "2" and record["NodeList"] == "n[1-2]", record
    want = [r["loss"] for r in read_metrics(group.result(SINGLE))]
    got = [r["loss"] for r in read_metrics(sweep_dir / "0")]
    assert got == pytest.approx(want, rel=1e-5)


def test_every_point_rejected_submits_nothing_and_exits_2(tmp_path):
    """No cluster needed: nothing may reach sbatch (PATH has none here)."""
    result = run_cli(
        "launcher.train",
        "-m",
        "parallel.tp=3,5",
        "hardware.devices_per_node=2",
        "hydra/launcher=slurm",
        f"hydra.sweep.dir={tmp_path}",
        env={"PATH": "/nonexistent"},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "every point of the sweep was rejected; nothing was submitted" in result.stderr
    assert "rejected: parallel.tp=3" in result.stderr and "rejected: parallel.tp=5" in result.stderr
    assert not (tmp_path / ".submitit").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["0", "1"]


def test_no_sbatch_is_one_line_and_exit_2(tmp_path):
    """A machine without SLURM: the planned points are refused before submitit, in one line."""
    result = run_cli(
        "launcher.train",
        "-m",
        "train.steps=2",
        "hydra/launcher=slurm",
        f"hydra.sweep.dir={tmp_path}",
        env={"PATH": "/nonexistent"},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "error: hydra/launcher=slurm submits with SLURM's sbatch, which is not on PATH here: run "
        "this on a SLURM login node, or leave out hydra/launcher=slurm to run the sweep on this "
        "machine"
    ]
    assert not (tmp_path / ".submitit").exists()
