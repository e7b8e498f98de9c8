"""The memory ledger on 2 processes: what each rank of the real engine holds (parameters,
gradients, Adam moments or Muon's momentum, and the activations its blocks keep for backward,
see ledger.py),
category by category, equals the planner's figures for the same rank, under FSDP, TP + SP
and a pipeline, for every recompute option.

Model states to 0.1% (the planner counts the norms' replicated gains per layer exactly; the
residue is rounding of the per-rank split); activations to 2% (see test_saved_activations: the
per-token statistics of norms and fused attention are left out).
"""

from __future__ import annotations

import pytest
from group import Job, per_rank

pytestmark = pytest.mark.dist

LAYOUTS = {
    "fsdp": "parallel.dp_shard=2",
    "tp=2 sp": "parallel.tp=2 parallel.dp_shard=1 tensor=sequence_parallel",
    "pp=2 1f1b": "parallel.pp=2 parallel.dp_shard=1 pipeline=1f1b",
}
MODES = ["recompute=none", "recompute=selective", "recompute=op", "recompute=full"]
MODES.append("recompute=full recompute.every=2")
MODES.append("recompute=op recompute.matmuls=alternate")
# Every option under TP + SP (where the saved-tensor hooks, checkpoints and SAC interact);
# under FSDP and the pipeline the three that differ in what a rank keeps per block.
CASES = [f"{LAYOUTS['tp=2 sp']};{m}" for m in MODES]
CASES += [f"{LAYOUTS[k]};{m}" for k in ("fsdp", "pp=2 1f1b") for m in MODES[::2]]
CASES.append(f"{LAYOUTS['fsdp']};recompute=op recompute.matmuls=alternate")
# Tied embeddings under zbv: rank 0 holds stage 0's embedding and the last stage's copy.
CASES.append(
    "model.tie_embeddings=true parallel.pp=2 parallel.dp_shard=1 pipeline=zbv;recompute=none"
)
# MLA under TP + SP: the latent down-projections stay whole on every tp rank (the planner split
# them over tp until the family's parameters said which it splits).
CASES.append("model=deepseek_debug " + LAYOUTS["tp=2 sp"] + ";recompute=none")
# Multi-token prediction's depth on the last stage (its block a layer's, its own projection
# and norms, and a copy of the token table).
CASES.append(
    "model=deepseek_debug model.mtp_depth=1 parallel.pp=2 parallel.dp_shard=1;recompute=none"
)
# optimizer=muon: the blocks' matrices keep one momentum each, the rest AdamW's two moments.
CASES += [f"{LAYOUTS[k]} optimizer=muon;recompute=none" for k in ("fsdp", "tp=2 sp", "pp=2 1f1b")]
LEDGER = Job("parallel.ledger:job", 2, tuple("hardware.devices_per_node=2 " + c for c in CASES))
# ZeRO-1 on 4 ranks: beside tp (each rank owns a share of the TP shards) and with routed experts
# (their states sharded over the 2 ranks holding the same experts, the rest over all 4).
ZERO1 = {
    "zero1 x tp=2": "parallel.tp=2 data_parallel=zero1 tensor=sequence_parallel;recompute=none",
    "mixtral zero1 x ep=2": "model=mixtral_debug parallel.ep=2 data_parallel=zero1;recompute=none",
    # Muon's momenta on their owners beside AdamW's moments (one split of the two).
    "muon zero1 x tp=2": (
        "parallel.tp=2 data_parallel=zero1 tensor=sequence_parallel optimizer=muon;recompute=none"
    ),
    "muon mixtral zero1 x ep=2": (
        "model=mixtral_debug parallel.ep=2 data_parallel=zero1 optimizer=muon;recompute=none"
    ),
}
LEDGER_4 = Job(
    "parallel.ledger:job", 4, tuple("hardware.devices_per_node=4 " + c for c in ZERO1.values())
)


@pytest.mark.jobs(LEDGER)
@pytest.mark.parametrize("case", CASES)
def test_every_category_equals_the_plan(case, group):
    for rank, cases in per_rank(group, LEDGER).items():
        categories = cases["hardware.devices_per_node=2 " + case]
        for category, (measured, planned) in categories.items():
            rel = 0.02 if category == "activations" else 1e-3
            where = f"rank {rank} {case} {category}"
            assert measured == pytest.approx(planned, rel=rel), where
            assert measured > 0, where


@pytest.mark.jobs(LEDGER_4)
@pytest.mark.parametrize("case", list(ZERO1))
def test_zero1_model_states_equal_the_plan(case, group):
    """Parameters, gradients and Adam moments per rank (the routed experts' activations depend
    on where the tokens went, so they are left to the parity rows). The planner splits the
    Adam states evenly; ZeRO-1 gives each rank whole tensors, so a rank may hold a little more
    (up to 2%) while the ranks together hold exactly the planner's total."""
    ranks = per_rank(group, LEDGER_4)
    for category in ("params", "grads", "optimizer"):
        figures = [
            cases["hardware.devices_per_node=4 " + ZERO1[case]][category]
            for cases in ranks.values()
        ]
        rel = 0.02 if category == "optimizer" else 1e-3
        for rank, (measured, planned) in enumerate(figures):
            assert measured == pytest.approx(planned, rel=rel), f"rank {rank} {case} {category}"
        total = sum(m for m, _ in figures)
        assert total == pytest.approx(sum(p for _, p in figures), rel=1e-3), f"{case} {category}"
