"""Start the engine from a Hugging Face directory on a layout and record its logits.

A job of tests/group.py: `job(OUT_DIR, *OVERRIDES)` (the overrides include
checkpoint.initial_load_path=HF_DIR checkpoint.initial_load_format=hf). Builds the real
Trainer for the planned layout, loads the weights through Trainer.resume (each rank reading its
own shards), runs a fixed batch forward and writes OUT_DIR/logits.pt on the rank holding the
full logits, and OUT_DIR/RANK.json with the values this rank read and the values it holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from jobs import trainer_of
from torch.distributed.tensor import DTensor

from hf import hf_models
from launcher.parallel import pipeline_parallel

BATCH = (2, 24)


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, BATCH, generator=torch.Generator().manual_seed(1))


def job(out: Path, *overrides: str) -> None:
    cfg, d, trainer = trainer_of(out, overrides)
    read = [0]
    load_hf = trainer.load_hf
    trainer.load_hf = lambda path: read.__setitem__(0, load_hf(path))
    assert trainer.resume() == 0
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainer.params)
    (out / f"{d.rank}.json").write_text(json.dumps({"read": read[0], "held": held}))
    x = batch(cfg.model.vocab_size)
    logits = []
    with torch.no_grad():
        for part in trainer.parts:
            part.eval()
        if trainer.schedule is None:
            out_ = trainer.parts[0](x)
            logits.append(out_.full_tensor() if isinstance(out_, DTensor) else out_)
        else:
            lay = trainer.layout
            keep = lambda h, y: logits.append(h) or h.sum()  # noqa: E731
            pipeline_parallel.forward_only(dict(trainer.stages), lay, d.mesh["pp"], x, x, keep)
    if logits and d.dp_rank == 0 and d.local_rank_of("tp") == 0:
        torch.save(logits[0], out / "logits.pt")


def save_job(out: Path, family: str) -> None:
    """transformers' model of a family, saved with save_pretrained into OUT, its logits on the
    fixed batch (OUT/reference.pt) and its count of values (parameters and persistent buffers,
    such as DeepSeek-V3's expert biases, which are read like weights: OUT/total.json)."""
    model = hf_models.build(family)
    hf_models.save(model, out)
    torch.save(hf_models.logits(model, batch(320)), out / "reference.pt")
    total = sum(t.numel() for t in model.state_dict().values())
    (out / "total.json").write_text(json.dumps(total))
