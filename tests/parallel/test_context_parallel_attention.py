"""Context-parallel attention (launcher.parallel.context_parallel): both methods, cp = 2 and 4,
load-balanced or not, GQA, MHA and MLA's narrower values, with and without attention dropout,
against full attention in one process (cp_attention.py, a job of tests/group.py per cp), and
which ring blocks each rank computes; the sequence sharding and the argument checks need no
processes."""

from __future__ import annotations

import itertools

import pytest
import torch
from group import per_rank
from jobs import mesh_job

from launcher.parallel.context_parallel import (
    METHODS,
    chunk_positions,
    context_attention,
    shard_sequence,
)

pytestmark = pytest.mark.dist
CPS = (2, 4)
JOBS = {
    cp: mesh_job("parallel.cp_attention:job", (cp,), ("cp",), label=f"cp_attention cp={cp}")
    for cp in CPS
}
CASES = [
    "/".join(c)
    for c in itertools.product(
        (*METHODS, "ring-matmul"),
        ("contiguous", "balanced"),
        ("gqa", "mha", "mla"),
        ("fp32", "bf16"),
    )
]
TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}  # bf16: relative to the largest reference value


@pytest.fixture(scope="module")
def recorded(group):
    return {cp: per_rank(group, job) for cp, job in JOBS.items()}


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cp", CPS)
def test_matches_full_attention(recorded, cp, case):
    precision = case.rsplit("/", 1)[1]
    dtype = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[precision]
    for rank, result in recorded[cp].items():
        errs = {n: result[case][n] for n in ("out", "dq", "dk", "dv")}
        assert result[case]["dtype"] == [dtype] * 4, (rank, result[case]["dtype"])
        if precision == "fp32":
            assert all(a <= 1e-5 and r <= 1e-5 for a, r in errs.values()), (rank, errs)
        else:
            assert all(r <= TOLERANCE["bf16"] for _, r in errs.values()), (rank, errs)


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("cp", CPS)
def test_dropout_drops_what_full_attention_with_the_same_masks_drops(recorded, cp):
    """Attention dropout (p = 0.25): output and gradients equal full attention dropping the
    probabilities the ranks' masks drop (backward draws the masks again), and the masks keep
    3/4 of the causal probabilities."""
    for rank, result in recorded[cp].items():
        assert set(result["dropout"]) == {
            f"{m}/{b}" for m in METHODS for b in ("contiguous", "balanced")
        }
        for case, errs in result["dropout"].items():
            kept = errs.pop("kept")
            assert abs(kept - 0.75) < 0.03, (rank, case, kept)
            assert all(a <= 1e-5 and r <= 1e-5 for a, r in errs.values()), (rank, case, errs)


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("cp", CPS)
def test_document_masking_matches_full_attention_and_skips_masked_blocks(recorded, cp):
    """Documents (cp_attention.DOCUMENTS: a boundary at the middle of both rows): output and
    gradients equal full attention with the same documents, for each method and kernel,
    balanced or not, GQA and MLA's narrower values; contiguous chunks skip the blocks whose
    queries all lie in later documents than their keys, so fewer blocks run than causally."""
    for rank, result in recorded[cp].items():
        assert len(result["documents"]) == 12
        for case, got in result["documents"].items():
            errs = {n: got[n] for n in ("out", "dq", "dk", "dv")}
            assert all(a <= 1e-5 and r <= 1e-5 for a, r in errs.values()), (rank, case, errs)
            method, balance, heads = case.split("/")
            causal = result[f"{method}/{balance}/{heads}/fp32"]["counts"]["forward"][0]
            if balance == "contiguous" and rank >= cp // 2:
                # rank r's queries are all in the second half: the first half's blocks go
                assert got["counts"]["forward"][0] == causal - cp // 2, (rank, case, got)


@pytest.mark.jobs(*JOBS.values())
@pytest.mark.parametrize("cp", CPS)
def test_blocks_computed_are_only_what_causality_needs(recorded, cp):
    """Contiguous: rank r sees the blocks of ranks 0..r only, r + 1 full blocks (rank 0 skips
    cp - 1 of them). Balanced: every rank computes its diagonal block and half of each other
    block, the same number of score entries on every rank. Backward recomputes the same blocks.
    Both methods: allgather runs the same blocks on its gathered K/V."""
    for rank, result in recorded[cp].items():
        s = result["seq_len"]
        local, chunk = s // cp, s // (2 * cp)
        for case in CASES:
            counts = result[case]["counts"]
            if "/contiguous/" in case:
                want = [rank + 1, (rank + 1) * local * local]
            else:
                want = [cp, local * local + (cp - 1) * local * chunk]
            assert counts == {"forward": want, "backward": want}, (rank, case, counts)


def test_chunk_positions():
    assert chunk_positions(8, 2, 0, True).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1, True).tolist() == [2, 3, 4, 5]
    assert chunk_positions(8, 2, 1, False).tolist() == [4, 5, 6, 7]
    for balanced in (False, True):
        held = torch.cat([chunk_positions(48, 4, r, balanced) for r in range(4)])
        assert sorted(held.tolist()) == list(range(48))


def test_shard_sequence_takes_the_positions_along_dim():
    x = torch.arange(2 * 3 * 16).view(2, 3, 16)
    pos = chunk_positions(16, 4, 1, True)
    assert torch.equal(shard_sequence(x, 4, 1, True, dim=2), x[:, :, pos])
    assert torch.equal(shard_sequence(x.transpose(1, 2), 4, 1, True), x.transpose(1, 2)[:, pos])


@pytest.mark.parametrize(
    ("seq_len", "cp", "rank", "balanced", "message"),
    [
        (12, 4, 0, True, r"seq_len=12 must be divisible by 2\*cp=8"),
        (10, 4, 0, False, "seq_len=10 must be divisible by cp=4"),
        (16, 4, 4, True, r"rank=4 must be in \[0, cp=4\)"),
    ],
)
def test_chunk_positions_refuses(seq_len, cp, rank, balanced, message):
    with pytest.raises(ValueError, match=message):
        chunk_positions(seq_len, cp, rank, balanced)


def test_context_attention_refuses_bad_arguments_together():
    q, k = torch.zeros(1, 3, 4, 8), torch.zeros(1, 2, 4, 8)
    pos = torch.arange(4)
    with pytest.raises(ValueError) as err:
        context_attention(q, k, k, pos, None, "ulysses", dropout=1.0)
    message = str(err.value)
    assert "method='ulysses' must be one of allgather, ring" in message
    assert "dropout=1.0 must be in [0, 1)" in message
    assert "K=2 must divide query heads H=3" in message
