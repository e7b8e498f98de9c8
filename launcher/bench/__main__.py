"""`make bench`: the engine against a bare loop and transformers on CPU, then the planner.

- Engine overhead: this project's single-process training step (what `launcher.train` runs)
  against a plain loop over the same model class, micro-batches, AdamW and clipping. Goal:
  at most 1.03.
- Noise floor: a second, identical bare loop against the first. On this shared machine the
  same work lands a few percent apart run to run; the ratio says how far apart in this run, so
  a reader knows what the other ratios can resolve.
- transformers: LlamaForCausalLM of the same shape (random init, SDPA) in a plain loop at the
  same batch. Goal: the engine at least as fast (a ratio >= 1).
- Optimizers: optimizer=muon's step against AdamW's on the same model and layout, and the
  planner's figures for both (launcher/bench/optimizer_speed.py).
- Checkpoint integrity: a save with checksums against one without
  (launcher/bench/integrity_cost.py). Goal: at most 1.05.
- Prepare: `launcher.prepare --workers 2` against the tokenizers library's own batch encoding
  of the same documents on 2 threads (launcher/bench/prepare_speed.py). Goal: at least 0.8.
- Start: `make train` from a fresh clone (its set-up's time and size, seconds to the default
  run's first step, warm, and to a finished run's "nothing left to train";
  launcher/bench/fresh_start.py), then the time to first step and each rank's peak memory
  before it, for a ~1 GB (fp32) model on 1, 2, 4 and 8 processes (launcher/bench/start.py).
- The default run: `make train`'s run, cut to 40 steps, its measured tokens/s per device
  against the plan's figure and band (launcher/bench/default_run.py). Goal: inside the band.
- The planner: plans per second, the 405B search; and one CPU thread's fp32 matmul rate (the
  cpu preset's peak_tflops).

The three training steps take turns (launcher/bench/timing.py says why and how).
"""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

from launcher.bench import parser as bench_parser
from launcher.bench import refusing_bad_config
from launcher.bench.default_run import default_against_band
from launcher.bench.fresh_start import fresh_clones
from launcher.bench.integrity_cost import save_cost
from launcher.bench.optimizer_speed import ADAMW, MUON, muon_against_adamw
from launcher.bench.peers import bare, engine, hugging_face
from launcher.bench.planner import matmul_tflops, plans_per_second, search_405b
from launcher.bench.prepare_speed import prepare_throughput
from launcher.bench.start import start_by_ranks
from launcher.bench.timing import interleaved, least_disturbed
from launcher.bench.timing import threads as torch_threads

ENGINE, BARE, AGAIN, HF = "engine", "bare loop", "bare loop again", "transformers"
# A checkpoint of about 1.4 GiB (one layer of Llama 3.2 1B, a 16K vocabulary) for the save table.
LARGER = ["model=llama3_2_1b", "model.n_layers=1", "model.vocab_size=16384"]


def cpu_comparison(
    overrides: list[str], rounds: int, steps: int, warmup: int, threads: int, progress=print
) -> dict:
    """Seconds per step of the engine, the bare loop and transformers, taking turns."""
    with torch_threads(threads):
        step, w, plan = engine(overrides)
        contenders = {ENGINE: step, BARE: bare(w), AGAIN: bare(w), HF: hugging_face(w)}
        times = interleaved(contenders, rounds, steps, warmup, w.device, progress)
    best = {name: least_disturbed(t) for name, t in times.items()}
    return {
        "model": w.model["name"],
        "tokens_per_step": w.tokens,
        "micro_batches": len(w.micro),
        "threads": threads,
        "rounds": rounds,
        "steps_per_round": steps,
        "seconds_per_step": times,
        "best": best,
        "overhead": best[ENGINE] / best[BARE],
        "noise_floor": best[AGAIN] / best[BARE],
        "transformers_ratio": best[HF] / best[ENGINE],
    }


def comparison_tables(r: dict) -> tuple[Table, Table]:
    what = (
        f"{r['model']}, 1 process, {r['threads']} thread(s), {r['tokens_per_step']:,} tokens "
        f"in {r['micro_batches']} micro-batches per step"
    )
    ms = {name: t * 1e3 for name, t in r["best"].items()}
    summary = Table(title=f"training step on CPU: {what}", title_justify="left")
    summary.add_column("comparison")
    summary.add_column("ratio", justify="right")
    summary.add_column("goal")
    summary.add_column("ms per step", justify="right")
    summary.add_row(
        "engine / bare loop (engine overhead)",
        f"{r['overhead']:.3f}",
        "<= 1.03",
        f"{ms[ENGINE]:.1f} vs {ms[BARE]:.1f}",
    )
    summary.add_row(
        "bare loop again / bare loop (this run's noise)",
        f"{r['noise_floor']:.3f}",
        "1 (the same work)",
        f"{ms[AGAIN]:.1f} vs {ms[BARE]:.1f}",
    )
    summary.add_row(
        "transformers / engine",
        f"{r['transformers_ratio']:.3f}",
        ">= 1",
        f"{ms[HF]:.1f} vs {ms[ENGINE]:.1f}",
    )
    rounds = Table(
        title=(
            f"fastest step of each round, ms ({r['steps_per_round']} steps each; the contenders "
            "take turns, order rotated every round; a figure above is the fastest of all)"
        ),
        title_justify="left",
    )
    rounds.add_column("contender")
    for i in range(r["rounds"]):
        rounds.add_column(f"round {i + 1}", justify="right")
    for name, times in r["seconds_per_step"].items():
        rounds.add_row(name, *(f"{min(t) * 1e3:.1f}" for t in times))
    return summary, rounds


def planner_table(console: Console) -> Table:
    table = Table(title="planner", title_justify="left")
    table.add_column("measurement")
    table.add_column("value", justify="right")
    with console.status("fp32 matmul, 1 thread"):
        table.add_row("fp32 matmul 2048^3, 1 CPU thread", f"{matmul_tflops():.3f} TFLOP/s")
    with console.status("planner"):
        table.add_row("full plans (recipe llama3_405b_8192gpu)", f"{plans_per_second():,.0f} / s")
    with console.status("search"):
        evaluated, fitting, seconds = search_405b()
    table.add_row(
        "search: llama3_405b on 16,384 h100_80g, batch 2048 x 8192",
        f"{seconds:.2f} s ({evaluated:,} layouts, {fitting:,} fit)",
    )
    table.add_row("search: layouts evaluated per second", f"{evaluated / seconds:,.0f} / s")
    return table


def optimizer_table(console: Console, overrides: list[str], args) -> Table:
    with console.status("") as status:
        r = muon_against_adamw(
            overrides, args.rounds, args.steps, args.warmup, args.threads, status.update
        )
    table = Table(
        title=(
            f"optimizer: {r['model']}, 1 process, {r['tokens_per_step']:,} tokens per step "
            "(the same model, batch and layout; turns as above)"
        ),
        title_justify="left",
    )
    for col in ("comparison", "ratio", "ms per step", "planned ratio", "planned ms",
                "of it the muon term"):  # fmt: skip
        table.add_column(col, justify="left" if col == "comparison" else "right")
    best, planned = r["best"], r["planned"]
    table.add_row(
        "optimizer=muon / optimizer=adamw",
        f"{r['ratio']:.3f}",
        f"{best[MUON] * 1e3:.1f} vs {best[ADAMW] * 1e3:.1f}",
        f"{r['planned_ratio']:.3f}",
        f"{planned[MUON] * 1e3:.1f} vs {planned[ADAMW] * 1e3:.1f}",
        f"{r['planned_muon_term'] * 1e3:.1f} ms",
    )
    return table


def checkpoint_table(console: Console, overrides: list[str]) -> Table:

    with console.status("") as status:
        r = save_cost(overrides, progress=status.update)
    table = Table(title="checkpoint save, 1 process (model + AdamW state)", title_justify="left")
    for col in ("model", "size", "save with / without checksums", "goal", "ms", "sums, after"):
        table.add_column(col, justify="left" if col == "model" else "right")
    with_, without = (r["seconds"][k] * 1e3 for k in ("with checksums", "without"))
    table.add_row(
        " ".join(overrides) or "default",
        f"{r['bytes'] / 2**20:,.1f} MiB",
        f"{r['ratio']:.3f}",
        "<= 1.05",
        f"{with_:,.0f} vs {without:,.0f}",
        f"{r['summing_seconds'] * 1e3:,.0f} ms in the background",
    )
    return table


def prepare_table(console: Console) -> Table:

    with console.status("") as status:
        r = prepare_throughput(progress=status.update)
    table = Table(title="prepare (tokenizing JSON lines)", title_justify="left")
    for col in ("comparison", "ratio", "goal", "seconds", "MB/s"):
        table.add_column(col, justify="left" if col == "comparison" else "right")
    lib, ours = r["seconds"]["library"], r["seconds"]["prepare"]
    mb = r["bytes"] / 1e6
    table.add_row(
        f"launcher.prepare --workers {r['workers']} / tokenizers encode_batch, "
        f"{r['workers']} threads ({mb:,.1f} MB)",
        f"{r['ratio']:.3f}",
        ">= 0.8",
        f"{ours:.2f} vs {lib:.2f}",
        f"{mb / ours:,.1f} vs {mb / lib:,.1f}",
    )
    return table


def fresh_start_table(console: Console) -> Table:
    with console.status("") as status:
        (r,) = fresh_clones(progress=status.update)
    table = Table(
        title=(
            f"start: `make train` on a fresh clone of {r['revision']} (the default run, 2 CPU "
            f"ranks; median of {r['runs']} warm runs)"
        ),
        title_justify="left",
    )
    for col in ("make setup", ".venv", "to first step", "whole 2-step command",
                "nothing left to train"):  # fmt: skip
        table.add_column(col, justify="right")
    table.add_row(
        f"{r['setup_s']:.0f} s",
        f"{r['venv_mb']:,.0f} MB",
        f"{r['first_step_s']:.1f} s",
        f"{r['command_s']:.1f} s",
        f"{r['nothing_left_s']:.1f} s",
    )
    return table


def default_run_table(console: Console) -> Table:
    with console.status("") as status:
        r = default_against_band(progress=status.update)
    table = Table(
        title=(
            f"the default run (`make train`'s, 2 CPU ranks, {r['steps']} steps) against its "
            f"plan: the band of {r['band_from']}"
        ),
        title_justify="left",
    )
    for col in ("measured tokens/s per device", "planned", "band", "inside"):
        table.add_column(col, justify="right")
    low, high = r["band"]
    table.add_row(
        f"{r['measured']:,.0f}",
        f"{r['planned']:,.0f}",
        f"{low:,.0f}-{high:,.0f}",
        "yes" if r["inside"] else "NO",
    )
    return table


def start_table(console: Console) -> Table:

    with console.status("") as status:
        r = start_by_ranks(progress=status.update)
    table = Table(
        title=(
            f"start: a {r['model_gib']:.2f} GiB (fp32) llama-shaped model, FSDP over N CPU "
            "processes, to its first step"
        ),
        title_justify="left",
    )
    for col in ("ranks", "to first step", "of it the build", "peak per rank before it",
                "share of the model", "first step", "whole command"):  # fmt: skip
        table.add_column(col, justify="right")
    for row in r["runs"]:
        table.add_row(
            str(row["ranks"]),
            f"{row['start_s']:.1f} s",
            f"{row['build_s']:.1f} s",
            f"{row['start_peak_gib']:.2f} GiB (least {row['start_peak_gib_least']:.2f})",
            f"{r['model_gib'] / row['ranks']:.2f} GiB",
            f"{row['step_s']:.1f} s",
            f"{row['wall_s']:.1f} s",
        )
    return table


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("python -m launcher.bench", __doc__, "config overrides of the run")
    parser.add_argument("--rounds", type=int, default=6, help="turns each contender takes")
    parser.add_argument("--steps", type=int, default=5, help="steps per turn")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each first")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torchrun: 1)")
    parser.add_argument("--no-planner", action="store_true", help="only the training steps")
    args = parser.parse_args(argv)
    console = Console(width=120)
    with console.status("") as status:
        result = refusing_bad_config(
            cpu_comparison,
            args.overrides,
            args.rounds,
            args.steps,
            args.warmup,
            args.threads,
            status.update,
        )
    for table in comparison_tables(result):
        console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    console.print(optimizer_table(console, [*args.overrides], args))
    for overrides in ([*args.overrides], [*args.overrides, *LARGER]):
        console.print(checkpoint_table(console, overrides))
    console.print(prepare_table(console))
    console.print(fresh_start_table(console))
    console.print(default_run_table(console))
    console.print(start_table(console))
    if not args.no_planner:
        console.print(planner_table(console))


if __name__ == "__main__":
    sys.exit(main())
