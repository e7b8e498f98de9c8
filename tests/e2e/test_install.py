"""The launcher installed as a package: a wheel built from the sources, installed without the
extras into a fresh virtual environment, runs the default training from an empty directory
(its configs and the embedded corpus ship inside the package) and names the extra a feature
needs where it is missing.

torch comes from this machine's own install, seen by the new environment through a .pth file
(as a GPU image's CUDA torch is seen: the Makefile's --system-site-packages), so the test
does not unpack torch again; every other dependency pip resolves from pyproject.toml."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, cli_env
from packaging.requirements import Requirement

pytestmark = pytest.mark.e2e

SOURCES = ("launcher", "hydra_plugins", "pyproject.toml")


def distribution_tree(name: str, seen: set[str]) -> set[str]:
    """`name` and every distribution it requires on this machine, normalised."""
    key = name.lower().replace("_", "-")
    if key in seen:
        return seen
    seen.add(key)
    for line in importlib.metadata.requires(name) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            distribution_tree(req.name, seen)
    return seen


def link_torch(site: Path) -> None:
    """`site`: links to torch and the distributions it requires, files and metadata."""
    site.mkdir()
    for name in sorted(distribution_tree("torch", set())):
        dist = importlib.metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not top.endswith(".pth") and top != "..":
                (site / top).unlink(missing_ok=True)
                (site / top).symlink_to(source)


def run(*cmd, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = cli_env({"PYTHONPATH": ""})
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_wheel_without_extras_trains_from_an_empty_directory(tmp_path):
    src, wheels = tmp_path / "src", tmp_path / "wheels"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip"]
    built = run(
        *pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, src, cwd=src
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("llm_launcher-*.whl")

    venv = tmp_path / "venv"
    # The environment without a pip of its own (ensurepip: 3.5 s here): this one's pip installs
    # into it (`--python`), resolving as the environment's own would.
    made = run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site = Path(
        run(
            python, "-c", "import site; print(site.getsitepackages()[0])", cwd=tmp_path
        ).stdout.strip()
    )
    link_torch(tmp_path / "torch-site")
    (site / "torch-site.pth").write_text(f"{tmp_path / 'torch-site'}\n")
    # Without compiling every dependency's bytecode: half the install's time, which the first
    # import of each module pays again only for the modules it reads.
    into = [*pip, "--python", python]
    installed = run(*into, "install", "-q", "--no-compile", wheel, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-3000:]
    listed = run(*into, "list", "--format=json", cwd=tmp_path)
    names = {d["name"].lower() for d in json.loads(listed.stdout)}
    assert "llm-launcher" in names and "hydra-core" in names
    assert not names & {"transformers", "pytest", "torchao", "pyarrow", "torchtitan", "triton"}

    empty = tmp_path / "empty"
    empty.mkdir()
    trained = run(
        python, "-m", "launcher.train", "train.steps=3", "logging.wandb.mode=disabled", cwd=empty
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "run finished at step 3 of 3" in trained.stdout
    (run_dir,) = (empty / "outputs").iterdir()
    assert run_dir.name.startswith("llama3_debug")
    # Every command ships: the self-test's package and its own help among them.
    selftest = run(python, "-m", "launcher.selftest", "--help", cwd=empty)
    assert selftest.returncode == 0 and "Proves the engine's collectives" in selftest.stdout

    # What the extras bring, asked for without them: one line naming the extra, exit 2.
    fp8 = run(
        python, "-m", "launcher.train", "precision=fp8", "hardware.devices_per_node=1", cwd=empty
    )
    assert fp8.returncode == 2, fp8.stdout + fp8.stderr
    assert "needs torchao, which is not installed here: pip install 'llm-launcher[fp8]'" in (
        fp8.stderr
    )
    (empty / "rows.parquet").write_bytes(b"")
    parquet = run(python, "-m", "launcher.prepare", "--out", "tokens", "rows.parquet", cwd=empty)
    assert parquet.returncode == 2, parquet.stderr
    assert "reading Parquet needs pyarrow" in parquet.stderr and "Traceback" not in parquet.stderr
