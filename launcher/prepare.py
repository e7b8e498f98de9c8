"""`python -m launcher.prepare --out DIR/NAME FILE...`: build a token file from text files.

Each input file is one document, tokenized with the byte-level tokenizer and ended with EOS.
Writes DIR/NAME.bin and DIR/NAME.json (format in launcher/data.py); train on it with
`python -m launcher.train data.path=DIR/NAME.bin`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.progress import track

from launcher.data import ByteTokenizer, write_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("files", nargs="+", type=Path, help="UTF-8 text files, one document each")
    parser.add_argument("--out", required=True, help="output path; .bin and .json are written")
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        print(f"error: not a file: {', '.join(missing)}", file=sys.stderr)
        return 2
    tok = ByteTokenizer()
    docs = [
        tok.encode(f.read_text(encoding="utf-8", errors="replace"))
        for f in track(args.files, description="tokenizing", transient=True)
    ]
    header = write_tokens(
        args.out, docs, tok.vocab_size, tok.eos_id, tok.name, [str(f) for f in args.files]
    )
    print(
        f"wrote {header['n_tokens']:,} tokens from {len(docs)} document(s) to "
        f"{Path(args.out).with_suffix('.bin')} ({header['dtype']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
