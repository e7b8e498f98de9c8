"""Each long-running command killed mid-work, by SIGKILL and by SIGTERM: no process it started
outlives it, and nothing half-written stays beside its output (launcher/runtime/scratch.py);
a SIGTERM ends it with one line and the status a shell gives a command killed by it.

The commands: launcher.train (a multirun sweep, whose process is a run's launcher), launcher.prepare
with workers, launcher.convert both ways, launcher.checkpoint export. A SIGTERM to a run is the
subject of tests/e2e/test_failures.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, cli_env, run_cli, wait_for_step

from e2e.bad_inputs import TINY_MODEL
from launcher.runtime.launch import descendants

pytestmark = pytest.mark.e2e

TINY_TRAIN = (
    *TINY_MODEL,
    "hardware.devices_per_node=2",
    "train.steps=400",
    "train.eval_interval=0",
    "logging.wandb.mode=disabled",
)


def start(module: str, *args: str, session: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=session,
    )


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.005)


def kill(proc: subprocess.Popen, sig: int, group: bool = False) -> tuple[list[int], str]:
    """Send `sig` to proc (or its whole process group), wait for it; returns the processes it
    had started that are still alive 15 s later, and its stderr."""
    below = descendants(proc.pid)
    (os.killpg if group else os.kill)(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    deadline = time.monotonic() + 15
    while any(map(alive, below)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in below if alive(p)], err


def leftovers(directory: Path, final: str) -> list[str]:
    """What is beside `final` in `directory` that is not it."""
    return sorted(p.name for p in directory.iterdir() if p.name != final)


# -- train ----------------------------------------------------------------------------------


def test_sigkill_to_a_multirun_sweep_ends_its_job_and_the_job_s_ranks(tmp_path):
    """The sweep runs its job in its own process (Hydra's basic launcher), as a single run
    does: the job's torchrun gets SIGTERM when its launcher dies, and ends its ranks, which
    stop at their step and exit by themselves: none waits for torchrun's SIGKILL (30 s
    later), as a rank that returned used to, its return value never read by the agent."""
    proc = start(
        "launcher.train", "-m", *TINY_TRAIN, "train.seed=1,2", f"hydra.sweep.dir={tmp_path}"
    )
    wait_for_step(proc, tmp_path / "0", 2)
    assert len(descendants(proc.pid)) >= 3  # torchrun and its two ranks
    left, err = kill(proc, signal.SIGKILL)
    assert not left, left
    assert "Closing process" in err and "forcefully exiting via 9" not in err, err[-3000:]


# -- prepare --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("texts")
    files = []
    for i in range(12):
        files.append(folder / f"in{i}.txt")
        files[-1].write_text("".join(f"document {i} line {j}\n\n" for j in range(200_000)))
    return files


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "SIGKILL to its group"])
def test_a_killed_prepare_leaves_no_worker_and_no_scratch(how, texts, tmp_path):
    """Two spawned workers, a scratch directory of their files' ids and NAME.bin.partial
    beside the output: a SIGKILL to prepare alone or a SIGTERM leaves none of them; a SIGKILL
    to the whole group (as scancel does: the guard that removes scratch dies too) leaves the
    scratch, which the next prepare of the same output removes."""
    out = tmp_path / "data" / "corpus"
    group = how.endswith("group")
    proc = start(
        "launcher.prepare", "--workers", "2", "--out", str(out), *map(str, texts), session=group
    )
    wait_for(lambda: len(descendants(proc.pid)) >= 3, proc, "started its workers")
    left, err = kill(proc, signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL, group)
    assert not left, "processes outlived their prepare"
    if how == "SIGTERM":
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert err.strip().splitlines()[-1] == (
            "stopped by SIGTERM: no token file was written, and nothing half-written is left"
        )
    if not group:
        assert leftovers(tmp_path / "data", "corpus.bin") == []
        return
    assert list((tmp_path / "data").glob(".corpus.*.partial")), "the killed one left none"
    again = run_cli("launcher.prepare", "--out", str(out), str(texts[0]))
    assert again.returncode == 0, again.stderr
    assert leftovers(tmp_path / "data", "corpus.bin") == ["corpus.json"]


# -- convert, export, generate --------------------------------------------------------------


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> tuple[Path, Path]:
    """A Hugging Face Llama of 60 M parameters (seconds to convert here) and our checkpoint
    of it."""
    sys.path.insert(0, str(ROOT / "tests" / "hf"))
    from hf_models import build, save

    folder = tmp_path_factory.mktemp("big")
    model = build("llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=32_000)  # fmt: skip
    hf_dir = save(model, folder / "hf", shard="100MB")
    ours = folder / "ours"
    done = run_cli("launcher.convert", "from-hf", str(hf_dir), str(ours))
    assert done.returncode == 0, done.stderr
    return hf_dir, ours


STOPPED = "stopped by SIGTERM: nothing was written, and nothing half-written is left"


@pytest.mark.parametrize(
    "command, sig",
    [  # each command once, each signal for each of the two ways a partial output is kept
        ("convert from-hf", signal.SIGKILL),
        ("convert to-hf", signal.SIGTERM),
        ("checkpoint export", signal.SIGKILL),
        ("checkpoint export", signal.SIGTERM),
    ],
)
def test_a_killed_conversion_leaves_no_output_and_no_scratch(command, sig, big, tmp_path):
    """Killed while its partial output is being written: neither OUT nor its partial stays."""
    hf_dir, ours = big
    module, sub = command.split()
    source = hf_dir if sub == "from-hf" else ours
    out = tmp_path / ("out.pt" if sub == "export" else "out")
    extra = ("--max-shard-size", "10MB") if sub == "to-hf" else ()
    proc = start(f"launcher.{module}", sub, str(source), str(out), *extra)
    wait_for(lambda: leftovers(tmp_path, "") != [], proc, "began its output")
    left, err = kill(proc, sig)
    assert not left, left
    assert leftovers(tmp_path, "") == [], err
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + sig, err
        assert err.strip().splitlines()[-1] == STOPPED
