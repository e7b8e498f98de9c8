"""Resume from a checkpoint: bitwise on the same layout, within 1e-5 on another (resharding).

Each source layout trains 6 steps and checkpoints every 3 (fp32, the parity harness's batch).
A second run starts from its step-3 checkpoint (checkpoint.initial_load_path: the run continues at
the step the checkpoint holds) and trains steps 4-6; on the same layout its losses, gradient
norms and final parameters must equal the source run's exactly, on another layout the losses
must agree within 1e-5 relative (another summation order).
"""

from __future__ import annotations

import pytest
import torch
from conftest import read_metrics, run_cli
from parity import BASE, assert_parity, run_layout

pytestmark = pytest.mark.dist

SAVE = ["checkpoint.interval=3", "checkpoint.keep=0"]
FOUR = ["hardware.devices_per_node=4"]
PP2 = ["hardware.devices_per_node=2", "parallel.pp=2", "parallel.dp_shard=1"]
LAYOUTS = {
    "fsdp dp_shard=2": ["hardware.devices_per_node=2"],
    "fsdp dp_shard=4": FOUR,
    "hsdp 2x2": [*FOUR, "parallel.dp_replicate=2", "parallel.dp_shard=2"],
    "tp=2": ["hardware.devices_per_node=2", "parallel.tp=2", "parallel.dp_shard=1"],
    "pp=2 1f1b": PP2,
    "pp=2 interleaved": [*PP2, "pipeline=interleaved_1f1b", "pipeline.stages_per_rank=2"],
    "zero1 dp_shard=2": ["hardware.devices_per_node=2", "data_parallel=zero1"],
    "fsdp dp_shard=2 async save": ["hardware.devices_per_node=2", "checkpoint.async_save=true"],
    # Dropout draws from the generator every step: bitwise only if its state is restored.
    "gpt dropout=0.1 one process": [
        "model=gpt_debug",
        "model.dropout=0.1",
        "hardware.devices_per_node=1",
    ],
    "cp=2 ring": [
        "hardware.devices_per_node=2",
        "parallel.cp=2",
        "parallel.dp_shard=1",
        "context=ring",
    ],
    # Experts stacked (E, ...) and sharded over ep: the checkpoint holds the whole stack.
    "mixtral ep=2": ["model=mixtral_debug", "hardware.devices_per_node=2", "parallel.ep=2"],
    # Targets of the reshard pairs only.
    "mixtral one process": ["model=mixtral_debug", "hardware.devices_per_node=1"],
    "mixtral ep=4": ["model=mixtral_debug", *FOUR, "parallel.ep=4"],
    "dp_shard=2 x tp=2": [*FOUR, "parallel.tp=2", "tensor=sequence_parallel"],
    "one process": ["hardware.devices_per_node=1"],
    "ddp 2": ["hardware.devices_per_node=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"],
}
BITWISE = [
    "fsdp dp_shard=2",
    "hsdp 2x2",
    "tp=2",
    "pp=2 1f1b",
    "pp=2 interleaved",
    "zero1 dp_shard=2",
    "fsdp dp_shard=2 async save",
    "gpt dropout=0.1 one process",
    "cp=2 ring",
    "mixtral ep=2",
]
RESHARD = [
    ("fsdp dp_shard=4", "dp_shard=2 x tp=2"),
    ("fsdp dp_shard=2", "pp=2 1f1b"),
    ("pp=2 interleaved", "one process"),
    ("hsdp 2x2", "ddp 2"),
    ("zero1 dp_shard=2", "fsdp dp_shard=4"),
    # FSDP over dp_shard x cp = 2 ranks back into one process (the cp=2 -> cp=1).
    ("cp=2 ring", "one process"),
    ("mixtral ep=2", "mixtral one process"),
    ("mixtral ep=2", "mixtral ep=4"),
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Uninterrupted 6-step runs of each source layout, checkpointing at steps 3 and 6."""
    cache = {}

    def get(name: str):
        if name not in cache:
            run_dir = tmp_path_factory.mktemp(name.replace(" ", "_").replace("=", ""))
            losses = run_layout(run_dir, [*LAYOUTS[name], *SAVE])
            assert losses[-1] < losses[0]
            cache[name] = run_dir
        return cache[name]

    return get


def resume(run_dir, source_dir, layout: str) -> list[dict]:
    """Steps 4-6 of `layout`, started from the source's step-3 checkpoint."""
    ckpt = source_dir / "checkpoints" / "step_00000003"
    result = run_cli(
        "launcher.train",
        *BASE,
        *LAYOUTS[layout],
        f"checkpoint.initial_load_path={ckpt}",
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"starting from step 3 of {ckpt}" in result.stdout
    return read_metrics(run_dir)


# HSDP's resume rows (its source run, bitwise, and into DDP) are in the `slow` tier: FSDP and
# ZeRO-1 cover its state, and the parity rows its mesh (make test-all runs them).
SLOW = "hsdp 2x2"


def tier(*names: str) -> list:
    return [pytest.mark.slow] if SLOW in names else []


# mixtral ep=2's bitwise resume is `slow` too: its resharding rows load the same checkpoint.
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=tier(n) or ([pytest.mark.slow] if n == "mixtral ep=2" else []))
     for n in BITWISE],
)  # fmt: skip
def test_resume_is_bitwise(name, sources, tmp_path):
    source = sources(name)
    rows = resume(tmp_path, source, name)
    full = read_metrics(source)
    assert [r["step"] for r in rows] == [4, 5, 6]
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in rows] == [r[key] for r in full[3:]], key
    ref, got = torch.load(source / "final_model.pt"), torch.load(tmp_path / "final_model.pt")
    assert ref.keys() == got.keys()
    unequal = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not unequal, f"{name}: final parameters not bitwise equal: {unequal[:5]}"


@pytest.mark.parametrize(
    ("source", "target"),
    [pytest.param(s, t, marks=tier(s, t), id=f"{s} -> {t}") for s, t in RESHARD],
)
def test_resume_on_another_layout(source, target, sources, tmp_path):
    src = sources(source)
    rows = resume(tmp_path, src, target)
    assert [r["step"] for r in rows] == [4, 5, 6]
    expected = [r["loss"] for r in read_metrics(src)[3:]]
    assert_parity(expected, [r["loss"] for r in rows], 1e-5, f"{source} -> {target}")


def test_another_model_shape_is_refused_by_name(sources, tmp_path):
    ckpt = sources("fsdp dp_shard=2") / "checkpoints" / "step_00000003"
    result = run_cli(
        "launcher.train",
        *BASE,
        "model.dim=64",
        "model.n_layers=2",
        f"checkpoint.initial_load_path={ckpt}",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 2
    assert "dim=128 in the checkpoint but model.dim=64" in result.stderr
    assert "n_layers=4 in the checkpoint but model.n_layers=2" in result.stderr
    assert "Traceback" not in result.stderr


def test_weights_only_starts_at_step_one(sources, tmp_path):
    src = sources("fsdp dp_shard=2")
    ckpt = src / "checkpoints" / "step_00000006"
    result = run_cli(
        "launcher.train",
        *BASE,
        "hardware.devices_per_node=1",
        f"checkpoint.initial_load_path={ckpt}",
        "checkpoint.initial_load_weights_only=true",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"starting from the weights of {ckpt}" in result.stdout
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    # Trained weights, fresh optimizer: the first loss is the trained model's, well below the
    # untrained first loss of the source run.
    assert rows[0]["loss"] < read_metrics(src)[0]["loss"] - 0.5


def test_list_and_export(sources, tmp_path):
    src = sources("pp=2 interleaved")
    listed = run_cli("launcher.checkpoint", "list", str(src))
    assert listed.returncode == 0, listed.stderr
    assert "step_00000003" in listed.stdout and "step_00000006" in listed.stdout
    assert "pp=2 interleaved_1f1b/2" in listed.stdout and "complete" in listed.stdout
    out = tmp_path / "model.pt"
    exported = run_cli(
        "launcher.checkpoint", "export", str(src / "checkpoints/step_00000006"), str(out)
    )
    assert exported.returncode == 0, exported.stderr
    # The exported model equals the full state dict the engine gathered at the end.
    ref, got = torch.load(src / "final_model.pt"), torch.load(out)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
