"""Run inside a process whose address space is capped (tests/checkpoint/test_stream_export.py):
`python limited_export.py CKPT OUT_PT OUT_HF HEADROOM_BYTES`.

Imports what the two commands use, caps RLIMIT_AS at what the process maps now plus the
headroom, then runs `checkpoint export` and `convert to-hf` in it. Prints one JSON line: their
exit codes, and whether loading the exported model whole (`torch.load`) fits under the same cap
(it must not: the cap is below the model's size, or the test proves nothing).
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import rich.progress  # noqa: F401  (imported before the cap, as the commands import it)
import safetensors.torch  # noqa: F401
import torch
import torch.distributed.checkpoint  # noqa: F401

import launcher.checkpoint.reader  # noqa: F401  (and what the commands import when they run)
import launcher.checkpoint.stream  # noqa: F401
import launcher.hf.weights  # noqa: F401
import launcher.parallel.data_parallel  # noqa: F401
from launcher.checkpoint.__main__ import main as checkpoint_main
from launcher.convert import main as convert_main


def mapped() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmSize")


def main() -> None:
    ckpt, out_pt, out_hf, headroom = sys.argv[1:5]
    cap = mapped() + int(headroom)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    exported = checkpoint_main(["export", ckpt, out_pt])
    converted = convert_main(["to-hf", ckpt, out_hf, "--max-shard-size", "20MB"])
    try:
        torch.load(out_pt, weights_only=True)
        whole = "loaded"
    except (MemoryError, RuntimeError):
        whole = "refused"
    print(json.dumps({"export": exported, "to_hf": converted, "whole": whole}))


if __name__ == "__main__":
    main()
