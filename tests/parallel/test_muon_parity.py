"""optimizer=muon trains on each layout as on one process (tests/parity.py: losses within 1e-5,
gradient norms within 5e-4, final parameters), over 6 steps: each matrix split over ranks (FSDP's
shards, tensor-parallel slices, expert stacks) or copied on several (HSDP, DDP) is assembled on
the one rank that owns it for its Newton-Schulz iteration and its update sent back to every
holder (launcher/training/spread.py; bitwise, and once a step each, on DTensor shards in
tests/test_muon.py).
The rows run the Newton-Schulz iteration in fp32 (optimizer.ns_dtype): in bf16, as published,
the rows' gradients, which differ from the reference's in their last fp32 bits, round apart now
and then and the iteration carries that to 1e-3 in the final parameters (the losses still agree
within 1e-5)."""

from __future__ import annotations

import pytest
from parity import assert_row, read_layout, reference_job, rows

pytestmark = pytest.mark.dist

# Six steps (the parity batch's four, two more of the cosine): the momentum of five steps in each.
MUON = ("optimizer=muon", "optimizer.ns_dtype=fp32", "train.steps=6")
LLAMA = ["model=llama3_debug", *MUON]
MIXTRAL = ["model=mixtral_debug", *MUON]
TWO = ["hardware.devices_per_node=2"]
FOUR = "hardware.devices_per_node=4"
ROWS = {
    "muon dp_shard=2": (LLAMA, TWO),
    "muon dp_shard=4": (LLAMA, [FOUR]),
    "muon ddp 2": (LLAMA, [*TWO, "data_parallel=ddp", "parallel.dp_replicate=2",
                           "parallel.dp_shard=1"]),
    "muon tp=2 sp": (
        LLAMA, [*TWO, "parallel.tp=2", "parallel.dp_shard=1", "tensor=sequence_parallel"]
    ),
    "muon pp=2 1f1b": (LLAMA, [*TWO, "parallel.pp=2", "parallel.dp_shard=1"]),
    "muon cp=2 ring": (LLAMA, [*TWO, "parallel.cp=2", "parallel.dp_shard=1", "context=ring"]),
    "muon mixtral ep=2": (MIXTRAL, [*TWO, "parallel.ep=2"]),
    # ZeRO-1: each matrix orthogonalised on the one rank that owns it, then broadcast.
    "muon zero1 2": (LLAMA, [*TWO, "data_parallel=zero1"]),
    "muon zero1 mixtral ep=2": (MIXTRAL, [FOUR, "data_parallel=zero1", "parallel.ep=2"]),
    # FSDP's shards of tensor-parallel slices (a strided shard), and HSDP's replicas.
    "muon dp_shard=2 x tp=2": (LLAMA, [FOUR, "parallel.tp=2", "tensor=sequence_parallel"]),
    "muon hsdp 2x2": (LLAMA, [FOUR, "parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "muon pp=2 interleaved": (LLAMA, [*TWO, "parallel.pp=2", "parallel.dp_shard=1",
                                      "pipeline=interleaved_1f1b", "pipeline.stages_per_rank=2"]),
    # The V schedule's two stages a rank (the split backward's weight pass) over FSDP's shards.
    "muon pp=2 zbv x dp_shard=2": (LLAMA, [FOUR, "parallel.pp=2", "pipeline=zbv"]),
    "muon zero2 dp_shard=2": (LLAMA, [*TWO, "data_parallel=zero2"]),
}  # fmt: skip
# MuonClip: the QK-clip after each step at a threshold the debug models' logits pass (their
# largest are 0.2-0.3 at the start), so heads are clipped at every step (checked below). GQA
# (llama3_debug), and MLA with Kimi K2's routing (recipe=kimi_k2_debug's model).
CLIP_LLAMA = [*LLAMA, "optimizer.qk_clip=0.2"]
KIMI = ["model=deepseek_debug", "model.n_group=1", "model.topk_group=1",
        "model.routed_scaling_factor=2.827", *MUON, "optimizer.qk_clip=0.12"]  # fmt: skip
CLIP_ROWS = {
    "muonclip dp_shard=2": (CLIP_LLAMA, TWO),
    "muonclip tp=2 sp": (
        CLIP_LLAMA, [*TWO, "parallel.tp=2", "parallel.dp_shard=1", "tensor=sequence_parallel"]
    ),
    "muonclip cp=2 ring": (
        CLIP_LLAMA, [*TWO, "parallel.cp=2", "parallel.dp_shard=1", "context=ring"]
    ),
    # The core under a recompute wrapper: its record (and cp's key gather) rerun in backward.
    "muonclip cp=2 ring selective": (
        CLIP_LLAMA, [*TWO, "parallel.cp=2", "parallel.dp_shard=1", "context=ring",
                     "recompute=selective"]
    ),
    # Per-op recompute: the replay reruns the record (nothing of it kept), op for op.
    "muonclip cp=2 ring op": (
        CLIP_LLAMA, [*TWO, "parallel.cp=2", "parallel.dp_shard=1", "context=ring", "recompute=op"]
    ),
    "muonclip pp=2 1f1b": (CLIP_LLAMA, [*TWO, "parallel.pp=2", "parallel.dp_shard=1"]),
    "muonclip zero1 2": (CLIP_LLAMA, [*TWO, "data_parallel=zero1"]),
    "muonclip dp_shard=2 x tp=2": (CLIP_LLAMA, [FOUR, "parallel.tp=2",
                                                "tensor=sequence_parallel"]),
    "muonclip kimi ep=2": (KIMI, [*TWO, "parallel.ep=2"]),
    "muonclip kimi tp=2": (KIMI, [*TWO, "parallel.tp=2", "parallel.dp_shard=1"]),
}  # fmt: skip


@pytest.mark.parametrize("row", rows(ROWS) + rows(CLIP_ROWS))
def test_matches_single_process(row, group):
    assert_row(group, row)


@pytest.mark.parametrize("row", rows(CLIP_ROWS))
def test_the_clip_sees_the_references_logits(row, group):
    """Each step's largest logit (over every rank's heads and tokens) and clipped heads as on
    one process: the clip reduces each head's maximum over the ranks that saw other tokens."""
    ref, run = group.result(row.reference), group.result(row.job)
    assert read_layout(run, "max_logit") == pytest.approx(read_layout(ref, "max_logit"), rel=1e-5)
    assert read_layout(run, "clipped_heads") == read_layout(ref, "clipped_heads")
    assert all(n > 0 for n in read_layout(ref, "clipped_heads"))


ADAMW = reference_job(["model=llama3_debug"])
MUON_REFERENCE = reference_job(LLAMA)


CLIP_REFERENCE = reference_job(CLIP_LLAMA)


@pytest.mark.jobs(ADAMW, MUON_REFERENCE, CLIP_REFERENCE)
def test_the_rows_train_with_muon(group):
    """The Muon reference's losses are not AdamW's (by far more than the rows' 1e-5 from step 2
    on): the rows hold Muon's update to one process, not AdamW's twice; nor are MuonClip's
    Muon's (the clip changes the weights)."""
    adamw, muon, clip = (
        read_layout(group.result(j), "loss") for j in (ADAMW, MUON_REFERENCE, CLIP_REFERENCE)
    )
    assert adamw[0] == pytest.approx(muon[0], rel=1e-6) == clip[0]  # the same start
    # The AdamW reference (the other parity files') runs their four steps, Muon's six.
    assert min(abs(a - m) for a, m in zip(adamw[1:], muon[1 : len(adamw)], strict=True)) > 1e-3
    assert min(abs(c - m) for c, m in zip(clip[1:], muon[1:], strict=True)) > 1e-5
