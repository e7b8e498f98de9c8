"""Where a run's tokens come from: one token file (`data.path`, or the embedded corpus), or a
weighted blend of sources (`data.sources`: each a token file, a directory of token files or a
glob, the shards of one corpus), and the named validation sets (`data.val_sources`).

A source's shards are one stream, in the order of their names; its tail `data.val_fraction` is
held out for the default eval loss, as for a single file. The blend decides which source each
sequence of the run comes from by stride scheduling over a period of PERIOD sequences: every
source has an integer share of the period (its weight, rounded by largest remainder, at least
1), and sequence i goes to the source whose next turn, (taken + 1) / share, comes first. So each
source's share holds to within one sequence in every window, not only on average (Megatron's
blend picks the source furthest behind its share to the same end), and where sequence i comes
from is a function of i alone: the same for every layout, read in O(1) at any position.

Pure numpy: the planner reads headers and sizes through this module without torch.
"""

from __future__ import annotations

import functools
import glob
import heapq
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launcher.data.batches import (
    LONG_RULES,
    ByteTokenizer,
    LongConversation,
    Packed,
    Packing,
    Split,
    conversation_ends,
    data_sizes,
    embedded_n_tokens,
    load_mask_stream,
    load_stream,
    pack,
    read_header,
    split,
    split_sizes,
    token_file_base,
)

PERIOD = 10_000  # sequences in one turn of the blend; weights are rounded to 1 / PERIOD


@dataclass(frozen=True)
class Source:
    """One source of a blend: what the user wrote, its normalised weight, and its shards."""

    label: str  # how messages name it: data.sources[i].path=... or data.path=...
    weight: float
    files: tuple[str, ...]  # token files (NAME.bin), in order; () for the embedded corpus
    n_tokens: int
    vocab_size: int
    eos_id: int
    tokenizer: str  # what the sources must agree on: "bytes" or the tokenizer's sha256
    # A chat set (launcher.prepare --chat): the rule its prepare applied to a conversation too
    # long (batches.LONG_RULES), which packing applies to one longer than a window; None: not.
    long: str | None = None

    @property
    def chat(self) -> bool:
        return self.long is not None


def token_files(path: str) -> list[str]:
    """The token files a source names: a token file (NAME.bin or NAME.json), every token file in
    a directory, or every one a glob matches, sorted by name. ValueError when there is none."""
    p = Path(path)
    if any(c in path for c in "*?["):
        found = sorted(glob.glob(path))
        if not found:
            raise ValueError("matches no file")
    elif p.is_dir():
        found = sorted(str(x) for x in p.iterdir() if x.suffix in (".bin", ".json"))
        if not found:
            raise ValueError("is a directory without token files (NAME.bin + NAME.json)")
    elif p.with_suffix(".json").exists() or p.exists():
        return [f"{token_file_base(path)}.bin"]  # NAME, NAME.bin or NAME.json, as data.path
    else:
        raise ValueError("does not exist")
    bins = sorted(
        {str(Path(f).with_suffix(".bin")) for f in found if Path(f).suffix in (".bin", ".json")}
    )
    if not bins:
        raise ValueError("names no token file (NAME.bin + NAME.json from launcher.prepare)")
    return bins


def token_file_paths(data) -> list[str]:
    """Every token file a DataConfig reads, training and validation (the plan has checked
    that each can be read)."""
    given = [s.path for s in data.sources] or ([data.path] if data.path else [])
    return [f for path in [*given, *data.val_sources.values()] for f in token_files(path)]


def first_token_file(data: dict) -> str | None:
    """The token file whose header stands for a run's tokenizer, from its resolved data config
    as a checkpoint's meta.json records it: data.path, else the first file of the first
    source (the sources agree on it); None for the embedded corpus or when none is there."""
    if data.get("path"):
        return data["path"]
    for source in data.get("sources") or []:
        try:
            return token_files(source["path"])[0]
        except (ValueError, KeyError, TypeError):
            return None
    return None


def _tokenizer_of(header: dict) -> str:
    if header.get("tokenizer") == "huggingface":
        return f"tokenizer sha256 {str(header.get('tokenizer_sha256'))[:12]}"
    return "byte-level"


def read_source(label: str, path: str | None, weight: float) -> Source:
    """A source from its path (None: the embedded corpus). ValueError names what is wrong."""
    if path is None:
        tok = ByteTokenizer
        return Source(
            label, weight, (), embedded_n_tokens(), tok.vocab_size, tok.eos_id, "byte-level"
        )
    files = token_files(path)
    n_tokens, described, long = 0, None, None
    for f in files:
        try:
            n, _ = data_sizes(f)
            header = read_header(f)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{f} is not a readable token file ({e})") from e
        this = (header["vocab_size"], header["eos_id"], _tokenizer_of(header))
        if described is not None and this != described:
            raise ValueError(
                f"its shards disagree: {files[0]} has {_agree(described)}, {f} has {_agree(this)}"
            )
        rule = long_rule(f, header)
        if described is not None and (rule is None) != (long is None):
            chat, plain = (f, files[0]) if long is None else (files[0], f)
            raise ValueError(
                f"its shards disagree: {chat} is a chat set (launcher.prepare --chat), {plain} "
                "is not; a source is one or the other (a blend may mix them)"
            )
        if described is not None and rule != long:
            raise ValueError(
                f"its shards disagree: {files[0]} was prepared with --long {long}, {f} with "
                f"--long {rule}; a source's conversations follow one rule"
            )
        described, long = this, rule
        n_tokens += n
    if n_tokens == 0:
        raise ValueError("holds no tokens")
    return Source(label, weight, tuple(files), n_tokens, *described, long)


def is_chat_set(path: str | None) -> bool:
    """Whether data.path names a readable chat set (launcher.prepare --chat)."""
    try:
        return path is not None and "loss_mask" in read_header(token_files(path)[0])
    except (OSError, ValueError, KeyError):
        return False


def long_rule(path: str, header: dict) -> str | None:
    """A chat set's rule for a conversation too long (None: not a chat set)."""
    if "loss_mask" not in header:
        return None
    chat = header.get("chat")
    rule = chat.get("long") if isinstance(chat, dict) else None
    if rule not in LONG_RULES:
        raise ValueError(f"{path}: chat.long={rule!r} must be one of {', '.join(LONG_RULES)}")
    return rule


def packing(s: Source, seq_len: int) -> Packing:
    """How a chat source's conversations fill the windows of train.seq_len (batches.pack);
    LongConversation names one too long under the refuse rule. Cached: the planner asks once
    per layout it prices."""
    stats = tuple((f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in s.files)
    return _packing(stats, s.eos_id, seq_len + 1, s.long)


@functools.lru_cache(maxsize=16)
def _packing(stats: tuple, eos_id: int, width: int, long: str) -> Packing:
    files = tuple(f for f, _, _ in stats)
    ends = conversation_ends(load_stream(files), eos_id)
    return pack(ends, load_mask_stream(files), width, long)


def chat_split(s: Source, seq_len: int, val_fraction: float | None) -> tuple[Packed, Packed | None]:
    """A chat source's windows of whole conversations: (train, held-out tail) by windows, at
    least one each; val_fraction None: all of them, for a named validation set."""
    tokens, mask = load_stream(s.files), load_mask_stream(s.files)
    bounds = packing(s, seq_len).bounds
    whole = lambda b: Packed(tokens, mask, b, seq_len, s.eos_id)  # noqa: E731
    if val_fraction is None:
        return whole(bounds), None
    n_train, _ = chat_split_sizes(len(bounds), val_fraction)
    return whole(bounds[:n_train]), whole(bounds[n_train:])


def chat_split_sizes(windows: int, val_fraction: float) -> tuple[int, int]:
    """(train, held-out) windows of a chat source: its tail val_fraction of windows, at least
    one each side; ValueError when there are too few."""
    n_val = max(int(windows * val_fraction), 1)
    if windows - n_val < 1:
        raise ValueError(
            f"its conversations fill {windows:,} window(s) of train.seq_len: training and "
            f"validation (data.val_fraction={val_fraction}) each need at least one"
        )
    return windows - n_val, n_val


def _agree(what: tuple) -> str:
    vocab, eos, tokenizer = what
    return f"vocabulary {vocab:,}, eos id {eos}, {tokenizer}"


def run_sources(data) -> tuple[list[Source], list[str]]:
    """The training sources of a DataConfig (weights normalised) and the problems found: a
    missing path, no token files, a weight <= 0, sources that disagree on the tokenizer."""
    problems: list[str] = []
    if data.path is not None and data.sources:
        return [], ["data.path and data.sources are both set: data.path is the one-source shortcut"]
    given = [
        (f"data.sources[{i}].path={s.path}", s.path, s.weight) for i, s in enumerate(data.sources)
    ]
    if not given:
        label = "the embedded corpus" if data.path is None else f"data.path={data.path}"
        given = [(label, data.path, 1.0)]
    for label, _, weight in given:
        if not weight > 0 or weight != weight or weight == float("inf"):
            problems.append(f"{label}: weight={weight} must be a finite number > 0")
    sources = []
    for label, path, weight in given:
        try:
            sources.append(read_source(label, path, weight))
        except ValueError as e:
            problems.append(f"{label} {e}")
    if problems:
        return [], problems
    # Scaled by the largest first: finite weights whose sum overflows (1e308 twice) still blend.
    largest = max((s.weight for s in sources), default=1.0)
    total = sum(s.weight / largest for s in sources)
    sources = [Source(**{**vars(s), "weight": s.weight / largest / total}) for s in sources]
    problems += disagreements(sources)
    return sources, problems


def validation_sources(data, train: list[Source]) -> tuple[list[Source], list[str]]:
    """The named validation sets (label = their name), and the problems found, including a
    tokenizer that is not the training sources'."""
    out, problems = [], []
    for name, path in data.val_sources.items():
        try:
            out.append(read_source(name, path, 1.0))
        except ValueError as e:
            problems.append(f"data.val_sources.{name}={path} {e}")
    if not problems:
        problems += disagreements([*train[:1], *out], what="data.val_sources")
    return out, problems


def disagreements(sources: list[Source], what: str = "sources") -> list[str]:
    """Sources must share one vocabulary, EOS id and tokenizer: each one that does not is named
    beside the first."""
    first = sources[0]
    key = lambda s: (s.vocab_size, s.eos_id, s.tokenizer)
    return [
        f"{s.label} ({_agree(key(s))}) does not match {first.label} ({_agree(key(first))}): "
        f"{what} must be prepared with one tokenizer"
        for s in sources[1:]
        if key(s) != key(first)
    ]


class Blend:
    """Which source sequence i of the run comes from, and the how-many-th of that source's it
    is (see the module docstring)."""

    def __init__(self, weights: list[float], period: int = PERIOD):
        self.shares = shares(weights, period)
        self.period = period
        turns = [(1.0 / share, s) for s, share in enumerate(self.shares)]
        heapq.heapify(turns)
        taken = [0] * len(self.shares)
        self.source = np.empty(period, dtype=np.int64)
        self.rank = np.empty(period, dtype=np.int64)
        for i in range(period):
            _, s = heapq.heappop(turns)
            self.source[i], self.rank[i] = s, taken[s]
            taken[s] += 1
            heapq.heappush(turns, ((taken[s] + 1) / self.shares[s], s))

    def locate(self, i: int) -> tuple[int, int]:
        """(source, its k-th sequence) for sequence i of the endless stream."""
        turn, at = divmod(i, self.period)
        s = int(self.source[at])
        return s, turn * int(self.shares[s]) + int(self.rank[at])


def shares(weights: list[float], period: int = PERIOD) -> list[int]:
    """Integer shares of `period` in proportion to the weights (largest remainder), each >= 1."""
    largest = max(weights)
    total = sum(w / largest for w in weights)
    exact = [w / largest / total * period for w in weights]
    out = [max(1, int(x)) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda s: (out[s] - exact[s], s))
    i = 0
    while sum(out) < period:
        out[by_remainder[i % len(out)]] += 1
        i += 1
    while sum(out) > period:  # only when a tiny weight was raised to 1
        s = max(range(len(out)), key=lambda s: (out[s] - exact[s], -s))
        out[s] -= 1
    return out


REPEATS_WARNED = 4  # epochs of a source past which repeating it stops helping much


@dataclass(frozen=True)
class Use:
    """How much of one training source a run reads."""

    label: str
    files: int
    n_tokens: int
    weight: float
    epochs: float  # of its training part, over train.steps global batches
    # A chat set's conversations in their windows: conversations, windows, truncated, dropped,
    # trained_tokens (Packing's counts); None for other sources.
    chat: dict | None = None


def data_use(cfg) -> list[Use]:
    """Each training source's tokens, weight and epochs over the run ([] when they cannot be
    read: the rules say why)."""

    sources, problems = run_sources(cfg.data)
    if problems:
        return []
    t = cfg.train
    out = []
    for s in sources:
        packed = None
        try:
            if s.chat:
                packed = packing(s, t.seq_len)
                windows, _ = chat_split_sizes(len(packed.bounds), cfg.data.val_fraction)
            else:
                n_train, _ = split_sizes(s.n_tokens, t.seq_len, cfg.data.val_fraction)
                windows = (n_train - 1) // t.seq_len
        except ValueError:
            return []
        epochs = t.steps * t.global_batch_size * s.weight / windows
        chat = None
        if packed is not None:
            chat = {"conversations": packed.conversations, "windows": len(packed.bounds),
                    "truncated": packed.truncated, "dropped": packed.dropped,
                    "trained_tokens": packed.trained_tokens}  # fmt: skip
        out.append(Use(s.label, len(s.files), s.n_tokens, s.weight, epochs, chat))
    return out


def chat_problems(sources: list[Source], seq_len: int, val_fraction: float | None) -> list[str]:
    """Chat sources whose conversations do not fill their windows: one longer than a window
    under the refuse rule, or too few windows to split (val_fraction None: a named validation
    set, which needs one)."""
    out = []
    for s in sources:
        if not s.chat:
            continue
        try:
            windows = len(packing(s, seq_len).bounds)
            if val_fraction is not None:
                chat_split_sizes(windows, val_fraction)
            elif not windows:
                raise ValueError("holds no conversation that fits a window of train.seq_len")
        except LongConversation as e:
            out.append(
                f"{s.label}: {e}; raise train.seq_len, or prepare it again with --max-tokens "
                f"{seq_len + 1} and --long truncate or drop"
            )
        except ValueError as e:
            out.append(f"{s.label}: {e}")
    return out


def repeat_warnings(uses: list[Use]) -> list[str]:
    return [
        f"{u.label} is read {u.epochs:.1f} times over the run: past about {REPEATS_WARNED} "
        "epochs, repeated tokens stop helping much (Muennighoff et al. 2023); add data or "
        "lower its weight"
        for u in uses
        if u.epochs > REPEATS_WARNED
    ]


@dataclass
class RunData:
    """What a run trains and evaluates on: the training sources' windows (their held-out tails
    beside them), the blend of several, and the named validation sets."""

    train: list  # data.Split per training source
    held_out: list  # data.Split per training source: its tail
    blend: Blend | None  # None for a single source
    named: dict  # name -> data.Split (or Packed) of a whole validation set
    eos_id: int
    masked: bool = False  # a chat set among the training sources: the loss takes its mask


def run_data(data, seq_len: int) -> RunData:
    """The run's data from its DataConfig (the plan has refused what cannot be read)."""

    sources, problems = run_sources(data)
    vals, more = validation_sources(data, sources)
    if problems or more:
        raise ValueError("; ".join(problems + more))
    parts = [
        chat_split(s, seq_len, data.val_fraction)
        if s.chat
        else split(load_stream(s.files), seq_len, data.val_fraction)
        for s in sources
    ]
    blend = Blend([s.weight for s in sources]) if len(sources) > 1 else None
    named = {
        v.label: chat_split(v, seq_len, None)[0] if v.chat else Split(load_stream(v.files), seq_len)
        for v in vals
    }
    masked = any(s.chat for s in sources)
    return RunData(
        [p[0] for p in parts], [p[1] for p in parts], blend, named, sources[0].eos_id, masked
    )


def document_attention(cfg) -> bool:
    """Whether a run masks attention at document ends: data.attention=document, or auto (the
    default) with a chat set among the training sources (each conversation its own document)."""
    mode = cfg.data.attention.value
    if mode != "auto":
        return mode == "document"
    sources, problems = run_sources(cfg.data)
    return not problems and any(s.chat for s in sources)
