"""`python -m launcher.bench.measured DIR [DIR...]`: the one-device benchmarks kept in DIR
(`python -m launcher.bench.gpu --json` files, docs/measured/) as one Markdown table: each
contender's tokens/s, MFU and peak allocated memory as measured, and beside the engine the
planner's figures for the same layout as it predicts them now (tokens/s with its error against
the measured, memory without the CUDA reserve). docs/speed.md shows its files this way, so a
planner change that moves a prediction shows in the docs' check."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launcher.bench.gpu import GPU_1B, WORKLOADS
from launcher.cli import compose, fail
from launcher.plan import make_plan

COLUMNS = (
    "run",
    "workload",
    "contender",
    "tokens/s",
    "MFU",
    "peak GiB",
    "planner tokens/s",
    "error",
    "planner GiB",
)


def results(directory: Path) -> list[tuple[str, dict]]:
    """(file stem, result) of every benchmark file in `directory`, by name."""
    out = []
    for path in sorted(directory.glob("*.json")):
        result = json.loads(path.read_text())
        if isinstance(result, dict) and "contenders" in result:
            out.append((f"{directory.name}/{path.stem}", result))
    return out


def planned(result: dict) -> tuple[float, float]:
    """The planner's tokens/s per device and memory (GiB, reserve left out) for the layout
    the engine ran, as it predicts them now."""
    cfg = compose(["hardware.devices_per_node=1", "hardware.nodes=1", *result["overrides"]])
    plan = make_plan(cfg)
    memory = plan.memory.total - plan.context.reserve
    return plan.estimate.tokens_per_s_per_device, memory / 2**30


def rows(name: str, r: dict) -> list[list[str]]:
    setting = "compiled" if r["compile"] else "eager"
    layers = f" ({r['n_layers']} layers)" if "n_layers" in r else ""  # older files lack it
    # The settings the run changed from its workload's (older files name none: the default's).
    base = WORKLOADS.get(r.get("workload"), GPU_1B)
    changed = [o for o in r["overrides"] if o not in base and not o.startswith("hardware=")]
    changed = [o for o in changed if o != "train.compile=false" and "seq_len=" not in o]
    workload = ", ".join([f"{r['model']}{layers}", f"seq {r['seq_len']}", setting, *changed])
    out = []
    for contender, f in r["contenders"].items():
        if "tokens_per_s" not in f:
            continue  # a peer skipped or failed: its reason is in the file
        row = [
            name,
            workload,
            contender,
            f"{f['tokens_per_s']:,.0f}",
            f"{f['mfu']:.1%}",
            f"{f['peak_allocated_gib']:.2f}" if "peak_allocated_gib" in f else "-",
        ]
        if contender == "engine":
            speed, memory = planned(r)
            row += [f"{speed:,.0f}", f"{speed / f['tokens_per_s'] - 1:+.0%}", f"{memory:.2f}"]
        else:
            row += ["", "", ""]
        out.append(row)
        name = workload = ""
    return out


def generate(argv: list[str]) -> str:
    """The table (launcher.docs calls this in its own process)."""
    p = argparse.ArgumentParser(prog="python -m launcher.bench.measured", description=__doc__)
    p.add_argument("dirs", nargs="+", type=Path, help="directories of benchmark JSON files")
    args = p.parse_args(argv)
    found = []
    for d in args.dirs:
        if not d.is_dir():
            fail(f"{d}: no such directory")
        found += results(d)
    if not found:
        fail(f"no benchmark files (launcher.bench.gpu --json) in {', '.join(map(str, args.dirs))}")
    lines = ["| " + " | ".join(COLUMNS) + " |", "| --- | --- | --- |" + " ---: |" * 6]
    for name, r in found:
        lines += ["| " + " | ".join(row) + " |" for row in rows(name, r)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    print(generate(argv), end="")


if __name__ == "__main__":
    main()
