"""A chat set of real text for the tests' jobs, byte-level: each conversation a paragraph of the
embedded corpus as its prompt (mask 0) and the next one as its answer (mask 1), ended by EOS,
written as `launcher.prepare --chat` writes one (NAME.bin, NAME.mask, the header's loss_mask and
chat fields; tests/test_chat.py holds prepare's own to transformers). Conversations are of
unequal lengths, a few longer than a window of the tests' seq_len (cut to it: --long
truncate), so windows, micro-batches and ranks hold different numbers of trained tokens.
Written once per content under the system's temp directory at import (blend_data.made_once);
`CHAT` are the overrides that train on it."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
from blend_data import HEADER, made_once

from launcher.data.batches import EMBEDDED, ByteTokenizer, write_tokens

VERSION = "prompt + answer paragraphs of random lengths, truncate"
CONVERSATIONS = 600


def conversations() -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) of each conversation: a paragraph asked, the next answered, EOS."""
    with gzip.open(EMBEDDED) as f:
        paragraphs = [p.strip() for p in f.read().split(b"\n\n") if p.strip()]
    out, rng = [], np.random.default_rng(0)
    for prompt, answer in zip(paragraphs[0::2], paragraphs[1::2], strict=False):
        cut = 150 if len(out) % 50 == 7 else int(rng.integers(4, 60))  # every 50th too long
        a = np.frombuffer(prompt[: int(rng.integers(2, 40))], np.uint8).astype(np.uint32)
        b = np.frombuffer(answer[:cut], np.uint8).astype(np.uint32)
        ids = np.concatenate([a, b, [ByteTokenizer.eos_id]]).astype(np.uint32)
        mask = np.concatenate([np.zeros(a.size), np.ones(b.size), [0]]).astype(np.uint8)
        out.append((ids, mask))
        if len(out) == CONVERSATIONS:
            break
    return out


def write(base: Path, pairs: list[tuple[np.ndarray, np.ndarray]], long: str = "truncate") -> dict:
    """A chat set at base (NAME.bin, NAME.json, NAME.mask) of these conversations."""
    mask = np.concatenate([m for _, m in pairs])
    mask_file = base.with_name(base.name + ".mask")

    def finish() -> dict:
        mask.tofile(mask_file)
        return {
            "loss_mask": {"file": mask_file.name, "trained_tokens": int(mask.sum())},
            "chat": {"template": None, "template_sha256": None, "conversations": len(pairs),
                     "longest": max(i.size for i, _ in pairs), "max_tokens": None, "long": long,
                     "truncated": 0, "dropped": 0},
        }  # fmt: skip

    return write_tokens(str(base), [np.concatenate([i for i, _ in pairs])], HEADER, ["corpus"],
                        finish)  # fmt: skip


ROOT = made_once("chat", VERSION, lambda d: write(d / "chat", conversations()))
CHAT = (f"data.path={ROOT}/chat.bin",)
