"""A blended, document-masked run (tests/blend_data.py: three sources by weight, one of them two
shards, data.attention=document) trains on each layout as on one process: losses within 1e-5,
gradient norms within 5e-4, final parameters as the harness holds them (tests/parity.py). One
process's document masking is itself held to each document run alone
(tests/models/test_document_masking.py), so these rows carry that to every axis."""

from __future__ import annotations

import pytest
from blend_data import BLEND
from group import Job
from jobs import devices
from parity import assert_row, read_layout, reference_job, rows

from parallel import document_logits

pytestmark = pytest.mark.dist

LLAMA = ["model=llama3_debug", *BLEND]
TWO = ["hardware.devices_per_node=2"]
ROWS = {
    "blend document dp_shard=2": (LLAMA, TWO),
    "blend document tp=2 sp": (
        LLAMA, [*TWO, "parallel.tp=2", "parallel.dp_shard=1", "tensor=sequence_parallel"]
    ),
    "blend document pp=2 1f1b": (LLAMA, [*TWO, "parallel.pp=2", "parallel.dp_shard=1"]),
    "blend document cp=2 ring": (
        LLAMA, [*TWO, "parallel.cp=2", "parallel.dp_shard=1", "context=ring"]
    ),
    "blend document cp=2 allgather recompute=op": (
        LLAMA,
        [*TWO, "parallel.cp=2", "parallel.dp_shard=1", "context=allgather", "recompute=op"],
    ),
    "blend document dp_shard=2 recompute=full": (LLAMA, [*TWO, "recompute=full"]),
    "gpt blend document tp=2": (
        ["model=gpt_debug", "model.dropout=0.0", *BLEND],
        [*TWO, "parallel.tp=2", "parallel.dp_shard=1"],
    ),
    "mixtral blend document ep=2": (["model=mixtral_debug", *BLEND], [*TWO, "parallel.ep=2"]),
    "deepseek blend document cp=2 ring": (
        ["model=deepseek_debug", *BLEND],
        [*TWO, "parallel.cp=2", "parallel.dp_shard=1", "context=ring"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("row", rows(ROWS))
def test_matches_single_process(row, group):
    assert_row(group, row)


CAUSAL = reference_job(["model=llama3_debug", BLEND[0]])  # the same blend, attending across EOS
MASKED = reference_job(LLAMA)


@pytest.mark.jobs(CAUSAL, MASKED)
def test_the_rows_train_with_document_masking_on(group):
    """The masked run's losses are not the causal run's (by 100x the rows' 1e-5 at some step):
    the rows above hold the masking itself to one process, not a causal run twice."""
    causal, masked = (read_layout(group.result(j), "loss") for j in (CAUSAL, MASKED))
    apart = max(abs(c - m) for c, m in zip(causal, masked, strict=True))
    assert apart > 1e-3, (causal, masked)


TWO_LAYOUTS = {
    "one process": ["hardware.devices_per_node=1"],
    "cp=2 ring": [*TWO, "parallel.cp=2", "parallel.dp_shard=1", "context=ring"],
    "cp=2 allgather": [*TWO, "parallel.cp=2", "parallel.dp_shard=1", "context=allgather"],
    "tp=2 sp": [*TWO, "parallel.tp=2", "parallel.dp_shard=1", "tensor=sequence_parallel"],
    "pp=2": [*TWO, "parallel.pp=2", "parallel.dp_shard=1"],
}
LOGITS = {
    name: Job(
        "parallel.document_logits:job",
        devices(layout),
        ("model=llama3_debug", "precision=fp32", "logging.wandb.mode=disabled", *layout),
        f"document logits {name}",
    )
    for name, layout in TWO_LAYOUTS.items()
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.jobs(job), id=n) for n, job in LOGITS.items()]
)
def test_masked_logits_equal_each_document_alone(name, group):
    """Each layout's logits of a batch of several documents (document_logits.batch) equal the
    logits of each document run alone on one process, within 1e-5 (fp32)."""
    import torch

    from launcher.cli import compose
    from launcher.training.trainer import build_model

    job = LOGITS[name]
    got = torch.zeros(2, 128, 320)
    seen = torch.zeros(128, dtype=torch.bool)
    for path in sorted(group.result(job).glob("logits.*.pt")):
        part = torch.load(path)
        got[:, part["positions"]] = part["logits"]
        seen[part["positions"]] = True
    assert seen.all(), f"{name}: positions {(~seen).nonzero().flatten().tolist()} missing"
    model = build_model(compose(list(job.args)), compose(list(job.args)).train.seed).eval()
    x = document_logits.batch()
    with torch.no_grad():
        for row in range(2):
            ends = [i + 1 for i, t in enumerate(x[row].tolist()) if t == document_logits.EOS]
            for a, b in zip([0, *ends], [*ends, 128], strict=True):
                if a < b:
                    alone = model(x[row : row + 1, a:b])[0]
                    torch.testing.assert_close(got[row, a:b], alone, rtol=0, atol=1e-5)
