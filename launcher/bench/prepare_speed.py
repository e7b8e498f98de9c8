"""`make bench`'s prepare table: `launcher.prepare --workers W` against the tokenizers library's
own batch encoding of the same documents on W threads.

The corpus: the embedded corpus's paragraphs, repeated to about 16 MB, as 8 JSON-lines files;
the tokenizer: a 4,096-token byte-level BPE trained on the corpus. The library's figure is
`encode_batch` over every document's text, already read and parsed, with RAYON_NUM_THREADS=W
(its thread pool); prepare's is the whole command: reading, parsing the JSON, encoding, writing
the token file. Each runs in a fresh process, turns rotated, and a contender's figure is its
fastest of `rounds` (noise on a shared machine only adds time). Goal: prepare's throughput at
least 0.8x the library's.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launcher.data.batches import EMBEDDED

FILES, TARGET_BYTES = 8, 16 << 20

# Run in a fresh interpreter: the library's batch encoding of every document of the files.
LIBRARY = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(l)["text"] for f in sys.argv[2:] for l in open(f, encoding="utf-8")]
start = time.perf_counter()
tok.encode_batch(texts)
print(time.perf_counter() - start)
"""


def embedded_paragraphs() -> list[str]:
    """The embedded corpus's paragraphs (its documents' stand-ins for tokenizers and tests)."""
    with gzip.open(EMBEDDED) as f:
        return [p for p in f.read().decode("utf-8").split("\n\n") if p.strip()]


def byte_level_bpe(texts: list[str], vocab_size: int, special_tokens: list[str]):
    """A byte-level BPE tokenizer (tokenizers') trained on texts: what Llama 3's and GPT-2's
    tokenizer.json are, at a size trained in seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def corpus(root: Path) -> tuple[Path, list[Path], int]:
    """(tokenizer.json, the JSON-lines files, their bytes) under root."""
    paragraphs = embedded_paragraphs()
    tok = byte_level_bpe(paragraphs, 4096, ["<|end_of_text|>"])
    tokenizer = root / "tokenizer.json"
    tok.save(str(tokenizer))
    lines = [json.dumps({"text": p}) + "\n" for p in paragraphs]
    size = sum(len(line.encode()) for line in lines)
    copies = max(1, TARGET_BYTES // size)
    files = [root / f"part{i}.jsonl" for i in range(FILES)]
    for path in files:
        path.write_text("".join(lines * max(1, copies // FILES)), encoding="utf-8")
    return tokenizer, files, sum(p.stat().st_size for p in files)


def library_seconds(tokenizer: Path, files: list[Path], workers: int) -> float:
    env = {**os.environ, "RAYON_NUM_THREADS": str(workers), "TOKENIZERS_PARALLELISM": "true"}
    out = subprocess.run(
        [sys.executable, "-c", LIBRARY, str(tokenizer), *map(str, files)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip())


def prepare_seconds(tokenizer: Path, files: list[Path], workers: int, out: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "launcher.prepare", "--tokenizer", str(tokenizer), "--eos",
         "<|end_of_text|>", "--workers", str(workers), "--out", str(out), *map(str, files)],
        capture_output=True,
        check=True,
    )  # fmt: skip
    return time.perf_counter() - start


def prepare_throughput(workers: int = 2, rounds: int = 3, progress=print) -> dict:
    """Seconds (fastest of `rounds`) of each, bytes of input, and the ratio of throughputs."""
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        root = Path(tmp)
        progress("prepare: a corpus and a tokenizer")
        tokenizer, files, n_bytes = corpus(root)
        times: dict[str, list[float]] = {"library": [], "prepare": []}
        for r in range(rounds):
            order = ["library", "prepare"] if r % 2 == 0 else ["prepare", "library"]
            for name in order:
                progress(f"prepare: round {r + 1} of {rounds}, {name}")
                if name == "library":
                    times[name].append(library_seconds(tokenizer, files, workers))
                else:
                    times[name].append(prepare_seconds(tokenizer, files, workers, root / "out"))
    best = {k: min(v) for k, v in times.items()}
    return {
        "workers": workers,
        "bytes": n_bytes,
        "seconds": best,
        "ratio": best["library"] / best["prepare"],
    }
