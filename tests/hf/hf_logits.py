"""Start the engine from a Hugging Face directory on a layout and record its logits.

Run under torchrun: `hf_logits.py OUT_DIR OVERRIDE...` (the overrides include
checkpoint.initial_load_path=HF_DIR checkpoint.initial_load_format=hf). Builds the real
Trainer for the planned layout, loads the weights through Trainer.resume (each rank reading its
own shards), runs a fixed batch forward and writes OUT_DIR/logits.pt on the rank holding the
full logits, and OUT_DIR/RANK.json with the values this rank read and the values it holds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from launcher import distributed
from launcher.cli import compose
from launcher.parallel import pipeline
from launcher.plan import make_plan
from launcher.trainer import Trainer

BATCH = (2, 24)


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, BATCH, generator=torch.Generator().manual_seed(1))


def main(out: Path, overrides: list[str]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = compose(overrides)
    plan = make_plan(cfg)
    assert plan.ok, plan.errors
    d = distributed.init("cpu", plan.layout, 120.0)
    trainer = Trainer(cfg, plan, str(out), OmegaConf.structured(cfg), d)
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
            pipeline.forward_only(
                dict(trainer.stages), lay.n_stages, lay.schedule, d.mesh["pp"], x, x, keep
            )
    if logits and d.dp_rank == 0 and d.local_rank_of("tp") == 0:
        torch.save(logits[0], out / "logits.pt")
    distributed.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
