"""`python -m launcher.prepare --out DIR/NAME [--tokenizer tokenizer.json] FILE...`: build a
token file from text and JSON-lines files.

Inputs, in the order given (a progress bar runs over their bytes):
  NAME.jsonl    one document per line, its text under --text-field (default: text); blank
                lines are skipped; a line that is not a JSON object holding that string field
                stops prepare with FILE:LINE
  NAME.parquet  one document per row, its text in the --text-field column (read with pyarrow,
                a row group at a time)
  any other     UTF-8 text, the whole file one document
  --workers N tokenizes N input files at a time, each in a process of its own; the output is
  the same, in the order given.

Tokenizer:
  (default)     byte-level: UTF-8 bytes are ids 0-255, 256 ends a document (vocabulary 257)
  --tokenizer   a Hugging Face tokenizer.json, the file Llama 3, Mixtral and DeepSeek ship; its
                own special tokens are kept (Llama 3 starts each document with <|begin_of_text|>,
                Mixtral with <s>); truncation and padding saved in the file are switched off
  EOS ends every document. Its token: --eos TOKEN, else the eos_token of the
  tokenizer_config.json beside tokenizer.json, else the first of <|end_of_text|>,
  <|endoftext|>, </s>, <｜end▁of▁sentence｜>, <eos> in the vocabulary.

Output:
  DIR/NAME.bin  the token ids, uint16 when the vocabulary fits in 16 bits, else uint32
  DIR/NAME.json its header: n_tokens, dtype, vocab_size, eos_id, eos_token, the tokenizer's
                path and sha256, the sources; written once the .bin is complete
  --shard-tokens N writes the directory DIR/NAME/ instead, of shards NAME-00000.bin (+ .json),
  ... of at most N tokens each, cut between documents (a longer document is a shard of its own):
  `data.sources=[{path: DIR/NAME, weight: W}]` reads them as one stream.

Chat (--chat, for fine-tuning; launcher/data/chat.py):
  each JSON-lines record (or Parquet row) is a conversation: "messages", a list of
  {"role": "system" | "user" | "assistant", "content": ...}, or a "prompt" and a
  "completion". It is rendered with the chat template beside --tokenizer (chat_template.jinja,
  or tokenizer_config.json's chat_template) and tokenized; DIR/NAME.mask beside the tokens holds
  1 on each assistant turn's tokens (its end-of-turn included), 0 elsewhere, where the loss is
  taken. --max-tokens N with --long refuse (default) | truncate | drop: a conversation longer
  than N tokens stops prepare naming it, is cut to its first N, or is left out; the summary
  counts them.

Example:
  python -m launcher.prepare --tokenizer llama3/tokenizer.json --out data/web \\
      web-00.jsonl web-01.jsonl notes.txt
  python -m launcher.train data.path=data/web.bin model=llama3_8b

model.vocab_size must be at least the vocabulary size (the plan refuses a smaller one).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from tokenizers import Tokenizer

from launcher.data import chat
from launcher.data.batches import LONG_RULES, ByteTokenizer, token_file_base, write_tokens
from launcher.runtime.rundir import write_failure
from launcher.runtime.scratch import (
    clear_leftovers,
    command,
    output_problem,
    staged,
    uninterrupted,
)

# End-of-document tokens of well-known tokenizers: Llama 3, GPT-2 / Qwen, Llama 2 / Mistral /
# Mixtral, DeepSeek V2 / V3, Gemma. The first one in the vocabulary is the EOS.
END_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<｜end▁of▁sentence｜>", "<eos>")
CHUNK_CHARS = 1 << 22  # characters per encode_batch call: bounds the ids held as Python lists


class InputError(Exception):
    """A mistake in the command or its inputs: one line on stderr, exit 2."""


@dataclass
class Encoder:
    """What prepare needs of a tokenizer: batch encoding and its fields of the header."""

    encode_batch: Callable[[list[str]], list[np.ndarray]]
    header: dict  # vocab_size, eos_id, eos_token, tokenizer, tokenizer_path, tokenizer_sha256


def byte_encoder() -> Encoder:
    encode = lambda texts: [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    return Encoder(
        encode,
        {
            "vocab_size": ByteTokenizer.vocab_size,
            "eos_id": ByteTokenizer.eos_id,
            "eos_token": None,
            "tokenizer": ByteTokenizer.name,
            "tokenizer_path": None,
            "tokenizer_sha256": None,
        },
    )


def hf_encoder(path: Path, eos: str | None) -> tuple[Encoder, str]:
    """A Hugging Face tokenizer.json, and where its EOS came from."""
    if not path.is_file():
        raise InputError(f"--tokenizer {path}: not a file")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise InputError(f"--tokenizer {path} is not a tokenizer.json: {e}") from None
    # Documents are tokenized whole: a max_length saved for fine-tuning must not cut them.
    tok.no_truncation()
    tok.no_padding()
    eos, source = eos_token(tok, path, eos)
    encode = lambda texts: [np.array(e.ids, dtype=np.uint32) for e in tok.encode_batch(texts)]
    # The vocabulary a model needs: every id below it. That is get_vocab_size(with_added_tokens=
    # True), unless the ids have a gap (which that count does not see).
    vocab = tok.get_vocab(with_added_tokens=True)
    header = {
        "vocab_size": max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1),
        "eos_id": tok.token_to_id(eos),
        "eos_token": eos,
        "tokenizer": "huggingface",
        "tokenizer_path": str(path.resolve()),
        "tokenizer_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    return Encoder(encode, header), source


def eos_token(tok, path: Path, eos: str | None) -> tuple[str, str]:
    """(EOS token, where it came from): --eos, tokenizer_config.json, then END_TOKENS."""
    source = "--eos"
    if eos is None:
        eos, source = config_eos(path.parent / "tokenizer_config.json"), "tokenizer_config.json"
    if eos is None:
        eos = next((t for t in END_TOKENS if tok.token_to_id(t) is not None), None)
        source = "a well-known end token"
    if eos is None:
        raise InputError(
            f"cannot tell the EOS token of {path}: no eos_token in a tokenizer_config.json "
            f"beside it and none of {' '.join(END_TOKENS)} in its vocabulary; pass --eos TOKEN"
        )
    if tok.token_to_id(eos) is None:
        raise InputError(f"EOS token {eos!r} (from {source}) is not in the vocabulary of {path}")
    return eos, source


def config_eos(path: Path) -> str | None:
    """The eos_token of a tokenizer_config.json: a string or {"content": ...}; None if absent."""
    if not path.is_file():
        return None
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
    except (ValueError, AttributeError) as e:
        raise InputError(f"{path} is not a JSON object: {e}") from None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def documents(
    files: list[Path], text_field: str, read: Callable[[int, int], None]
) -> Iterator[str]:
    """The text of every document, file after file; read(bytes, documents) reports progress."""
    for path in files:
        yield from file_documents(path, text_field, read)


def file_documents(path: Path, text_field: str, read: Callable[[int, int], None]) -> Iterator[str]:
    """The text of every document of one input file (see the module docstring)."""
    if path.suffix == ".parquet":
        yield from parquet_documents(path, text_field, read)
        return
    if path.suffix != ".jsonl":
        raw = path.read_bytes()
        read(len(raw), 1)
        yield text_of(raw, str(path))
        return
    found = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            blank = not line.strip()
            read(len(line), 0 if blank else 1)
            if not blank:
                found += 1
                yield jsonl_text(line, text_field, f"{path}:{lineno}")
    if not found:
        raise InputError(f"{path} holds no JSON-lines records: nothing to tokenize")


def open_parquet(path: Path):
    """An input Parquet file, refused by name when it is not one or holds no rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path} is not a Parquet file ({str(e)[:200]})") from None
    if f.metadata.num_rows == 0:
        raise InputError(f"{path} holds no rows: nothing to tokenize")
    return f


def parquet_documents(path: Path, text_field: str, read) -> Iterator[str]:
    """The --text-field column of a Parquet file, a row group at a time; a row that is not a
    string (a null) is refused naming it."""
    import pyarrow as pa

    f = open_parquet(path)
    names = f.schema_arrow.names
    if text_field not in names:
        raise InputError(
            f"{path}: no column {text_field!r} (columns: {', '.join(names[:8])}); see --text-field"
        )
    if not pa.types.is_string(
        f.schema_arrow.field(text_field).type
    ) and not pa.types.is_large_string(f.schema_arrow.field(text_field).type):
        kind = f.schema_arrow.field(text_field).type
        raise InputError(f"{path}: column {text_field!r} is {kind}, not a string")
    row = 0
    share = path.stat().st_size / max(f.metadata.num_row_groups, 1)
    for group in range(f.metadata.num_row_groups):
        texts = f.read_row_group(group, columns=[text_field]).column(0).to_pylist()
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InputError(f"{path}: row {row + i:,} of column {text_field!r} is null")
        read(int(share), len(texts))
        row += len(texts)
        yield from texts


def text_of(raw: bytes, where: str) -> str:
    """The UTF-8 text of an input file: refused when it is empty, or binary (a NUL byte, or
    bytes that are not UTF-8), which would tokenize into noise."""
    if not raw.strip():
        raise InputError(f"{where} is empty: nothing to tokenize")
    nul = raw.find(b"\0", 0, 1 << 20)
    if nul >= 0:
        raise InputError(f"{where} is binary (a NUL byte at offset {nul:,}), not text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{where} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start:,}); "
            "prepare reads UTF-8 text and JSON lines"
        ) from None


def jsonl_text(line: bytes, text_field: str, where: str) -> str:
    """The text of one JSON-lines record; `where` (FILE:LINE) names it in an error."""
    try:
        record = json.loads(text_of(line.rstrip(b"\r\n"), where))
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.pos + 1})") from None
    if not isinstance(record, dict):
        raise InputError(f"{where}: a JSON {type(record).__name__}, not an object")
    if text_field not in record:
        fields = ", ".join(list(record)[:8]) or "none"
        raise InputError(f"{where}: no field {text_field!r} (fields: {fields}); see --text-field")
    text = record[text_field]
    if not isinstance(text, str):
        raise InputError(f"{where}: field {text_field!r} is not a string ({type(text).__name__})")
    return text


def token_chunks(texts: Iterable[str], tok: Encoder) -> Iterator[np.ndarray]:
    """The ids of the documents, each ended by EOS, a batch of about CHUNK_CHARS at a time."""
    eos = np.array([tok.header["eos_id"]], dtype=np.uint32)
    batch, chars = [], 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= CHUNK_CHARS:
            yield with_eos(tok.encode_batch(batch), eos)
            batch, chars = [], 0
    if batch:
        yield with_eos(tok.encode_batch(batch), eos)


def with_eos(docs: list[np.ndarray], eos: np.ndarray) -> np.ndarray:
    """Documents back to back, each ended by EOS (not twice when its post-processor added it)."""
    parts = []
    for ids in docs:
        parts.append(ids)
        if not (ids.size and ids[-1] == eos[0]):
            parts.append(eos)
    return np.concatenate(parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "files", nargs="+", type=Path, help="text files (one document each) and .jsonl files"
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR/NAME", help="DIR/NAME: writes DIR/NAME.bin and .json"
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="a Hugging Face tokenizer.json (default: byte-level)",
    )
    parser.add_argument(
        "--eos", metavar="TOKEN", help="the token that ends each document (with --tokenizer)"
    )
    parser.add_argument(
        "--text-field",
        default="text",
        metavar="FIELD",
        help="the JSON-lines field or Parquet column holding the text (text)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="input files tokenized at a time, each in a process of its own (1)",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="conversations, rendered with --tokenizer's chat template, and a loss mask",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="with --chat: the most tokens a conversation may have (see --long)",
    )
    parser.add_argument(
        "--long",
        choices=LONG_RULES,
        default="refuse",
        help="with --chat: a conversation over --max-tokens stops prepare (refuse), is cut to "
        "its first N tokens (truncate) or left out (drop)",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        metavar="N",
        help="write DIR/NAME/ of shards of at most N tokens, cut between documents",
    )
    return parser.parse_args(argv)


def prepare(args: argparse.Namespace) -> str:
    """Write the token file (or shards); returns the line that reports it."""
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        raise InputError(f"not a file: {', '.join(missing)}")
    parquet = [str(f) for f in args.files if f.suffix == ".parquet"]
    if parquet and importlib.util.find_spec("pyarrow") is None:
        raise InputError(
            f"{parquet[0]}: reading Parquet needs pyarrow, which is not installed: "
            "pip install 'llm-launcher[parquet]' (or pyarrow)"
        )
    if args.workers < 1:
        raise InputError(f"--workers {args.workers} must be at least 1")
    if args.shard_tokens is not None and args.shard_tokens < 1:
        raise InputError(f"--shard-tokens {args.shard_tokens} must be at least 1")
    if args.chat:
        return prepare_chat(args)
    if args.max_tokens is not None:
        raise InputError("--max-tokens applies to --chat: a document is never cut")
    if args.tokenizer is None:
        if args.eos is not None:
            raise InputError("--eos needs --tokenizer: the byte-level tokenizer's EOS is id 256")
        tok, eos = byte_encoder(), f"eos id {ByteTokenizer.eos_id}"
    else:
        tok, source = hf_encoder(args.tokenizer, args.eos)
        eos = f"eos {tok.header['eos_token']} (id {tok.header['eos_id']}, from {source})"
    columns = (TextColumn("tokenizing {task.fields[docs]:,} documents"), BarColumn())
    columns += (DownloadColumn(), TimeRemainingColumn())
    console = Console(stderr=True)
    progress = Progress(*columns, console=console, transient=True, disable=not console.is_terminal)
    n_docs = 0

    def read(n_bytes: int, docs: int) -> None:
        nonlocal n_docs
        n_docs += docs
        progress.update(task, advance=n_bytes, docs=n_docs)

    sources = [str(f) for f in args.files]
    base = token_file_base(args.out)
    restore_replaced(base)
    if problem := out_problem(base, args.shard_tokens is not None):
        raise InputError(problem)
    for out in (base, ids_of(base), base.with_name(base.name + ".bin")):
        clear_leftovers(out)  # of a prepare SIGKILLed with its guard
    with progress:
        task = progress.add_task("", total=sum(f.stat().st_size for f in args.files), docs=0)
        if args.workers > 1 and len(args.files) > 1:
            chunks = parallel_chunks(args, read, base)
        else:
            chunks = token_chunks(documents(args.files, args.text_field, read), tok)
        if args.shard_tokens is None:
            header = write_tokens(args.out, chunks, tok.header, sources)
            where = f"{base}.bin"
        else:
            header, shards = write_shards(base, chunks, tok.header, sources, args.shard_tokens)
            where = f"{base}/ in {shards} shard(s) of at most {args.shard_tokens:,} tokens"
    base.with_name(base.name + ".mask").unlink(missing_ok=True)  # an earlier chat set's
    return (
        f"wrote {header['n_tokens']:,} tokens from {n_docs:,} document(s) to {where} "
        f"({header['dtype']}, vocabulary {header['vocab_size']:,}, {eos})"
    )


def records(files: list[Path], read) -> Iterator[tuple[object, str]]:
    """Each conversation record of the inputs, with where it is (FILE:LINE, FILE: row N)."""
    for path in files:
        if path.suffix == ".parquet":
            yield from parquet_records(path, read)
            continue
        if path.suffix != ".jsonl":
            raise InputError(f"{path}: --chat reads conversations from .jsonl or .parquet files")
        found = 0
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                blank = not line.strip()
                read(len(line), 0 if blank else 1)
                if blank:
                    continue
                found += 1
                where = f"{path}:{lineno}"
                try:
                    yield json.loads(text_of(line.rstrip(b"\r\n"), where)), where
                except json.JSONDecodeError as e:
                    raise InputError(
                        f"{where}: not valid JSON ({e.msg} at column {e.pos + 1})"
                    ) from None
        if not found:
            raise InputError(f"{path} holds no JSON-lines records: nothing to tokenize")


def parquet_records(path: Path, read) -> Iterator[tuple[object, str]]:
    """Each row of a Parquet file as a record (its columns: messages, or prompt and completion)."""
    f = open_parquet(path)
    row, share = 0, path.stat().st_size / max(f.metadata.num_row_groups, 1)
    for group in range(f.metadata.num_row_groups):
        rows = f.read_row_group(group).to_pylist()
        read(int(share), len(rows))
        for i, record in enumerate(rows):
            yield record, f"{path}: row {row + i:,}"
        row += len(rows)


def prepare_chat(args: argparse.Namespace) -> str:
    """--chat: the conversations' tokens, NAME.mask beside them, and the header's account."""
    if args.tokenizer is None:
        raise InputError(
            "--chat needs --tokenizer: a Hugging Face tokenizer.json with its chat template "
            "beside it (the byte-level tokenizer has none)"
        )
    if args.workers != 1 or args.shard_tokens is not None:
        given = "--workers" if args.workers != 1 else "--shard-tokens"
        raise InputError(f"{given} with --chat: a chat set is prepared in one process, whole")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise InputError(f"--max-tokens {args.max_tokens} must be at least 2")
    hf = Tokenizer.from_file(str(args.tokenizer))
    hf.no_truncation()
    hf.no_padding()
    # Conversations are documents: they end with an end-of-text token, not the end of a turn
    # (a chat model's tokenizer_config.json names that its eos_token, <|eot_id|>, <|im_end|>).
    end = args.eos or next((t for t in END_TOKENS if hf.token_to_id(t) is not None), None)
    tok, source = hf_encoder(args.tokenizer, end)
    source = "--eos" if args.eos else "a well-known end token" if end else source
    try:
        template = chat.template_of(args.tokenizer)
    except chat.ChatError as e:
        raise InputError(str(e)) from None
    base = token_file_base(args.out)
    if problem := out_problem(base, False) or output_problem(
        base.with_name(base.name + ".mask"), "--out"
    ):
        raise InputError(problem)
    counts, mask_out = chat.Counts(), base.with_name(base.name + ".mask")
    console = Console(stderr=True)
    columns = (TextColumn("preparing {task.fields[docs]:,} conversations"), BarColumn())
    progress = Progress(*columns, DownloadColumn(), console=console, transient=True,
                        disable=not console.is_terminal)  # fmt: skip

    def read(n_bytes: int, docs: int) -> None:
        progress.update(task, advance=n_bytes, docs=counts.conversations)

    base.parent.mkdir(parents=True, exist_ok=True)
    with progress, staged(mask_out) as partial, open(partial, "wb") as masks:
        task = progress.add_task("", total=sum(f.stat().st_size for f in args.files), docs=0)

        def chunks() -> Iterator[np.ndarray]:
            eos = tok.header["eos_id"]
            convs = chat.conversations(
                template, hf, records(args.files, read), eos, args.max_tokens, args.long, counts
            )
            try:
                for ids, mask in convs:
                    mask.tofile(masks)
                    yield ids
            except chat.ChatError as e:
                raise InputError(str(e)) from None

        def finish() -> dict:
            masks.close()
            os.replace(partial, mask_out)
            return {
                "loss_mask": {"file": mask_out.name, "trained_tokens": counts.trained_tokens},
                "chat": {
                    "template": str(template.source.resolve()),
                    "template_sha256": hashlib.sha256(template.text.encode()).hexdigest(),
                    "conversations": counts.conversations,
                    "longest": counts.longest,
                    "max_tokens": args.max_tokens,
                    "long": args.long,
                    "truncated": counts.truncated,
                    "dropped": counts.dropped,
                },
            }

        header = write_tokens(args.out, chunks(), tok.header, [str(f) for f in args.files], finish)
    if not counts.conversations:
        raise InputError("no conversation is left to train on (every one was dropped)")
    left = [f"{n:,} {what}" for n, what in ((counts.truncated, "truncated"),
                                            (counts.dropped, "dropped")) if n]  # fmt: skip
    return (
        f"wrote {header['n_tokens']:,} tokens from {counts.conversations:,} conversation(s) "
        f"to {base}.bin, {counts.trained_tokens:,} of them trained on ({mask_out.name}); "
        f"longest {counts.longest:,} tokens{'; ' + ', '.join(left) if left else ''} "
        f"({header['dtype']}, vocabulary {header['vocab_size']:,}, eos "
        f"{tok.header['eos_token']} from {source}, template {template.source.name})"
    )


def out_problem(base: Path, sharded: bool) -> str | None:
    """Why --out cannot be written: a file where a directory goes, or (sharded) a directory
    of that name holding anything but an earlier prepare's shards, which it would replace."""
    if sharded:
        if base.exists() and not base.is_dir():
            return f"--out {base} is a file; the shards go in a directory of that name"
        others = sorted(
            p.name for p in (base.iterdir() if base.is_dir() else ())
            if not re.fullmatch(re.escape(base.name) + r"-\d{5}\.(bin|json)", p.name)
        )  # fmt: skip
        if others:
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            return (
                f"--out {base} is a directory holding files that are not its shards ({shown}): "
                "a prepare replaces the directory whole; choose another --out"
            )
        return output_problem(base / "x", "--out")
    return output_problem(base.with_name(base.name + ".bin"), "--out") or output_problem(
        base.with_name(base.name + ".json"), "--out"
    )


# -- several input files at a time ----------------------------------------------------------
_worker_encoder: list = []  # a worker process's encoder, made by its first file


def _tokenize_file(task: tuple) -> tuple[int, int]:
    """In a worker process: one input file's ids, each document ended by EOS, into `out` (raw
    little-endian uint32); (documents, bytes read)."""
    path, out, tokenizer, eos, text_field = task
    if not _worker_encoder:
        _worker_encoder.append(
            byte_encoder() if tokenizer is None else hf_encoder(tokenizer, eos)[0]
        )
    counts = [0, 0]

    def read(n_bytes: int, docs: int) -> None:
        counts[0] += docs
        counts[1] += n_bytes

    with open(out, "wb") as f:
        for ids in token_chunks(file_documents(path, text_field, read), _worker_encoder[0]):
            ids.astype("<u4").tofile(f)
    return counts[0], counts[1]


def _worker_start(parent: int) -> None:
    """In each worker: encode on one thread (--workers processes use --workers cores), and end
    with the command: a SIGKILLed prepare cannot stop its workers, which would go on under PID
    1 for as long as their files take, so each watches its parent, `parent` (given, not read:
    one killed while this worker was starting is gone already). A Ctrl-C reaches the whole
    process group: the prepare ends its workers, which say nothing of it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def ids_of(base: Path) -> Path:
    """The scratch directory of the workers' ids (staged: beside the output, hidden)."""
    return base.with_name(base.name + ".ids")


def parallel_chunks(args: argparse.Namespace, read, base: Path) -> Iterator[np.ndarray]:
    """The ids of every input file, in the order given, tokenized --workers files at a time
    in processes of their own (spawned: the tokenizers library's threads do not survive a
    fork); each file's ids wait in a scratch file beside the output until their turn."""
    import concurrent.futures as cf
    import multiprocessing as mp

    base.parent.mkdir(parents=True, exist_ok=True)
    pool = cf.ProcessPoolExecutor(
        args.workers,
        mp_context=mp.get_context("spawn"),
        initializer=_worker_start,
        initargs=(os.getpid(),),
    )
    with staged(ids_of(base)) as ids_dir:  # removed however it ends
        try:
            ids_dir.mkdir()
            with uninterrupted():  # submit spawns the workers: each starts whole
                futures = [
                    pool.submit(
                        _tokenize_file,
                        (f, ids_dir / f"{i:06d}.u32", args.tokenizer, args.eos, args.text_field),
                    )
                    for i, f in enumerate(args.files)
                ]
            for i, future in enumerate(futures):
                docs, n_bytes = future.result()
                read(n_bytes, docs)
                part = ids_dir / f"{i:06d}.u32"
                if part.stat().st_size:  # read back a slice at a time, never a whole file's ids
                    ids = np.memmap(part, dtype="<u4", mode="r")
                    yield from (ids[o : o + (1 << 24)] for o in range(0, len(ids), 1 << 24))
                    del ids
                part.unlink()
        except BaseException:  # a failure or a stop: the files the workers are on are not awaited
            for worker in list(pool._processes.values()):
                worker.terminate()
            raise
        finally:
            pool.shutdown(cancel_futures=True)
            shutil.rmtree(ids_dir, ignore_errors=True)


# -- shards ---------------------------------------------------------------------------------


def shard_bounds(ids: np.ndarray, eos_id: int, limit: int) -> list[tuple[int, int]]:
    """(start, end) of each shard: as many whole documents as fit in `limit` tokens, a longer
    document alone."""
    ends = np.concatenate(
        [
            np.flatnonzero(ids[o : o + (1 << 24)] == eos_id) + o + 1
            for o in range(0, len(ids), 1 << 24)
        ]
        or [np.zeros(0, dtype=np.int64)]
    )
    if not len(ends) or ends[-1] != len(ids):
        ends = np.append(ends, len(ids))
    bounds, start = [], 0
    while start < len(ids):
        i = int(np.searchsorted(ends, start + limit, side="right")) - 1
        end = (
            int(ends[i])
            if i >= 0 and ends[i] > start
            else int(ends[np.searchsorted(ends, start, side="right")])
        )
        bounds.append((start, end))
        start = end
    return bounds


def write_shards(
    base: Path, chunks: Iterable[np.ndarray], tokenizer: dict, sources: list[str], limit: int
) -> tuple[dict, int]:
    """DIR/NAME/NAME-00000.bin (+ .json), ...: the ids cut into shards between documents. All
    of them are written under a partial directory beside it first (runtime/scratch.py), which
    replaces DIR/NAME only when complete (the old one renamed aside first: a kill between the
    renames leaves it, put back by the next prepare). Returns the header of the whole and the
    number of shards."""
    with staged(base) as staging:
        staging.mkdir(parents=True)
        whole = write_tokens(str(staging / "whole"), chunks, tokenizer, sources)
        ids = np.memmap(staging / "whole.bin", dtype=whole["dtype"], mode="r")
        bounds = shard_bounds(ids, tokenizer["eos_id"], limit)
        for k, (a, b) in enumerate(bounds):
            write_tokens(str(staging / f"{base.name}-{k:05d}"), [ids[a:b]], tokenizer, sources)
        del ids
        for name in ("whole.bin", "whole.json"):
            (staging / name).unlink()
        replaced = replaced_of(base)
        if base.exists():
            base.rename(replaced)
        staging.rename(base)
        shutil.rmtree(replaced, ignore_errors=True)
    return whole, len(bounds)


def replaced_of(base: Path) -> Path:
    """Where a sharded output is renamed aside while its new one takes its name: hidden and
    named for prepare, never a directory of the user's."""
    return base.with_name(f".{base.name}.prepare-replaced")


def restore_replaced(base: Path) -> None:
    """A sharded output renamed aside by a prepare killed before its new one took the name:
    put back (or, the new one in place, removed)."""
    replaced = replaced_of(base)
    if not replaced.is_dir():
        return
    if base.exists():
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        replaced.rename(base)
        print(f"{base}: put back (a prepare replacing it was stopped)", file=sys.stderr)


@command("no token file was written, and nothing half-written is left")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(prepare(args))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a full or read-only disk: what was half-written is gone (scratch)
        why = write_failure(e, token_file_base(args.out).parent)
        if why is None:
            raise
        print(f"error: --out {args.out} was not written: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
