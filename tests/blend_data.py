"""A three-source blend of real documents for the tests' jobs: the embedded corpus's
paragraphs (byte-level, one document each, EOS between them) dealt into three sources, the
second as a directory of two shards. Written once per content under the system's temp
directory at import, so that jobs started later by tests/group.py find it; `BLEND` are the
overrides that train on it with document masking."""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from launcher.data.batches import EMBEDDED, ByteTokenizer, write_tokens

HEADER = {
    "vocab_size": ByteTokenizer.vocab_size,
    "eos_id": ByteTokenizer.eos_id,
    "eos_token": None,
    "tokenizer": "bytes",
    "tokenizer_path": None,
    "tokenizer_sha256": None,
}
VERSION = "3 sources, code in 2 shards"  # in the directory's name: a change makes a new one


def _documents() -> list[list[bytes]]:
    """The corpus's paragraphs dealt round-robin into three sources."""
    with gzip.open(EMBEDDED) as f:
        paragraphs = [p for p in f.read().split(b"\n\n") if p.strip()]
    return [paragraphs[i::3] for i in range(3)]


def _tokens(docs: list[bytes]) -> np.ndarray:
    eos = np.array([ByteTokenizer.eos_id], dtype=np.uint32)
    return np.concatenate(
        [np.append(np.frombuffer(d, np.uint8).astype(np.uint32), eos) for d in docs]
    )


def made_once(kind: str, version: str, write) -> Path:
    """The directory of test data of a kind (made by write(directory) if missing, under the
    system's temp directory, named by the corpus and the version; a concurrent maker renames
    into place)."""
    key = hashlib.sha256(EMBEDDED.read_bytes() + version.encode()).hexdigest()
    root = Path(tempfile.gettempdir()) / f"llm-launcher-{kind}-{key[:12]}"
    if root.exists():
        return root
    staging = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    write(staging)
    try:
        os.rename(staging, root)
    except OSError:  # another process made it first
        shutil.rmtree(staging)
    return root


def _write(staging: Path) -> None:
    sources = _documents()
    code = sources[1]
    parts = {"web.bin": sources[0], "code/part1.bin": code[: len(code) // 2],
             "code/part2.bin": code[len(code) // 2 :], "books.bin": sources[2]}  # fmt: skip
    for name, docs in parts.items():
        write_tokens(str(staging / name.removesuffix(".bin")), [_tokens(docs)], HEADER, ["corpus"])


ROOT = made_once("blend", VERSION, _write)
BLEND = (
    f"data.sources=[{{path: {ROOT}/web.bin, weight: 0.6}}, {{path: {ROOT}/code, weight: 0.3}},"
    f" {{path: {ROOT}/books.bin, weight: 0.1}}]",
    "data.attention=document",
)
