"""Resume from a checkpoint: bitwise on the same layout, within 1e-5 on another (resharding).

Each source layout trains the parity harness's 4 steps (fp32, its batch) and checkpoints every 2.
A second run starts from its step-2 checkpoint (checkpoint.initial_load_path: the run continues at
the step the checkpoint holds) and trains steps 3-4; on the same layout its losses, gradient
norms and final parameters must equal the source run's exactly, on another layout the losses
must agree within 1e-5 relative (another summation order).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from blend_data import BLEND
from conftest import read_metrics, run_cli
from group import Job
from parity import BASE, ONE, STEPS, assert_parity, run_job

pytestmark = pytest.mark.dist

HALF = STEPS // 2
SAVE = [f"checkpoint.interval={HALF}", "checkpoint.keep=0"]
MIDDLE, LAST = (f"checkpoints/step_{n:08d}" for n in (HALF, STEPS))
FOUR = ["hardware.devices_per_node=4"]
PP2 = ["hardware.devices_per_node=2", "parallel.pp=2", "parallel.dp_shard=1"]
GPT_TIED = ["model=gpt_debug", "model.dropout=0.0", "model.tie_embeddings=true"]
MTP = ["model=deepseek_debug", "model.mtp_depth=1"]
MUON = ["optimizer=muon", "optimizer.ns_dtype=fp32"]
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
    # Tied embeddings: the last stage's copy is saved and loaded under the embedding's name,
    # so a pipeline's checkpoint holds one matrix, as one process's does.
    "gpt tied pp=2 1f1b": [*GPT_TIED, *PP2],
    "gpt tied pp=2 zbv": [*GPT_TIED, *PP2, "pipeline=zbv"],
    "gpt tied one process": [*GPT_TIED, "hardware.devices_per_node=1"],
    # Multi-token prediction: the last stage's copy of the token table (on rank 0 beside the
    # first stage's under zbv) saved and loaded under the table's own name.
    "mtp pp=2 zbv": [*MTP, *PP2, "pipeline=zbv"],
    "mtp one process": [*MTP, "hardware.devices_per_node=1"],
    # A blend of three sources, document-masked: its order is a function of the step.
    "blend dp_shard=2": [*BLEND, "hardware.devices_per_node=2"],
    "blend tp=2": [*BLEND, "hardware.devices_per_node=2", "parallel.tp=2", "parallel.dp_shard=1"],
    # Muon's momentum beside AdamW's moments (optimizer=muon): as published (bf16 iterations)
    # for the bitwise resume; fp32 iterations across layouts (tests/parallel/test_muon_parity).
    "muon fsdp dp_shard=2": ["optimizer=muon", "hardware.devices_per_node=2"],
    "muon fsdp dp_shard=4": [*MUON, *FOUR],
    "muon dp_shard=2 x tp=2": [*MUON, *FOUR, "parallel.tp=2", "tensor=sequence_parallel"],
    # ZeRO-1's owners save and load their share of the momenta under the same keys.
    "muon zero1 dp_shard=2": [*MUON, "hardware.devices_per_node=2", "data_parallel=zero1"],
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
    "gpt tied pp=2 1f1b",
    "gpt tied pp=2 zbv",
    "mtp pp=2 zbv",
    "blend dp_shard=2",
    "muon fsdp dp_shard=2",
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
    ("gpt tied pp=2 1f1b", "gpt tied one process"),
    ("gpt tied one process", "gpt tied pp=2 zbv"),
    ("mtp pp=2 zbv", "mtp one process"),
    ("blend dp_shard=2", "blend tp=2"),
    ("muon fsdp dp_shard=4", "muon dp_shard=2 x tp=2"),
    ("muon fsdp dp_shard=4", "muon zero1 dp_shard=2"),
    ("muon zero1 dp_shard=2", "muon fsdp dp_shard=4"),
]


def source(name: str) -> Job:
    """An uninterrupted run of a source layout, checkpointing half way and at the end."""
    return run_job([*LAYOUTS[name], *SAVE], f"source {name}")


def resumed(source_name: str, layout: str) -> Job:
    """The second half of the steps on `layout`, started from the source's middle checkpoint."""
    src = source(source_name)
    ckpt = f"checkpoint.initial_load_path={src.path(MIDDLE)}"
    job = run_job([*LAYOUTS[layout], ckpt], f"{source_name} -> {layout}")
    return replace(job, needs=(src,))


def resume_rows(group, source_name: str, layout: str) -> list[dict]:
    """The resumed run's metrics; it said where it started."""
    src, out = group.result(source(source_name)), group.result(resumed(source_name, layout))
    assert f"starting from step {HALF} of {src / MIDDLE}" in (out / "log.0.txt").read_text()
    return read_metrics(out)


def pairs(names: list[tuple[str, str]], bitwise: bool = False) -> list:
    """pytest params of (source, target) layouts, each declaring its two jobs."""
    return [
        pytest.param(
            *((s,) if bitwise else (s, t)),
            id=s if bitwise else f"{s} -> {t}",
            marks=pytest.mark.jobs(source(s), resumed(s, t)),
        )
        for s, t in names
    ]


@pytest.mark.parametrize("name", pairs([(n, n) for n in BITWISE], bitwise=True))
def test_resume_is_bitwise(name, group):
    rows = resume_rows(group, name, name)
    src, out = group.result(source(name)), group.result(resumed(name, name))
    full = read_metrics(src)
    assert [r["step"] for r in rows] == list(range(HALF + 1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in rows] == [r[key] for r in full[HALF:]], key
    ref, got = torch.load(src / "final_model.pt"), torch.load(out / "final_model.pt")
    assert ref.keys() == got.keys()
    unequal = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not unequal, f"{name}: final parameters not bitwise equal: {unequal[:5]}"


@pytest.mark.parametrize(("source_name", "target"), pairs(RESHARD))
def test_resume_on_another_layout(source_name, target, group):
    rows = resume_rows(group, source_name, target)
    assert [r["step"] for r in rows] == list(range(HALF + 1, STEPS + 1))
    expected = [r["loss"] for r in read_metrics(group.result(source(source_name)))[HALF:]]
    assert_parity(expected, [r["loss"] for r in rows], 1e-5, f"{source_name} -> {target}")


FSDP2 = source("fsdp dp_shard=2")


@pytest.mark.jobs(FSDP2)
def test_another_model_shape_is_refused_by_name(group, tmp_path):
    ckpt = group.result(FSDP2) / MIDDLE
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


WEIGHTS_ONLY = replace(
    run_job(
        [
            ONE,
            f"checkpoint.initial_load_path={FSDP2.path(LAST)}",
            "checkpoint.initial_load_weights_only=true",
        ],
        "weights only",
    ),
    needs=(FSDP2,),
)


@pytest.mark.jobs(FSDP2, WEIGHTS_ONLY)
def test_weights_only_starts_at_step_one(group):
    src, out = group.result(FSDP2), group.result(WEIGHTS_ONLY)
    ckpt = src / LAST
    assert f"starting from the weights of {ckpt}" in (out / "log.0.txt").read_text()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # Trained weights, fresh optimizer: the first loss is the trained model's, well below the
    # untrained first loss of the source run.
    assert rows[0]["loss"] < read_metrics(src)[0]["loss"] - 0.5


INTERLEAVED = source("pp=2 interleaved")


@pytest.mark.jobs(INTERLEAVED)
def test_list_and_export(group, tmp_path):
    src = group.result(INTERLEAVED)
    listed = run_cli("launcher.checkpoint", "list", str(src))
    assert listed.returncode == 0, listed.stderr
    assert MIDDLE.split("/")[1] in listed.stdout and LAST.split("/")[1] in listed.stdout
    assert "pp=2 interleaved_1f1b/2" in listed.stdout and "complete" in listed.stdout
    out = tmp_path / "model.pt"
    exported = run_cli("launcher.checkpoint", "export", str(src / LAST), str(out))
    assert exported.returncode == 0, exported.stderr
    # The exported model equals the full state dict the engine gathered at the end.
    ref, got = torch.load(src / "final_model.pt"), torch.load(out)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
