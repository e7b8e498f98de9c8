"""Published training runs the planner is held to: `python -m launcher.plan.calibrate
--published` predicts each and prints the errors, row by row and in aggregate.

Each row is (name, source, the overrides that describe its run, published tokens/s per GPU,
published MFU, published peak memory in GiB or None, its engine kind, what it is used for).
MFU errors are in points of the source's own MFU: a row's predicted MFU is its published MFU
times predicted over published tokens/s (the same FLOP count on both sides). `use`: "fit" rows
set the constants (EFFICIENCY_MAX / DIM: even Megatron rows; h100_hbm2e's efficiency_scale and
compile_factor: torchtitan's eager and compiled H100 rows without tensor parallelism, and its
405B eager row; a100_80g's efficiency_scale: its 8B A100 row; h100_hbm2e's
efficiency_scale_fp8: its 8B FP8 row; each fused stack's scales: its own fit rows), "held-out"
rows only check them, "shown" rows are printed and neither fit nor check: their engine did
something this one does not (`lacks` says what), so the planner, which prices this engine, is
not held to them; "copy" rows are a fit row's workload (calibrate.workload: the same model,
sequence, micro-batch and per-rank layout, at another data-parallel degree: `lacks` says which),
printed, never held out (calibrate.near_copies, tests/plan/test_published.py). Engine kinds:
"fsdp2" (FSDP2 / DTensor in plain PyTorch, this engine's kind), "megatron" (Megatron-LM, NeMo:
fused kernels, overlapped TP), "meta" (Llama 3's own stack).

Sources (docs/sources.md, "Published runs"): Narayanan et al. 2021, Table 1 (A100; MFU is the
reported TFLOP/s over 312, Megatron's FLOP count with recompute); torchtitan
benchmarks/llama3_h100_202412_torchtitan.md Tables 1 and 3, docs/performance.md (405B,
A100 8B/70B), benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (the vanilla-TP bf16 rows);
NVIDIA/dgxc-benchmarking llama3.1/README.md at 741c886 (NeMo 25.02.01, bf16, no activation
checkpointing); NVIDIA-NeMo/Automodel docs/performance-summary.md (70B FSDP2 + CP 2); Dubey et
al. 2024, Table 4 (tokens/s at the planner's FLOPs per token).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    name: str
    overrides: str
    tokens_per_s: float  # per GPU
    mfu: float | None  # as its source counts it (None: at the planner's FLOPs per token)
    memory_gib: float | None
    engine: str  # "fsdp2", "megatron" or "meta": which kind of engine ran it
    use: str  # "fit", "held-out", "shown" or "copy"
    stack: str = "torchtitan"  # whose kernels: sets its efficiency scale (STACKS)
    lacks: str = ""  # a "shown" run: what its engine did that this one does not (a "copy": of what)
    # A "fit" run's constant when it is not its part's or stack's scale or compile factor:
    # "cp" (kernels.CP_ATTENTION_SLOWDOWN).
    fits: str = ""


MEGATRON = [  # (recipe, TFLOP/s per GPU)
    ("megatron_gpt_1_7b", 137),
    ("megatron_gpt_3_6b", 138),
    ("megatron_gpt_7_5b", 142),
    ("megatron_gpt_18_4b", 135),
    ("megatron_gpt_39_1b", 138),
    ("megatron_gpt_76_1b", 140),
    ("megatron_gpt_145_6b", 148),
    ("megatron_gpt_310_1b", 155),
    ("megatron_gpt_529_6b", 163),
    ("megatron_gpt_1008b", 163),
]

# NVIDIA's and Meta's runs: 700 W HBM3 H100 SXMs. torchtitan's: Meta's Grand Teton H100s, 96 GB
# of HBM2e at 500 W (its benchmark files), a part of their own.
H100 = "hardware=h100_80g"
TT_H100 = "hardware=h100_hbm2e"
L8B = "model=llama3_8b train.seq_len=8192"
L70B = "model=llama3_70b train.seq_len=8192"
L405B = "model=llama3_405b train.seq_len=8192"
# torchtitan's per-op policy keeps every other matmul's output (recompute.matmuls=alternate).
TT_OP = "recompute=op recompute.matmuls=alternate"
TT_8B = f"{TT_H100} {L8B} train.micro_batch_size=2 {TT_OP}"
# torchtitan compiled its blocks and not its loss from 2024-12-18 (e8977b0, "turning off
# compile on loss function") until the option to compile it came back (08b8b24, 2025-08-20):
# its end-of-2024 and 2025-06 runs. Its end-of-2024 compiled runs hold 5.4 GiB less than the
# eager ones, where a compiled loss alone would save 15.6 GiB (8 bytes of 16,384 x 128,256
# logits).
TT_COMPILED = "train.compile=true train.compile_loss=false"
# Megatron's own kernels on A100 are what the GEMM curve is fitted to: its scale is 1 there, and
# its rows, planned as compiled blocks, at the compile factor the curve was fitted with (1.047,
# then one constant for every part: torchtitan's compiled over eager H100 runs).
MEGATRON_KERNELS = "hardware.efficiency_scale=1.0 hardware.compile_factor=1.047"
# Fused-kernel stacks (Megatron-LM, NeMo's Transformer Engine, Meta's) run as compiled blocks
# here: their norms, activations and RoPE are fused, their launches few.
# Their engines' time per micro-batch is their own, not measured: none is counted (the
# presets' microbatch_overhead_us is this engine's).
FUSED = "train.compile=true hardware.microbatch_overhead_us=0"
# Transformer Engine's attention is cuDNN's fused kernel: its published H100 rate, 0.453 of peak
# (docs/sources.md, "Hardware").
TE_ATTENTION = "hardware.attention_efficiency=0.453"
NEMO = f"train.micro_batch_size=1 recompute=none tensor=sequence_parallel {FUSED} {TE_ATTENTION}"
FP8 = "precision=fp8"
# Layouts published in bf16 and in FP8.
TT_70B_TP = (
    f"{TT_H100} {L70B} hardware.nodes=32 parallel.tp=8 tensor=sequence_parallel "
    f"train.micro_batch_size=16 train.global_batch_size=512 recompute=full {TT_COMPILED}"
)
TT_8B_TP = (
    f"{TT_H100} {L8B} hardware.nodes=8 parallel.tp=8 tensor=sequence_parallel "
    f"train.micro_batch_size=12 train.global_batch_size=96 {TT_OP} {TT_COMPILED}"
)
NEMO_405B = (
    f"{H100} {L405B} hardware.nodes=64 parallel.tp=8 parallel.pp=8 parallel.cp=2 "
    f"pipeline=interleaved_1f1b pipeline.stages_per_rank=8 train.global_batch_size=256 {NEMO}"
)

# Each stack's kernels reach their own share of the A100 fit on H100: torchtitan's is the
# hardware preset's efficiency_scale (calibrate --hopper), Transformer Engine's (NeMo, NeMo
# AutoModel) and Meta's are fitted to the run of theirs marked "fit" and held to the others.
STACKS = ("torchtitan", "te", "meta")


def float8_tp_pair(name: str, layout: str, tensorwise: float, rowwise: float) -> list[Run]:
    """torchtitan's vanilla-TP FP8 runs of one layout (its 2025-06 file). Tensorwise, it used
    torchao's float8 TP styles (as NeMo's Transformer Engine casts before its sequence-parallel
    gathers): each rank casts its 1/tp share of the model-width activations and gathers them
    in float8. This engine's TP styles gather in bf16 and every rank casts the whole (gloo
    carries no float8 dtype, so no CPU test could hold float8 styles): shown, not held.
    Rowwise, torchtitan keeps its plain TP styles, as this engine does: held out."""
    return [
        Run(
            f"{name} FP8",
            f"{layout} {FP8}",
            tensorwise,
            None,
            None,
            "fsdp2",
            "shown",
            lacks="float8 TP",
        ),
        Run(
            f"{name} FP8 rowwise",
            f"{layout} {FP8} precision.fp8=rowwise",
            rowwise,
            None,
            None,
            "fsdp2",
            "held-out",
        ),
    ]


def nemo_fp8(name: str, layout: str, tokens_per_s: float, mfu: float, lacks: str) -> Run:
    """One of NeMo's FP8 runs, shown (`lacks`: what Transformer Engine does that this engine
    does not)."""
    return Run(name, f"{layout} {FP8}", tokens_per_s, mfu, None, "megatron", "shown", "te", lacks)


RUNS = [
    # torchtitan, FSDP2 on Grand Teton H100s (500 W, HBM2e), bf16.
    Run(
        "torchtitan 8B FSDP 8",
        f"{TT_8B} train.global_batch_size=16",
        5762,
        None,
        82.4,
        "fsdp2",
        "fit",
    ),
    Run(
        "torchtitan 8B FSDP 8 compiled",
        f"{TT_8B} train.global_batch_size=16 {TT_COMPILED}",
        6667,
        None,
        77.0,
        "fsdp2",
        "fit",
    ),
    Run(
        "torchtitan 8B FSDP 128",
        f"{TT_8B} hardware.nodes=16 train.global_batch_size=256",
        5605,
        None,
        67.0,
        "fsdp2",
        "fit",
    ),
    Run(
        "torchtitan 8B FSDP 128 compiled",
        f"{TT_8B} hardware.nodes=16 train.global_batch_size=256 {TT_COMPILED}",
        6514,
        None,
        62.0,
        "fsdp2",
        "fit",
    ),
    Run(
        "torchtitan 405B FSDP 16 x TP 8",
        f"{TT_H100} {L405B} hardware.nodes=16 parallel.tp=8 tensor=sequence_parallel "
        "train.micro_batch_size=2 train.global_batch_size=32 recompute=full",
        109,
        0.29,
        None,
        "fsdp2",
        "fit",
    ),
    Run(
        "torchtitan 70B FSDP 32 x TP 8 compiled",
        TT_70B_TP,
        597.3,
        None,
        None,
        "fsdp2",
        "held-out",
    ),
    Run(
        "torchtitan 8B FSDP 8 x TP 8 compiled",
        TT_8B_TP,
        4378,
        None,
        None,
        "fsdp2",
        "held-out",
    ),
    Run(
        "torchtitan 8B FSDP 64 (A100)",
        "hardware=a100_80g hardware.nodes=8 model=llama3_8b train.seq_len=8192 "
        f"train.micro_batch_size=1 train.global_batch_size=64 {TT_OP}",
        2973,
        0.582,
        None,
        "fsdp2",
        "fit",
    ),
    Run(
        "torchtitan 70B FSDP 64 (A100)",
        "hardware=a100_80g hardware.nodes=8 model=llama3_70b train.seq_len=8192 "
        "train.micro_batch_size=1 train.global_batch_size=64 recompute=full",
        331,
        0.517,
        None,
        "fsdp2",
        "held-out",
    ),
    Run(
        "NeMo AutoModel 70B FSDP2 32 x CP 2 compiled",
        f"{H100} {L70B} hardware.nodes=8 parallel.cp=2 train.micro_batch_size=1 "
        f"train.global_batch_size=128 recompute=full {FUSED} {TE_ATTENTION}",
        866.77,
        0.393,
        None,
        "fsdp2",
        "held-out",
        "te",
    ),
    # NVIDIA DGX Cloud benchmarking, NeMo 25.02.01, bf16, no activation checkpointing.
    Run(
        "NeMo 8B CP 2 on 8",
        f"{H100} {L8B} parallel.cp=2 train.global_batch_size=128 {NEMO}",
        85459 / 8,
        0.6247,
        None,
        "megatron",
        "fit",
        "te",
    ),
    Run(
        "NeMo 70B TP 4 PP 4 CP 2 VP 5 on 64",
        f"{H100} {L70B} hardware.nodes=8 parallel.tp=4 parallel.pp=4 parallel.cp=2 "
        f"pipeline=interleaved_1f1b pipeline.stages_per_rank=5 train.global_batch_size=128 {NEMO}",
        71526 / 64,
        0.5432,
        None,
        "megatron",
        "held-out",
        "te",
    ),
    Run(
        "NeMo 405B TP 8 PP 8 CP 2 VP 8 on 512",
        NEMO_405B,
        106024 / 512,
        0.5547,
        None,
        "megatron",
        "held-out",
        "te",
    ),
    # FP8: torchtitan's float8 linears (torchao, tensorwise unless said) on the same Grand Teton
    # H100s; the 2024-12 file's Tables 1-3 and the 2025-06 file's vanilla-TP rows.
    Run(
        "torchtitan 8B FSDP 8 compiled FP8",
        f"{TT_8B} train.global_batch_size=16 {TT_COMPILED} {FP8}",
        8532,
        None,
        76.8,
        "fsdp2",
        "fit",
    ),
    Run(
        "torchtitan 8B FSDP 128 compiled FP8",
        f"{TT_8B} hardware.nodes=16 train.global_batch_size=256 {TT_COMPILED} {FP8}",
        8380,
        None,
        61.8,
        "fsdp2",
        "copy",
        lacks="torchtitan 8B FSDP 8 compiled FP8 at dp 128",
    ),
    Run(
        "torchtitan 8B FSDP 8 seq 32K compiled FP8",
        f"{TT_H100} model=llama3_8b train.seq_len=32768 train.micro_batch_size=1 "
        f"train.global_batch_size=8 recompute=full {TT_COMPILED} {FP8}",
        3890,
        None,
        83.9,
        "fsdp2",
        "held-out",
    ),
    # Its Table 2 (context parallelism, FP8, compiled, full recompute): CP 2, 4 and 8. The CP 4
    # row sets kernels.CP_ATTENTION_SLOWDOWN; CP 8 is held to it.
    Run(
        "torchtitan 8B FSDP 4 x CP 2 seq 64K compiled FP8",
        f"{TT_H100} model=llama3_8b train.seq_len=65536 parallel.cp=2 train.micro_batch_size=1 "
        f"train.global_batch_size=4 recompute=full {TT_COMPILED} {FP8}",
        2540,
        None,
        84.2,
        "fsdp2",
        "held-out",
    ),
    Run(
        "torchtitan 8B FSDP 2 x CP 4 seq 128K compiled FP8",
        f"{TT_H100} model=llama3_8b train.seq_len=131072 parallel.cp=4 train.micro_batch_size=1 "
        f"train.global_batch_size=2 recompute=full {TT_COMPILED} {FP8}",
        1071,
        None,
        84.0,
        "fsdp2",
        "fit",
        fits="cp",
    ),
    Run(
        "torchtitan 8B CP 8 seq 256K compiled FP8",
        f"{TT_H100} model=llama3_8b train.seq_len=262144 parallel.cp=8 train.micro_batch_size=1 "
        f"train.global_batch_size=1 recompute=full {TT_COMPILED} {FP8}",
        548,
        None,
        84.5,
        "fsdp2",
        "held-out",
    ),
    *float8_tp_pair("torchtitan 70B FSDP 32 x TP 8 compiled", TT_70B_TP, 809.8, 599.6),
    *float8_tp_pair("torchtitan 8B FSDP 8 x TP 8 compiled", TT_8B_TP, 5078.1, 3708.5),
    # NeMo 25.02.01's FP8 rows (MFU against the FP8 peak, as its README counts it), shown, not
    # held: Transformer Engine fuses each float8 cast into the norm or activation before it (no
    # cast traffic of its own) and, under TP, casts before its sequence-parallel gathers (float8
    # TP, above). Planned at this engine's FP8 scale (h100_80g's) with TE's bf16 one: what this
    # engine would do on NeMo's layouts.
    nemo_fp8(
        "NeMo 8B CP 2 on 8 FP8",
        f"{H100} {L8B} parallel.cp=2 train.global_batch_size=128 {NEMO}",
        112388 / 8,
        0.4107,
        "fused casts",
    ),
    nemo_fp8(
        "NeMo 70B TP 4 PP 8 VP 5 on 64 FP8",
        f"{H100} {L70B} hardware.nodes=8 parallel.tp=4 parallel.pp=8 "
        f"pipeline=interleaved_1f1b pipeline.stages_per_rank=5 train.global_batch_size=128 {NEMO}",
        106346 / 64,
        0.4038,
        "fused casts, float8 TP",
    ),
    nemo_fp8(
        "NeMo 405B TP 8 PP 8 CP 2 VP 8 on 512 FP8",
        NEMO_405B,
        169535 / 512,
        0.4435,
        "fused casts, float8 TP",
    ),
    # Llama 3 405B (Meta), Table 4: TFLOP/s per GPU over the planner's 2.524e12 FLOPs/token.
    Run(
        "Llama 3 405B on 8,192",
        f"recipe=llama3_405b_8192gpu recompute=none data.attention=causal {FUSED}",
        430e12 / 2.524e12,
        0.43,
        None,
        "meta",
        "fit",
        "meta",
    ),
    Run(
        "Llama 3 405B on 16,384",
        f"recipe=llama3_405b_16384gpu recompute=none data.attention=causal {FUSED}",
        400e12 / 2.524e12,
        0.41,
        None,
        "meta",
        "copy",
        "meta",
        lacks="Llama 3 405B on 8,192 at dp 128",
    ),
]


def megatron_runs(megatron_flops, compose) -> list[Run]:
    """The Megatron-LM table as Runs (Megatron's fused kernels as compiled blocks): even rows
    fit the GEMM curve, odd rows are held out."""
    out = []
    for i, (recipe, tflops) in enumerate(MEGATRON):
        cfg = compose([f"recipe={recipe}"])
        per_token = megatron_flops(cfg) / (cfg.train.global_batch_size * cfg.train.seq_len)
        out.append(
            Run(
                recipe,
                f"recipe={recipe} {FUSED} {MEGATRON_KERNELS}",
                tflops * 1e12 / per_token,
                tflops / 312,
                None,
                "megatron",
                "fit" if i % 2 == 0 else "held-out",
                "megatron",
            )
        )
    return out
