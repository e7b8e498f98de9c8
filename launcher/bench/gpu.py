"""`python -m launcher.bench.gpu [--workload NAME] [OVERRIDES]`: one device, the engine against
its peers.

Workloads (`--workload`), each in bf16 with compiled blocks on one 80 GB GPU:

- llama3_2_1b (default): Llama 3.2 1B (dim 2048, 16 layers, 32 / 8 heads, FFN 8192,
  vocabulary 128256) at sequence 8192, global batch 4;
- llama3_8b_8l: Llama 3 8B's shape (dim 4096, FFN 14336) cut to 8 of its 32 layers, as the
  default otherwise: the GEMMs that precision=fp8 is measured on;
- deepseek_v2_lite: the first 4 of DeepSeek-V2-Lite's 27 layers (MLA, one dense layer, then
  64 routed experts of 1408 top-6 + 2 shared) at sequence 4096, global batch 4;
- mixtral_8x7b: 2 of Mixtral 8x7B's 32 layers (8 experts of 14336, top-2; what fits with fp32
  Adam states) at sequence 4096, global batch 4;
- gpt_1_7b: Megatron's GPT 1.7B (dim 2304, 24 layers, 24 heads, GeLU MLP of 4 x dim, learned
  positions, LayerNorm, dropout 0.1, vocabulary 51200) whole, as published (attention not fused),
  at sequence 2048, global batch 16 in micro-batches of 2 (64 GiB planned on 80 GB; 4 would
  need 98, the score matrices not being fused). torchtitan has no GPT: run it with `--peers ""`.

Each contender trains the same micro-batches for `--steps` steps after `--warmup` (compilation
happens there):

- engine: this project's trainer (python -m launcher.train's step), on one process;
- transformers: LlamaForCausalLM, DeepseekV2ForCausalLM or MixtralForCausalLM of the same
  shape in a plain loop (each decoder layer compiled under train.compile);
- torchtitan: its own model of the family in a plain loop, each block compiled by its own
  apply_compile: Llama 3 (launcher/bench/titan.py), DeepSeek-V3 or Mixtral-shaped Qwen3 MoE
  blocks (launcher/bench/titan_moe.py, which says how its MoE differs: experts always in bf16,
  no balance losses, no bias update); skipped with the reason when torchtitan cannot be
  imported.

Per contender: tokens/s, MFU against hardware.peak_tflops (989 for h100_80g and h200: the dense
bf16 peak) with the planner's FLOPs per token (active parameters for MoE), and peak memory
(torch.cuda.max_memory_allocated over the timed steps) next to the planner's estimate for the
layout. The contenders run one after another, each freed before the next is built (three 1B
models with fp32 Adam states do not fit one 80 GB device together). Overrides replace the
workload's key of the same name, so the same code runs at a tiny size on CPU:
`python -m launcher.bench.gpu model=llama3_debug hardware=cpu train.compile=false
train.seq_len=64 ...` (the tests do, for each workload).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from launcher.bench import parser as bench_parser
from launcher.bench import refusing_bad_config, titan, titan_moe
from launcher.bench.peers import Step, Workload, engine, hugging_face
from launcher.bench.timing import seconds_per_step
from launcher.models import families
from launcher.plan.memory import GIB, reserve_gib
from launcher.plan.search import with_overrides
from launcher.runtime.scratch import output_problem

GPU_1B = [
    "model=llama3_2_1b",
    "hardware=h100_80g",
    "precision=bf16_mixed",
    "train.compile=true",
    "train.seq_len=8192",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
]

# The MoE workloads' run: one 80 GB GPU, bf16, compiled, sequence 4096, 4 micro-batches of 1.
MOE_RUN = [
    "hardware=h100_80g",
    "precision=bf16_mixed",
    "train.seq_len=4096",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.compile=true",
]
# The shape the MoE issue measured: 4 layers of DeepSeek-V2-Lite (2.25B parameters, 36 GB of
# fp32 weights, gradients and Adam moments).
DEEPSEEK_V2_LITE = ["model=deepseek_v2_lite", "model.n_layers=4", *MOE_RUN]
# Mixtral 8x7B cut to the layers one 80 GB GPU holds with fp32 weights, gradients and Adam
# moments (16 bytes a parameter) and room for activations: a layer is 1.451B parameters (8
# experts x 3 x 4096 x 14336 = 1.409B, attention 0.042B), embeddings and output 0.262B. 2 layers:
# 3.165B x 16 B = 50.6 GB (the planner: 61.5 GiB for the engine's layout with activations and
# reserve); 3 layers: 4.616B x 16 B = 73.9 GB, past ~70 GB before any activation.
MIXTRAL_8X7B = ["model=mixtral_8x7b", "model.n_layers=2", *MOE_RUN]

# Megatron's GPT 1.7B whole at its published sequence, 32,768 tokens per step as the others.
GPT_1_7B = [
    "model=gpt_1_7b",
    "hardware=h100_80g",
    "precision=bf16_mixed",
    "train.compile=true",
    "train.seq_len=2048",
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
]

# Llama 3 8B's shape cut to 8 of its 32 layers (2.80B parameters: 45 GB of fp32 weights,
# gradients and Adam moments, room left for 8K activations on one 80 GB GPU): the 8B-shaped GEMMs
# (4096 x 14336) that FP8 is measured on (precision=fp8 against bf16_mixed).
GPU_8B_CUT = with_overrides(GPU_1B, ["model=llama3_8b", "model.n_layers=8"])

WORKLOADS = {
    "llama3_2_1b": GPU_1B,
    "llama3_8b_8l": GPU_8B_CUT,
    "gpt_1_7b": GPT_1_7B,
    "deepseek_v2_lite": DEEPSEEK_V2_LITE,
    "mixtral_8x7b": MIXTRAL_8X7B,
}


def titan_builder(w: Workload) -> Step:
    """torchtitan's own model of the workload's family: Llama 3 (launcher/bench/titan.py),
    DeepSeek-V3 or Mixtral-shaped MoE blocks (launcher/bench/titan_moe.py)."""
    peer = families.family(w.model["family"]).titan
    return (titan_moe if peer in titan_moe.MAKE else titan).torchtitan(w)


PEERS = {"transformers": hugging_face, "torchtitan": titan_builder}


def measure(step: Step, w: Workload, steps: int, warmup: int) -> dict:
    """Tokens/s over `steps` steps after `warmup`, and the peak memory over them (CUDA)."""
    for _ in range(warmup):
        step()
    cuda = w.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(w.device)
        torch.cuda.reset_peak_memory_stats(w.device)
    seconds = seconds_per_step(step, steps, w.device)
    out = {"seconds_per_step": seconds, "tokens_per_s": w.tokens / seconds}
    if cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated(w.device) / GIB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(w.device) / GIB
    return out


# Kernel names by what they compute, for the profile's summary (matched in lower case).
KERNEL_KINDS = {
    "matmul": (
        "gemm",
        "matmul",
        "cutlass",
        "xmma",
        "nvjet",
        "::mm",
        "::bmm",
        "addmm",
        "grouped_mm",
    ),
    "attention": ("flash", "fmha", "attention", "attn"),
}


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, words in KERNEL_KINDS.items() if any(w in low for w in words)), "other")


def profile_table(step: Step, w: Workload, top: int = 25) -> str:
    """One more step under torch.profiler: its `top` kernels by self device time (CPU time on
    a CPU), each kernel's share, and the step's time by kind (matmul, attention, the rest)."""
    from torch.profiler import ProfilerActivity, profile  # only the --profile path needs it

    cuda = w.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(w.device)
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    # Ranges the code names (record_function: "Optimizer.step#AdamW.step", "ProfilerStep#1")
    # would count their kernels' time twice.
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0 and "#" not in e.key]
    if cuda:  # the kernels themselves, not the operators that launch them
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(getattr(e, attr) for e in events) or 1.0
    by_kind: dict[str, float] = {}
    for e in events:
        by_kind[kind(e.key)] = by_kind.get(kind(e.key), 0.0) + getattr(e, attr)
    lines = [
        f"one step, {total / 1e3:,.1f} ms of {'kernel' if cuda else 'CPU'} time: "
        + ", ".join(
            f"{k} {v / total:.1%}" for k, v in sorted(by_kind.items(), key=lambda x: -x[1])
        ),
        f"{'share':>6}  {'ms':>9}  {'calls':>6}  kind       kernel",
    ]
    for e in sorted(events, key=lambda e: -getattr(e, attr))[:top]:
        t = getattr(e, attr)
        lines.append(
            f"{t / total:6.1%}  {t / 1e3:9.2f}  {e.count:6d}  {kind(e.key):9s}  {e.key[:110]}"
        )
    return "\n".join(lines) + "\n"


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(
    overrides: list[str],
    steps: int,
    warmup: int,
    peers: list[str],
    progress=print,
    workload: str = "llama3_2_1b",
    profile: bool = False,
) -> dict:
    """Every contender's figures and the planner's for `workload` (a key of WORKLOADS) with
    `overrides` replacing its keys, as one JSON-able dict."""
    composed = with_overrides(WORKLOADS[workload], overrides)
    progress("engine: building")
    step, w, plan = engine(composed)
    cfg = plan.cfg
    peak = cfg.hardware.peak_tflops * 1e12
    m = plan.memory
    reserve = reserve_gib(cfg.hardware.device_type.value, cfg.hardware.memory_gib) * GIB
    result = {
        "device": torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "workload": workload,
        "overrides": composed,
        "model": cfg.model.name,
        "n_layers": cfg.model.n_layers,
        "tokens_per_step": w.tokens,
        "micro_batches": len(w.micro),
        "seq_len": cfg.train.seq_len,
        "compile": w.compile,
        "dtype": str(w.compute_dtype).removeprefix("torch."),
        "peak_tflops": cfg.hardware.peak_tflops,
        "flops_per_token": plan.flops_per_token,
        "planner": {
            "tokens_per_s": plan.estimate.tokens_per_s_per_device,
            "mfu": plan.estimate.mfu,
            "memory_gib": m.total / GIB,
            "memory_without_reserve_gib": (m.total - reserve) / GIB,
            "activations_gib": m.activations / GIB,
        },
        "contenders": {},
    }

    def record(name: str, figures: dict) -> None:
        if "tokens_per_s" in figures:
            figures["mfu"] = figures["tokens_per_s"] * plan.flops_per_token / peak
        result["contenders"][name] = figures

    progress(f"engine: {warmup} warm-up and {steps} timed steps")
    record("engine", measure(step, w, steps, warmup))
    if profile:
        progress("engine: one step profiled")
        result["profile"] = profile_table(step, w)
    del step
    release(w.device)
    for name in peers:
        progress(f"{name}: building")
        start = time.perf_counter()
        try:
            peer = PEERS[name](w)
            progress(f"{name}: {warmup} warm-up and {steps} timed steps")
            figures = measure(peer, w, steps, warmup)
        except ImportError as e:
            figures = {"skipped": str(e)}
        except Exception as e:  # a peer failing is a row of the table, not the end of it
            figures = {"failed": f"{type(e).__name__}: {e}"}
        figures["wall_s"] = time.perf_counter() - start
        peer = None
        release(w.device)
        record(name, figures)
    return result


def table(r: dict) -> Table:
    eng = r["contenders"]["engine"]["tokens_per_s"]
    title = (
        f"{r['model']} ({r['n_layers']} layers) on {r['device']} (torch {r['torch']}): "
        f"{r['tokens_per_step']:,} tokens per step in {r['micro_batches']} micro-batches of "
        f"seq {r['seq_len']}, {r['dtype']}"
        f"{', compiled blocks' if r['compile'] else ''}"
    )
    t = Table(title=title, title_justify="left")
    for col in ("contender", "tokens/s", "MFU", "peak memory", "tokens/s vs engine"):
        t.add_column(col, justify="left" if col == "contender" else "right")
    for name, f in r["contenders"].items():
        if "tokens_per_s" not in f:
            t.add_row(name, f.get("skipped") or f.get("failed"), "", "", "")
            continue
        mem = f"{f['peak_allocated_gib']:.2f} GiB" if "peak_allocated_gib" in f else "n/a (cpu)"
        t.add_row(
            name,
            f"{f['tokens_per_s']:,.0f}",
            f"{f['mfu'] * 100:.1f}%",
            mem,
            f"{f['tokens_per_s'] / eng:.3f}",
        )
    p = r["planner"]
    t.add_row(
        "planner (engine's layout)",
        f"{p['tokens_per_s']:,.0f}",
        f"{p['mfu'] * 100:.1f}%",
        f"{p['memory_without_reserve_gib']:.2f} GiB (+ reserve: {p['memory_gib']:.2f})",
        f"{p['tokens_per_s'] / eng:.3f}",
    )
    return t


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("python -m launcher.bench.gpu", __doc__, "replace the workload's keys")
    parser.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default="llama3_2_1b",
        help="the shape measured (above); overrides replace its keys",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile)")
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"comma-separated, from {', '.join(PEERS)}; empty: the engine alone",
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="after the engine's timed steps, profile one more and write its top kernels and "
        "its time by kind (matmul, attention, the rest) to FILE",
    )
    args = parser.parse_intermixed_args(argv)  # overrides before and after the options
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be at least 1 (timed steps)")
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup} must be 0 or more")
    # The files written at the end, checked before minutes of benchmark rather than after.
    for flag, path in (("--json", args.json), ("--profile", args.profile)):
        if path and (problem := output_problem(Path(path), flag)):
            parser.error(problem)
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        parser.error(f"--peers: unknown {', '.join(unknown)} (known: {', '.join(PEERS)})")
    console = Console(width=140)
    with console.status("") as status:
        result = refusing_bad_config(
            run,
            args.overrides,
            args.steps,
            args.warmup,
            peers,
            status.update,
            args.workload,
            bool(args.profile),
        )
    console.print(table(result))
    if args.profile:
        Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
        Path(args.profile).write_text(result["profile"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
