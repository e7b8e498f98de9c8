"""A document-masked model's logits on a layout. A job of tests/group.py: `job(OUT, *OVERRIDES)`
builds the engine's Trainer for the planned layout (the same seeded initial parameters as one
process), runs one fixed batch of several documents forward with the document ids, and writes
OUT/logits.RANK.pt: the logits this rank holds ((B, S_local, V), full over the vocabulary)
and the sequence positions they are at, on every rank that holds logits of the last stage and
tp rank 0. tests/parallel/test_data_parity.py holds them to each document run alone."""

from __future__ import annotations

from pathlib import Path

import torch
from jobs import trainer_of
from torch.distributed.tensor import DTensor

from launcher.models.layers import document_ids
from launcher.parallel import pipeline_parallel

EOS = 256  # the byte-level tokenizer's


def batch() -> torch.Tensor:
    """(2, 128) byte ids with EOS at fixed places: documents of 1 to 70 tokens."""
    x = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(3))
    x[0, [9, 10, 60, 127]] = EOS
    x[1, [0, 33, 100, 101]] = EOS
    return x


def job(out: Path, *overrides: str) -> None:
    _, d, trainer = trainer_of(out, overrides)
    x = batch()
    docs = document_ids(x, EOS)
    pos = trainer.positions if trainer.positions is not None else torch.arange(x.shape[1])
    held = []
    with torch.no_grad():
        for part in trainer.parts:
            part.eval()
        if trainer.schedule is None:
            logits = trainer.parts[0](x[:, pos], trainer.positions, docs)
            held.append(logits.full_tensor() if isinstance(logits, DTensor) else logits)
        else:
            lay = trainer.layout
            keep = lambda h, y: held.append(h) or h.sum()  # noqa: E731
            pipeline_parallel.forward_only(
                dict(trainer.stages), lay, d.mesh["pp"], x, x, keep,
                trainer.positions, docs,
            )  # fmt: skip
    if held and d.local_rank_of("tp") == 0:
        torch.save({"logits": held[0], "positions": pos}, out / f"logits.{d.rank}.pt")
