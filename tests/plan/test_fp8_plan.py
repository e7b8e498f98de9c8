"""The planner's FP8 terms (precision.fp8; docs/planner.md, "FP8"): the blocks' linears as float8
GEMMs at the part's FP8 peak and its efficiency_scale_fp8, their casts as memory traffic
(kernels.FP8_CAST_BYTES), rowwise scales at kernels.FP8_ROWWISE of tensorwise's speed, emulated
on CPU; the output head, the attention core and the routed experts as in bf16."""

from __future__ import annotations

import pytest
from conftest import compose_config

from launcher.plan import kernels, make_plan
from launcher.plan.report import precision_line
from launcher.plan.terms.compute import layer_cost

TOKENS = 4096
L8B = ["model=llama3_8b", f"train.seq_len={TOKENS}", "train.global_batch_size=64"]


def plan(*overrides: str):
    p = make_plan(compose_config(list(overrides)))
    assert p.estimate is not None, p.errors
    return p


def dense(p, moe: bool = False):
    return layer_cost(p.context, p.layout, moe, p.layout.micro_batch_size * TOKENS)


def cast_bytes(m, tokens: int, tp: int) -> float:
    """A dense llama block's float8 casts, counted linear by linear: q, k, v (dim in, heads
    out), o (heads in, dim out), w1 and w3 (dim in, ffn out), w2 (ffn in, dim out); under tp
    each rank casts its shard of the heads' and ffn's sides and the whole of dim's, and
    its shard of every weight."""
    hd = m.dim // m.n_heads
    q, kv = m.n_heads * hd, m.n_kv_heads * hd
    column = [(m.dim, q), (m.dim, kv), (m.dim, kv), (m.dim, m.ffn_dim), (m.dim, m.ffn_dim)]
    row = [(q, m.dim), (m.ffn_dim, m.dim)]
    per_side, per_weight = kernels.FP8_CAST_BYTES
    sides = sum(a + b / tp for a, b in column) + sum(a / tp + b for a, b in row)
    weights = sum(a * b for a, b in column + row) / tp
    return tokens * sides * per_side + weights * per_weight


@pytest.mark.parametrize("tp", [1, 8])
def test_float8_gemms_run_at_the_fp8_peak_and_the_casts_are_memory_traffic(tp):
    bf16 = plan(*L8B, "hardware=h100_80g", f"parallel.tp={tp}")
    fp8 = plan(*L8B, "hardware=h100_80g", f"parallel.tp={tp}", "precision=fp8")
    hw = fp8.cfg.hardware
    speedup = hw.peak_tflops_fp8 * hw.efficiency_scale_fp8 / (hw.peak_tflops * hw.efficiency_scale)
    b, f = dense(bf16), dense(fp8)
    assert f.gemm == pytest.approx(b.gemm / speedup)
    assert (f.core, f.memory) == (b.core, b.memory)
    tokens = fp8.layout.micro_batch_size * TOKENS
    m = fp8.cfg.model
    assert f.casts == pytest.approx(cast_bytes(m, tokens, tp) / (hw.memory_gbps * 1e9))
    assert b.casts == 0


def test_float8_pays_compiled_and_not_eager_on_an_8b_block():
    """torchao's float8 wants compiled blocks: eager, the casts cost more than the float8
    GEMMs save on Llama 3 8B's block at 4 x 4,096 tokens; compiled (a third of the traffic),
    the step is faster."""
    for compiled, faster in ((False, False), (True, True)):
        args = [*L8B, "hardware=h100_80g", f"train.compile={compiled}"]
        bf16, fp8 = plan(*args), plan(*args, "precision=fp8")
        assert (fp8.estimate.time.step < bf16.estimate.time.step) == faster


def test_compiled_blocks_fuse_the_casts_as_the_other_memory_bound_work():
    eager = plan(*L8B, "hardware=h100_80g", "precision=fp8")
    compiled = plan(*L8B, "hardware=h100_80g", "precision=fp8", "train.compile=true")
    assert dense(compiled).casts == pytest.approx(dense(eager).casts * kernels.ELEMENTWISE_COMPILED)


def test_rowwise_scales_slow_the_float8_gemms_alone():
    tensor = plan(*L8B, "hardware=h100_80g", "precision=fp8")
    row = plan(*L8B, "hardware=h100_80g", "precision=fp8", "precision.fp8=rowwise")
    assert dense(row).gemm == pytest.approx(dense(tensor).gemm / kernels.FP8_ROWWISE)
    assert dense(row).casts == dense(tensor).casts


def test_on_cpu_the_gemms_are_emulated_and_only_the_casts_cost():
    bf16 = plan("model=llama3_debug", "hardware=cpu")
    fp8 = plan("model=llama3_debug", "hardware=cpu", "precision=fp8")
    assert dense(fp8).gemm == dense(bf16).gemm
    assert dense(fp8).casts > 0
    assert fp8.estimate.time.step > bf16.estimate.time.step


def test_a_measured_efficiency_already_holds_the_float8_gain():
    args = [*L8B, "hardware=h100_80g", "hardware.efficiency=0.4"]
    assert dense(plan(*args, "precision=fp8")).gemm == dense(plan(*args)).gemm


def test_the_routed_experts_and_the_router_stay_bf16():
    args = ["model=mixtral_8x7b", "hardware=h100_80g", "train.seq_len=4096"]
    args += ["train.global_batch_size=64", "parallel.ep=8"]
    bf16, fp8 = plan(*args), plan(*args, "precision=fp8")
    assert dense(fp8, moe=True).experts == dense(bf16, moe=True).experts
    assert dense(fp8, moe=True).gemm < dense(bf16, moe=True).gemm  # attention's linears


def test_the_plan_says_how_it_prices_float8():
    line = precision_line(compose_config(["hardware=h200", "precision=fp8"]))
    assert "GEMMs at the FP8 peak (1979 TFLOP/s, efficiency_scale_fp8 0.866)" in line
    assert "casts as memory traffic" in line
    assert "emulated" in precision_line(compose_config(["hardware=cpu", "precision=fp8"]))
