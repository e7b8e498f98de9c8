"""Tokens in, batches out: byte-level tokenizer, memory-mapped token files, layout-free batching.

Token file format (written by `python -m launcher.prepare`):
- `NAME.bin`: the token ids of all documents back to back, little-endian, dtype uint16 when
  the vocabulary fits in 16 bits, else uint32; each document ends with the EOS id.
- `NAME.json`: {"format": "llm-launcher-tokens", "version": 1, "dtype": "uint16",
  "n_tokens": int, "vocab_size": int, "tokenizer": "bytes", "eos_id": int, "sources": [...]}.

Batching: the stream is cut into non-overlapping windows of seq_len + 1 tokens (inputs and
shifted targets). Each epoch visits the windows in a seeded permutation; global batch k is
windows k*G .. (k+1)*G - 1 of that sequence. Data-parallel rank r of D takes the r-th contiguous
slice of G/D windows and splits it into micro-batches, so the global batches are identical for
every layout and the loss of one step does not depend on how it was split.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "llm-launcher-tokens"
EMBEDDED = Path(__file__).parent / "data" / "python_docs.txt.gz"


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; 256 ends a document."""

    vocab_size = 257
    eos_id = 256
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def embedded_tokens() -> np.ndarray:
    """The embedded default corpus: Python's reference documentation, about 465k bytes."""
    with gzip.open(EMBEDDED, "rb") as f:
        raw = f.read()
    return np.append(np.frombuffer(raw, dtype=np.uint8).astype(np.uint16), ByteTokenizer.eos_id)


def read_header(path: str) -> dict:
    header_path = Path(path).with_suffix(".json")
    with open(header_path) as f:
        header = json.load(f)
    if header.get("format") != FORMAT:
        raise ValueError(f"{header_path} is not an {FORMAT} header")
    return header


def load_tokens(path: str | None) -> tuple[np.ndarray, int]:
    """(tokens, vocabulary size) of a token file, memory-mapped, or of the embedded corpus."""
    if path is None:
        return embedded_tokens(), ByteTokenizer.vocab_size
    header = read_header(path)
    tokens = np.memmap(
        Path(path).with_suffix(".bin"), dtype=header["dtype"], mode="r", shape=(header["n_tokens"],)
    )
    return tokens, header["vocab_size"]


def data_vocab_size(path: str | None) -> int:
    """The vocabulary a model needs for this data, without reading the tokens."""
    return ByteTokenizer.vocab_size if path is None else read_header(path)["vocab_size"]


def write_tokens(
    path: str,
    documents: list[list[int]],
    vocab_size: int,
    eos_id: int,
    tokenizer: str,
    sources: list[str],
) -> dict:
    """Write NAME.bin and NAME.json; returns the header."""
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    ids = np.fromiter((t for doc in documents for t in [*doc, eos_id]), dtype=dtype)
    base = Path(path).with_suffix("")
    os.makedirs(base.parent, exist_ok=True)
    ids.tofile(base.with_suffix(".bin"))
    header = {
        "format": FORMAT,
        "version": 1,
        "dtype": dtype,
        "n_tokens": int(ids.size),
        "vocab_size": vocab_size,
        "tokenizer": tokenizer,
        "eos_id": eos_id,
        "sources": sources,
    }
    base.with_suffix(".json").write_text(json.dumps(header, indent=2) + "\n")
    return header


@dataclass
class Split:
    """Windows of seq_len + 1 tokens over one contiguous part of the stream."""

    tokens: np.ndarray
    seq_len: int

    @property
    def n_windows(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def window(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)


def split(tokens: np.ndarray, seq_len: int, val_fraction: float) -> tuple[Split, Split]:
    """Train on the head of the stream, hold out the tail."""
    n_val = max(int(len(tokens) * val_fraction), seq_len + 1)
    if len(tokens) - n_val < seq_len + 1:
        raise ValueError(f"{len(tokens)} tokens are too few for seq_len={seq_len}")
    return Split(tokens[:-n_val], seq_len), Split(tokens[-n_val:], seq_len)


class Batches:
    """Micro-batches of one data-parallel rank for global batch k (see the module docstring)."""

    def __init__(
        self,
        data: Split,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
    ):
        self.data, self.g, self.micro = data, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self._epoch, self._order = -1, np.arange(0)

    def _window_index(self, i: int) -> int:
        """Window at position i of the endless stream of epochs."""
        n = self.data.n_windows
        epoch, pos = divmod(i, n)
        if not self.shuffle:
            return pos
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._order = epoch, rng.permutation(n)
        return int(self._order[pos])

    def micro_batches(self, k: int) -> list:
        """[(inputs (b, S), targets (b, S))] for this rank's share of global batch k."""
        return self.at(k * self.g)

    def at(self, position: int) -> list:
        """This rank's micro-batches of the global batch whose first window is at `position`
        of the endless stream (the data position a checkpoint records)."""
        import torch  # late: the planner reads headers through this module without torch

        per_rank = self.g // self.dp_size
        first = position + self.dp_rank * per_rank
        windows = np.stack(
            [self.data.window(self._window_index(first + j)) for j in range(per_rank)]
        )
        out = []
        for start in range(0, per_rank, self.micro):
            w = torch.from_numpy(windows[start : start + self.micro])
            out.append((w[:, :-1], w[:, 1:]))
        return out
