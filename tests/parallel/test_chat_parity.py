"""Fine-tuning on a chat set (tests/chat_data.py: conversations of unequal lengths packed whole
into windows, the loss on the answers only) trains on each layout as on one process: losses
within 1e-5, gradient norms within 5e-4, final parameters (tests/parity.py). The ranks, micro-
batches and context-parallel shards of a step hold different numbers of trained tokens, so a
mean per micro-batch or per rank would not match; the one-process loss is itself held to the
mean over the whole batch's trained tokens, computed here from the data and the model."""

from __future__ import annotations

import pytest
from blend_data import ROOT as BLEND_ROOT
from chat_data import CHAT
from conftest import read_metrics
from parity import BASE, assert_row, read_layout, reference_job, rows, run_job

pytestmark = pytest.mark.dist

LLAMA = ["model=llama3_debug", *CHAT]
# Micro-batches of one sequence, where the reference takes two: a mean per micro-batch (or per
# rank, or per cp shard) is then not the reference's, and a row could not match with it.
TWO = ["hardware.devices_per_node=2", "train.micro_batch_size=1"]
ROWS = {
    "chat dp_shard=2": (LLAMA, TWO),
    "chat tp=2 sp": (
        LLAMA, [*TWO, "parallel.tp=2", "parallel.dp_shard=1", "tensor=sequence_parallel"]
    ),
    "chat pp=2 1f1b": (LLAMA, [*TWO, "parallel.pp=2", "parallel.dp_shard=1"]),
    "chat cp=2 ring": (LLAMA, [*TWO, "parallel.cp=2", "parallel.dp_shard=1", "context=ring"]),
    # Two sequences a micro-batch, as the reference: the balance loss is one micro-batch's.
    "chat mixtral ep=2": (["model=mixtral_debug", *CHAT], [*TWO, "train.micro_batch_size=2",
                                                           "parallel.ep=2"]),
    "chat dp_shard=2 x pp=2": (
        LLAMA, [*TWO, "hardware.devices_per_node=4", "parallel.pp=2", "parallel.dp_shard=2"]
    ),
}  # fmt: skip


@pytest.mark.parametrize("row", rows(ROWS))
def test_matches_single_process(row, group):
    assert_row(group, row)


REFERENCE = reference_job(LLAMA)


def batch_losses(cfg) -> tuple[float, float, list[int]]:
    """Of the first global batch, from the data and the model as built (no trainer): the mean
    cross-entropy over its trained tokens, the mean over every target, and the trained tokens
    of each data-parallel rank's share of two."""
    import torch
    import torch.nn.functional as F

    from launcher.data.batches import IGNORE, Batches
    from launcher.data.sources import run_data
    from launcher.models.layers import document_ids
    from launcher.training.trainer import build_model

    t = cfg.train
    data = run_data(cfg.data, t.seq_len)
    batches = Batches(data.train, t.global_batch_size, t.global_batch_size, 0, 1, t.seed, True)
    ((x, y),) = batches.at(0)
    plain = Batches(data.train, t.global_batch_size, t.global_batch_size, 0, 1, t.seed, True)
    plain.masked = False  # the same windows, every target kept
    ((_, every),) = plain.at(0)
    model = build_model(cfg, t.seed)
    with torch.no_grad():
        logits = model(x, None, document_ids(x, data.eos_id)).flatten(0, 1)
    masked = F.cross_entropy(logits, y.flatten(), ignore_index=IGNORE).item()
    unmasked = F.cross_entropy(logits, every.flatten()).item()
    half = t.global_batch_size // 2
    shares = [int((y[i * half : (i + 1) * half] != IGNORE).sum()) for i in range(2)]
    return masked, unmasked, shares


@pytest.mark.jobs(REFERENCE)
def test_the_first_loss_is_the_mean_over_the_batch_trained_tokens(group):
    """The one-process run's first loss equals the batch's masked mean computed here (1e-5),
    which is not the mean over every target; and the two halves of the batch (two data-parallel
    ranks' shares) hold different numbers of trained tokens, so the rows above could not match
    with a per-rank mean."""
    from launcher.cli import compose

    cfg = compose([*BASE, *LLAMA, "hardware.devices_per_node=1"])
    masked, unmasked, shares = batch_losses(cfg)
    first = read_layout(group.result(REFERENCE), "loss")[0]
    assert first == pytest.approx(masked, rel=1e-5), (first, masked)
    assert abs(masked - unmasked) > 1e-2, (masked, unmasked)
    assert shares[0] != shares[1] and min(shares) > 0, shares
    trained = read_layout(group.result(REFERENCE), "trained_tokens")[0]
    assert trained == sum(shares), (trained, shares)


# Evaluation on the held-out windows: the mean over their trained tokens too, on every layout;
# and beside it a named validation set of plain text, its mean over every target.
EVAL = ["train.steps=2", "train.eval_interval=2", "train.eval_batches=2",
        f"data.val_sources={{plain: {BLEND_ROOT}/web.bin}}"]  # fmt: skip
EVAL_JOBS = {
    "one process": run_job([*LLAMA, *EVAL, "hardware.devices_per_node=1"], "chat eval, one"),
    "pp=2": run_job([*LLAMA, *EVAL, *TWO, "parallel.pp=2", "parallel.dp_shard=1"],
                    "chat eval, pp=2"),
    "cp=2": run_job([*LLAMA, *EVAL, *TWO, "parallel.cp=2", "parallel.dp_shard=1",
                     "context=ring"], "chat eval, cp=2"),
}  # fmt: skip


@pytest.mark.jobs(*EVAL_JOBS.values())
def test_eval_loss_is_the_mean_over_the_held_out_trained_tokens(group):
    """eval_loss after step 2 equals the held-out batches' masked mean computed here from the
    one-process run's final parameters (1e-5), on one process, pp=2 and cp=2; eval/plain, a
    plain text's, its mean over every target."""
    import torch
    import torch.nn.functional as F

    from launcher.cli import compose
    from launcher.data.batches import IGNORE, Batches
    from launcher.data.sources import run_data
    from launcher.models.layers import document_ids
    from launcher.training.trainer import build_model

    cfg = compose([*BASE, *LLAMA, *EVAL, "hardware.devices_per_node=1"])
    t = cfg.train
    data = run_data(cfg.data, t.seq_len)
    model = build_model(cfg, t.seed)
    one = group.result(EVAL_JOBS["one process"])
    model.load_state_dict(torch.load(one / "final_model.pt"))

    def mean(split) -> float:
        held = Batches(split, t.global_batch_size, t.global_batch_size, 0, 1, t.seed, False)
        total, count = 0.0, 0
        with torch.no_grad():
            for k in range(t.eval_batches):
                ((x, y),) = held.micro_batches(k)
                logits = model.eval()(x, None, document_ids(x, data.eos_id)).flatten(0, 1)
                ce = F.cross_entropy(logits, y.flatten(), ignore_index=IGNORE, reduction="sum")
                total, count = total + float(ce), count + int((y != IGNORE).sum())
        return total / count

    want = {"eval_loss": mean(data.held_out), "eval/plain": mean(data.named["plain"])}
    for name, job in EVAL_JOBS.items():
        got = [r for r in read_metrics(group.result(job)) if "eval_loss" in r][-1]
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5), (name, key, got[key], value)
