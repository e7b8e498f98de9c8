"""`slurm_cluster`: one real SLURM cluster (two nodes, n1 and n2) for the session."""

from __future__ import annotations

import os

import pytest

from .cluster import MARKER, slurm_available, start_cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    reason = slurm_available()
    if reason:
        pytest.skip(reason)
    with start_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def _idle_nodes(request):
    """A test on the cluster starts with every node idle: an earlier test's job still completing
    on n2 would start a `--nodes=1-2` job on n1 alone (seen in CI)."""
    if "slurm_cluster" in request.fixturenames:
        request.getfixturevalue("slurm_cluster").wait_idle()


@pytest.fixture
def slurm_env(slurm_cluster, monkeypatch):
    """Point this process at the cluster, for code that calls sbatch itself (submitit)."""
    for var in [v for v in os.environ if v.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
        monkeypatch.delenv(var)
    for var in ("SLURM_CONF", "PATH", MARKER):
        monkeypatch.setenv(var, slurm_cluster.env[var])
    return slurm_cluster
