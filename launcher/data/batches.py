"""Tokens in, batches out: byte-level tokenizer, memory-mapped token files, layout-free batching.

Token file format (written by `python -m launcher.prepare`):
- `NAME.bin`: the token ids of all documents back to back, little-endian, dtype uint16 when
  the vocabulary fits in 16 bits, else uint32; each document ends with the EOS id.
- `NAME.json`: {"format": "llm-launcher-tokens", "version": 2, "dtype": "uint16",
  "n_tokens": int, "vocab_size": int, "eos_id": int, "eos_token": str | null,
  "tokenizer": "bytes" | "huggingface", "tokenizer_path": str | null,
  "tokenizer_sha256": str | null, "sources": [...]}. Version 1 (still read) lacks the
  eos_token and tokenizer_* fields. The header is written after the .bin is complete.
- A chat set (`launcher.prepare --chat`, launcher/data/chat.py) has `NAME.mask` beside them,
  one uint8 a token (1: the loss is taken on it), named by the header's "loss_mask" ({"file",
  "trained_tokens"}) with a "chat" field (the template, the conversations' counts).

Batching: the stream is cut into non-overlapping windows of seq_len + 1 tokens (inputs and
shifted targets); a chat set's into windows of whole conversations instead (`pack`: as many as
fit, in order, the rest of the window EOS padding), whose targets are IGNORE where the mask is 0.
Each epoch visits the windows in a seeded permutation; global batch k is
windows k*G .. (k+1)*G - 1 of that sequence. Data-parallel rank r of D takes the r-th contiguous
slice of G/D windows and splits it into micro-batches, so the global batches are identical for
every layout and the loss of one step does not depend on how it was split.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launcher.runtime.scratch import staged

FORMAT = "llm-launcher-tokens"
IGNORE = -100  # a target the loss skips (F.cross_entropy's ignore_index): masked or padding
LONG_RULES = ("refuse", "truncate", "drop")  # a conversation longer than its window (prepare)
VERSIONS = (1, 2)  # header versions read; write_tokens writes the last
EMBEDDED = Path(__file__).parent / "python_docs.txt.gz"


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


@functools.cache
def embedded_n_tokens() -> int:
    """Tokens in the embedded corpus (its bytes and one EOS), for the planner: read once per
    process (the file ships with the package; the search plans thousands of layouts)."""
    with gzip.open(EMBEDDED, "rb") as f:
        return len(f.read()) + 1


TOKEN_DTYPES = ("uint16", "uint32")  # what write_tokens writes, and all a header may say


def read_header(path: str) -> dict:
    """A token file's header, its fields checked (a ValueError names the wrong one): the .bin
    is read as the dtype it names, so nothing but the two prepare writes is accepted."""
    header_path = Path(path).with_suffix(".json")
    with open(header_path) as f:
        header = json.load(f)
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{header_path} is not an {FORMAT} header")
    if header.get("version") not in VERSIONS:
        raise ValueError(
            f"{header_path} has version {header.get('version')}; this launcher reads "
            f"versions {', '.join(map(str, VERSIONS))}"
        )
    for key, low in (("n_tokens", 0), ("vocab_size", 1), ("eos_id", 0)):
        v = header.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{header_path}: {key}={v!r} must be an integer >= {low}")
    dtype = header.get("dtype")
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"{header_path}: dtype={dtype!r} must be one of {', '.join(TOKEN_DTYPES)}")
    if header["eos_id"] >= header["vocab_size"]:
        raise ValueError(
            f"{header_path}: eos_id={header['eos_id']} is outside vocab_size={header['vocab_size']}"
        )
    if header["vocab_size"] > np.iinfo(dtype).max + 1:
        raise ValueError(
            f"{header_path}: vocab_size={header['vocab_size']:,} does not fit in dtype={dtype}"
        )
    return header


def id_problem(path: str, chunk: int = 1 << 26) -> str | None:
    """Where the token file holds an id outside its header's vocabulary (an embedding lookup
    would crash a rank mid-run), or None; reads the whole .bin, a chunk at a time."""
    tokens, vocab = load_tokens(path)
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start : start + chunk])
        if part.size and int(part.max()) >= vocab:
            at = start + int(np.argmax(part >= vocab))
            return (
                f"token file {path} holds token id {int(tokens[at])} at position {at:,}, outside "
                f"its header's vocab_size={vocab:,}: the file is damaged or its header is not "
                "its own; prepare it again"
            )
    return None


def load_tokens(path: str | None) -> tuple[np.ndarray, int]:
    """(tokens, vocabulary size) of a token file, memory-mapped, or of the embedded corpus."""
    if path is None:
        return embedded_tokens(), ByteTokenizer.vocab_size
    header = read_header(path)
    tokens = np.memmap(
        Path(path).with_suffix(".bin"), dtype=header["dtype"], mode="r", shape=(header["n_tokens"],)
    )
    return tokens, header["vocab_size"]


def data_sizes(path: str | None) -> tuple[int, int]:
    """(n_tokens, vocabulary size) of a token file or the embedded corpus, without reading the
    tokens; ValueError when the .bin does not hold the n_tokens its header promises."""
    if path is None:
        return embedded_n_tokens(), ByteTokenizer.vocab_size
    header = read_header(path)
    bin_path = Path(path).with_suffix(".bin")
    expected = header["n_tokens"] * np.dtype(header["dtype"]).itemsize
    found = bin_path.stat().st_size
    if found != expected:
        raise ValueError(
            f"{bin_path} has {found:,} bytes but its header promises n_tokens="
            f"{header['n_tokens']:,} of {header['dtype']} ({expected:,} bytes)"
        )
    if mask := mask_path(path, header):
        found = mask.stat().st_size if mask.is_file() else None
        if found != header["n_tokens"]:
            held = "is missing" if found is None else f"has {found:,} bytes"
            raise ValueError(
                f"its loss mask {mask} {held}, but the tokens beside it are "
                f"{header['n_tokens']:,}: the mask does not match its tokens (prepare it again)"
            )
    return header["n_tokens"], header["vocab_size"]


def mask_path(path: str, header: dict) -> Path | None:
    """A chat set's loss mask (launcher.prepare --chat: one uint8 a token, 1 where the loss is
    taken), beside its .bin; None for a token file without one."""
    mask = header.get("loss_mask")
    if mask is None:
        return None
    if not isinstance(mask, dict) or not isinstance(mask.get("file"), str) or "/" in mask["file"]:
        raise ValueError(f"loss_mask={mask!r} must name a file beside the header")
    return Path(path).with_suffix(".json").with_name(mask["file"])


def token_file_base(path: str) -> Path:
    """DIR/NAME for `--out DIR/NAME`, DIR/NAME.bin or DIR/NAME.json (a dot inside NAME stays)."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".bin", ".json") else p


def write_tokens(
    path: str,
    chunks: Iterable[np.ndarray],
    tokenizer: dict,
    sources: list[str],
    finish: Callable[[], dict] | None = None,
) -> dict:
    """Stream chunks of token ids (EOS already in place) into NAME.bin, then write NAME.json.

    `tokenizer` holds the header's vocab_size, eos_id, eos_token, tokenizer, tokenizer_path and
    tokenizer_sha256. The ids go to a partial file beside NAME.bin first (removed however the
    write ends, a SIGKILL included: runtime/scratch.py): a failed or interrupted write leaves
    any earlier NAME.bin and NAME.json as they were, and NAME.json never describes a .bin it
    was not written for. `finish()`, called once NAME.bin is in place and before NAME.json is
    written, puts what goes beside it in place (a chat set's loss mask) and returns the
    header's fields of it. Returns the header.
    """
    vocab_size = tokenizer["vocab_size"]
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    base = token_file_base(path)
    bin_path, header_path = (base.with_name(base.name + s) for s in (".bin", ".json"))
    os.makedirs(base.parent, exist_ok=True)
    n_tokens = 0
    with staged(bin_path) as partial:
        with open(partial, "wb") as f:
            for ids in chunks:
                if ids.size and int(ids.max()) >= vocab_size:
                    raise ValueError(
                        f"token id {int(ids.max())} is outside the vocabulary of {vocab_size}"
                    )
                ids.astype(np.dtype(dtype).newbyteorder("<")).tofile(f)
                n_tokens += ids.size
        header_path.unlink(missing_ok=True)
        os.replace(partial, bin_path)
    header = {
        "format": FORMAT,
        "version": VERSIONS[-1],
        "dtype": dtype,
        "n_tokens": n_tokens,
        **tokenizer,
        "sources": sources,
        **(finish() if finish else {}),
    }
    header_path.write_text(json.dumps(header, indent=2) + "\n")
    return header


class Concat:
    """Token files read as one stream (a source's shards), memory-mapped; a slice is a Concat
    too, and np.asarray reads it."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = [p for p in parts if len(p)]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, where: slice) -> Concat:
        start, stop, _ = where.indices(len(self))
        out = []
        for part, first in zip(self.parts, self.starts[:-1], strict=True):
            lo, hi = max(start - first, 0), min(stop - first, len(part))
            if lo < hi:
                out.append(part[lo:hi])
        return Concat(out)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=np.int64)
        return out if dtype is None else out.astype(dtype)


def load_mask_stream(files: tuple[str, ...]) -> np.ndarray | Concat:
    """A chat set's loss masks (one uint8 a token) as one stream, memory-mapped."""
    masks = []
    for f in files:
        path = mask_path(f, read_header(f))
        masks.append(np.memmap(path, dtype=np.uint8, mode="r", shape=(path.stat().st_size,)))
    return masks[0] if len(masks) == 1 else Concat(masks)


def load_stream(files: tuple[str, ...]) -> np.ndarray | Concat:
    """A source's tokens: its token files as one stream, or the embedded corpus for ()."""
    if not files:
        return embedded_tokens()
    if len(files) == 1:
        return load_tokens(files[0])[0]
    return Concat([load_tokens(f)[0] for f in files])


@dataclass
class Split:
    """Windows of seq_len + 1 tokens over one contiguous part of the stream."""

    tokens: np.ndarray | Concat
    seq_len: int

    @property
    def n_windows(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def window(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def mask_window(self, i: int) -> None:
        return None  # the loss is taken on every token


@dataclass
class Packed:
    """Windows of whole conversations (a chat set, see `pack`): window i holds the stream's
    tokens bounds[i, 0] .. bounds[i, 1] - 1, the rest of its seq_len + 1 tokens EOS padding
    whose mask is 0."""

    tokens: np.ndarray | Concat
    mask: np.ndarray | Concat
    bounds: np.ndarray  # (n_windows, 2) int64
    seq_len: int
    eos_id: int

    @property
    def n_windows(self) -> int:
        return len(self.bounds)

    def window(self, i: int) -> np.ndarray:
        a, b = (int(x) for x in self.bounds[i])
        out = np.full(self.seq_len + 1, self.eos_id, dtype=np.int64)
        out[: b - a] = np.asarray(self.tokens[a:b])
        return out

    def mask_window(self, i: int) -> np.ndarray:
        a, b = (int(x) for x in self.bounds[i])
        out = np.zeros(self.seq_len + 1, dtype=np.uint8)
        out[: b - a] = np.asarray(self.mask[a:b])
        return out


@dataclass(frozen=True)
class Packing:
    """How a chat set's conversations fill windows of seq_len + 1 tokens."""

    bounds: np.ndarray  # (windows, 2): each window's first token and the one past its last
    conversations: int  # those trained on, whole or cut
    truncated: int  # cut to one window (prepare's --long truncate)
    dropped: int  # left out (--long drop)
    trained_tokens: int  # mask 1 inside the windows


class LongConversation(ValueError):
    """A conversation longer than a window under the refuse rule."""


def conversation_ends(tokens: np.ndarray | Concat, eos_id: int, chunk: int = 1 << 24) -> np.ndarray:
    """The position after each conversation's EOS (a chat set holds EOS only there), read a
    chunk at a time."""
    out = []
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start : start + chunk])
        out.append(np.flatnonzero(part == eos_id) + (start + 1))
    ends = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    if len(tokens) and (not ends.size or ends[-1] != len(tokens)):
        ends = np.append(ends, len(tokens))  # a last conversation without its EOS still counts
    return ends.astype(np.int64)


def pack(ends: np.ndarray, mask, width: int, long: str) -> Packing:
    """Conversations (each ends[k - 1] .. ends[k] - 1 of the stream) packed in order into
    windows of at most `width` tokens: a conversation starts a new window where it does not fit
    in the current one, so none is split between windows and its answers always see their
    prompt. One longer than a window follows the rule its set was prepared with (`long`):
    refused (LongConversation), cut to its first `width` tokens, or dropped."""
    bounds: list[tuple[int, int]] = []
    left_out: list[tuple[int, int]] = []  # what no window holds: dropped ones, cut tails
    packed = truncated = dropped = 0
    start = end = prev = 0  # the open window [start, end); end == start: none open
    lengths = np.diff(ends, prepend=0)
    for k in np.flatnonzero(lengths > width):  # the few long ones first: refuse before packing
        if long == "refuse":
            raise LongConversation(
                f"conversation {int(k) + 1:,} has {int(lengths[k]):,} tokens, more than a "
                f"window of train.seq_len + 1 = {width:,} (prepared with --long refuse)"
            )
    for e in ends.tolist():
        n = e - prev
        if n > width:
            if end > start:
                bounds.append((start, end))
            start = end = e
            if long == "truncate":
                bounds.append((prev, prev + width))
                left_out.append((prev + width, e))
                truncated += 1
                packed += 1
            else:
                left_out.append((prev, e))
                dropped += 1
        elif end - start + n <= width:
            end = e
            packed += 1
        else:
            if end > start:
                bounds.append((start, end))
            start, end = prev, e
            packed += 1
        prev = e
    if end > start:
        bounds.append((start, end))
    out = np.array(bounds, dtype=np.int64).reshape(-1, 2)
    trained = mask_sum(mask) - sum(mask_sum(mask[a:b]) for a, b in left_out)
    return Packing(out, packed, truncated, dropped, trained)


def mask_sum(mask, chunk: int = 1 << 24) -> int:
    """The 1s of a mask (or a slice of one), read a chunk at a time."""
    steps = range(0, len(mask), chunk)
    return int(sum(np.count_nonzero(np.asarray(mask[i : i + chunk])) for i in steps))


def split_sizes(n_tokens: int, seq_len: int, val_fraction: float) -> tuple[int, int]:
    """(train, validation) tokens of a stream of n_tokens: the tail val_fraction is held out,
    with at least one window of seq_len + 1 tokens on each side. Pure arithmetic, shared by
    `split` and the planner; a ValueError names the sizes and the fewest tokens that would do."""

    def sizes(n: int) -> tuple[int, int]:
        n_val = max(int(n * val_fraction), seq_len + 1)
        return n - n_val, n_val

    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1)")
    n_train, n_val = sizes(n_tokens)
    if n_train >= seq_len + 1:
        return n_train, n_val
    # The smallest n whose train part holds a window: near (seq_len + 1) / (1 - val_fraction),
    # at least 2 windows; n_train grows by 0 or 1 per token, so walk to it from the estimate.
    need = max(2 * (seq_len + 1), math.ceil((seq_len + 1) / (1 - val_fraction)))
    while need > 2 * (seq_len + 1) and sizes(need - 1)[0] >= seq_len + 1:
        need -= 1
    while sizes(need)[0] < seq_len + 1:
        need += 1
    raise ValueError(
        f"n_tokens={n_tokens:,} is too few for train.seq_len={seq_len} with "
        f"data.val_fraction={val_fraction}: training and validation each need a window of "
        f"seq_len + 1 = {seq_len + 1} tokens, so at least {need:,} tokens"
    )


def split(tokens: np.ndarray, seq_len: int, val_fraction: float) -> tuple[Split, Split]:
    """Train on the head of the stream, hold out the tail."""
    n_train, _ = split_sizes(len(tokens), seq_len, val_fraction)
    return Split(tokens[:n_train], seq_len), Split(tokens[n_train:], seq_len)


class Batches:
    """Micro-batches of one data-parallel rank for global batch k (see the module docstring).

    `data` is one Split, or the Splits of a blend's sources with the Blend that says which
    source each sequence comes from (launcher.data.sources); each source then has epochs and
    permutations of its own."""

    def __init__(
        self,
        data: Split | list[Split],
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
        blend=None,
    ):
        self.splits = data if isinstance(data, list) else [data]
        self.blend = blend
        self.g, self.micro = global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self._orders: dict[tuple[int, int], np.ndarray] = {}
        # A chat set among the splits: targets are IGNORE where its mask is 0 (the loss is
        # then a sum over the rest, divided by the global batch's count of them: trainer).
        self.masked = any(isinstance(s, Packed) for s in self.splits)

    def window(self, i: int) -> np.ndarray:
        """The window at position i of the endless stream (of the blend, or of the one split)."""
        data, pos = self.locate(i)
        return data.window(pos)

    def targets(self, i: int, window: np.ndarray) -> np.ndarray:
        """The targets of the window at position i: its tokens after the first, IGNORE where
        a chat set's mask is 0."""
        data, pos = self.locate(i)
        mask = data.mask_window(pos)
        return window[1:] if mask is None else np.where(mask[1:] == 1, window[1:], IGNORE)

    def locate(self, i: int) -> tuple[Split | Packed, int]:
        """The split and the window of it at position i of the endless stream."""
        s, k = self.blend.locate(i) if self.blend is not None else (0, i)
        data = self.splits[s]
        epoch, pos = divmod(k, data.n_windows)
        if self.shuffle:
            if (s, epoch) not in self._orders:
                # One source keeps the seeds it always had, so a run's order is unchanged.
                seed = [self.seed, epoch] if self.blend is None else [self.seed, s, epoch]
                self._orders = {
                    **{key: v for key, v in self._orders.items() if key[0] != s},
                    (s, epoch): np.random.default_rng(seed).permutation(data.n_windows),
                }
            pos = int(self._orders[(s, epoch)][pos])
        return data, pos

    def trained_tokens(self, position: int) -> int:
        """The targets the loss is taken on in the whole global batch whose first window is at
        `position` (with a chat set: those its masks keep), the same on every rank."""
        total = 0
        for i in range(position, position + self.g):
            data, pos = self.locate(i)
            mask = data.mask_window(pos)
            total += data.seq_len if mask is None else int(np.count_nonzero(mask[1:]))
        return total

    def micro_batches(self, k: int) -> list:
        """[(inputs (b, S), targets (b, S))] for this rank's share of global batch k."""
        return self.at(k * self.g)

    def at(self, position: int) -> list:
        """This rank's micro-batches of the global batch whose first window is at `position`
        of the endless stream (the data position a checkpoint records)."""
        import torch  # late: the planner reads headers through this module without torch

        per_rank = self.g // self.dp_size
        first = position + self.dp_rank * per_rank
        windows = np.stack([self.window(first + j) for j in range(per_rank)])
        if self.masked:
            targets = np.stack([self.targets(first + j, w) for j, w in enumerate(windows)])
        else:
            targets = windows[:, 1:]
        out = []
        for start in range(0, per_rank, self.micro):
            x = torch.from_numpy(windows[start : start + self.micro, :-1])
            out.append((x, torch.from_numpy(targets[start : start + self.micro])))
        return out
