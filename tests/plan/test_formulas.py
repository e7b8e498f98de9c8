"""The planner's formulas against the published ones (docs/sources.md: model shapes, formulas)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import compose_config

from launcher.layout import split_layers, stage_split
from launcher.plan import bubble as pl
from launcher.plan.memory import (
    OpSaved,
    Saved,
    Split,
    layer_activation_bytes,
    op_layer_activation_bytes,
    state_bytes,
)
from launcher.plan.model_size import active_matmul_params_per_token, flops_per_token, shape


@pytest.mark.parametrize(
    ("stage", "bytes_per_param"),
    [(0, 16), (1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)],
)
def test_zero_bytes_per_param_mixed_precision_adam(stage, bytes_per_param):
    """ZeRO paper: 16, 4 + 12/N, 2 + 14/N, 16/N (bf16 params and grads, fp32 master + Adam)."""
    assert sum(state_bytes(1.0, 8, stage, 2, 2, 4, 8)) == pytest.approx(bytes_per_param)


def test_megatron_fp32_grads_and_pure_bf16():
    assert sum(state_bytes(1.0, 1, 0, 2, 4, 4, 8)) == 18  # Megatron keeps fp32 gradients
    assert sum(state_bytes(1.0, 8, 1, 2, 4, 4, 8)) == pytest.approx(6 + 12 / 8)
    assert sum(state_bytes(1.0, 1, 0, 2, 2, 4, 4)) == 12  # bf16 Adam moments, fp32 master


# GPT-3 175B layer (Korthikanti et al. 2022): h 12288, a 96, s 2048, 16-bit, dropout masks.
H, A, S, T = 12288, 96, 2048, 8
# Its per-token widths: q, k, v and the attention output are h each, the GeLU MLP keeps 2 x 4h.
GPT_LAYER = Saved(dim=H, q=H, k=H, v=H, o=H, mlp=2 * 4 * H, n_heads=A)


def korthikanti(t=1, sp=False, recompute="none"):
    """Bytes per layer divided by s b h, from the planner's per-token count (b = 1)."""
    per_token = layer_activation_bytes(
        GPT_LAYER,
        Split(tp=t, sp=sp),
        seq=S,
        recompute=recompute,
        flash=False,
        dropout=True,
        act_b=2,
    )
    return per_token / H


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, 34 + 5 * A * S / H),
        ({"t": T}, 10 + 24 / T + 5 * A * S / (H * T)),
        ({"t": T, "sp": True}, (34 + 5 * A * S / H) / T),
        ({"t": T, "recompute": "selective"}, 10 + 24 / T),
        ({"t": T, "sp": True, "recompute": "selective"}, 34 / T),
        ({"recompute": "full"}, 2),
    ],
    ids=["none", "tp", "tp+sp", "tp+selective", "tp+sp+selective", "full"],
)
def test_korthikanti_activation_table(kwargs, expected):
    assert korthikanti(**kwargs) == pytest.approx(expected)


def test_compiled_sequence_parallel_keeps_the_gathered_inputs():
    common = dict(seq=S, recompute="selective", flash=True, dropout=True, act_b=2)
    compiled = layer_activation_bytes(GPT_LAYER, Split(T, True, sp_keeps_gathered=True), **common)
    eager = layer_activation_bytes(GPT_LAYER, Split(T, True), **common)
    # The two norm outputs (attention and MLP inputs) are kept whole rather than as 1/t shards.
    assert (compiled - eager) / H == pytest.approx(2 * 2 * (1 - 1 / T))


@pytest.mark.parametrize("sp", [False, True])
def test_op_keeps_reductions_not_partial_sums_unless_compiled(sp):
    # Two row-parallel projections (wo, w2), bf16, at t = 8: eager blocks keep the reduction of
    # each (a 1/t shard under SP), compiled ones the whole partial sum besides.
    kept, split = OpSaved(dim=H, row_parallel=2), Split(tp=8, sp=sp)
    eager = op_layer_activation_bytes(kept, split, flash=True, act_b=2) / H
    compiled = op_layer_activation_bytes(kept, split, flash=True, act_b=2, compiled=True) / H
    block_input = 2 / (8 if sp else 1)
    assert eager - block_input == pytest.approx(2 * 2 / (8 if sp else 1))
    assert compiled - eager == pytest.approx(2 * 2)


def test_flash_attention_and_no_dropout_drop_their_terms():
    flash = layer_activation_bytes(
        GPT_LAYER, Split(), seq=S, recompute="none", flash=True, dropout=False, act_b=2
    )
    flash /= H
    assert flash == pytest.approx(32)  # 34 less the two residual dropout masks, no scores


def test_swiglu_saves_one_ffn_wide_tensor_more_than_gelu():
    m = compose_config(["model=llama3_8b"]).model
    widths = dict(dim=m.dim, q=4096, k=1024, v=1024, o=4096, n_heads=32)
    common = dict(seq=8192, recompute="none", flash=True, dropout=False, act_b=2)
    # SwiGLU keeps w1 x, w3 x and their product (silu recomputed); GeLU its input and output.
    swiglu = layer_activation_bytes(Saved(**widths, mlp=3 * m.ffn_dim), Split(), **common)
    gelu = layer_activation_bytes(Saved(**widths, mlp=2 * m.ffn_dim), Split(), **common)
    assert swiglu - gelu == m.ffn_dim * 2


@pytest.mark.parametrize(
    ("schedule", "p", "v", "m", "expected"),
    [
        ("gpipe", 8, 1, 32, 7 / 32),
        ("1f1b", 8, 1, 32, 7 / 32),
        ("interleaved_1f1b", 8, 4, 32, 7 / (4 * 32)),
        ("interleaved_zb", 8, 2, 32, 7 / (3 * 2 * 32)),
        ("zbv", 8, 2, 32, 7 / (6 * 32)),
        ("zbv", 8, 2, 9, 2 * (15 - 9) / (6 * 9)),  # fewer than 2p-1: the V is not filled
        ("dualpipev", 8, 2, 32, 7 / (6 * 32)),
        ("1f1b", 1, 1, 4, 0.0),
    ],
)
def test_bubble_per_schedule(schedule, p, v, m, expected):
    assert pl.bubble_fraction(schedule, p, v, m) == pytest.approx(expected)


def test_inflight_microbatches_per_schedule():
    assert pl.inflight_microbatches("gpipe", 4, 1, 16) == 16
    assert pl.inflight_microbatches("1f1b", 4, 1, 16) == 4
    assert pl.inflight_microbatches("1f1b", 4, 1, 2) == 2
    assert pl.inflight_microbatches("1f1b", 4, 1, 16, rank=3) == 1
    assert pl.inflight_microbatches("interleaved_1f1b", 4, 2, 16) == pytest.approx(4 * (1 + 3 / 8))
    assert pl.inflight_microbatches("interleaved_1f1b", 4, 2, 16, rank=3) == 4 - 3 / 2
    assert pl.inflight_microbatches("interleaved_zb", 4, 2, 16) == 4
    assert pl.inflight_microbatches("zbv", 4, 2, 4) == 2.5
    assert pl.inflight_microbatches("dualpipev", 4, 2, 16) == 4.5


def test_llama3_405b_stage_split():
    assert split_layers(126, 16) == [7] + [8] * 14 + [7]
    assert sum(split_layers(61, 16)) == 61 and min(split_layers(61, 16)) >= 3


def test_llama3_8b_flops_per_token_is_6n_plus_attention():
    m = compose_config(["model=llama3_8b"]).model
    n = 8_030_261_248 - m.vocab_size * m.dim  # non-embedding parameters (head included)
    norms = (2 * m.n_layers + 1) * m.dim  # RMSNorm gains: parameters, but no matmul FLOPs
    for s in (2048, 8192):
        assert flops_per_token(m, s) == 6 * (n - norms) + 6 * m.n_layers * m.dim * s
        assert flops_per_token(m, s, causal=False) == 6 * (n - norms) + 12 * m.n_layers * m.dim * s
        assert flops_per_token(m, s) == pytest.approx(6 * n + 6 * m.n_layers * m.dim * s, rel=1e-4)


@pytest.mark.parametrize(
    ("model", "total", "active"),
    [
        ("llama3_8b", 8_030_261_248, None),
        ("llama3_70b", 70_553_706_496, None),
        ("llama3_405b", 405_853_388_800, None),
        ("mixtral_8x7b", 46.7e9, 12.9e9),
        ("mixtral_8x22b", 141e9, 39e9),
        ("deepseek_v2_lite", 15.7e9, 2.4e9),
        ("deepseek_v3", 671e9, 37e9),
        ("kimi_k2", 1.03e12, 33e9),
    ],
)
def test_parameter_counts_match_reference(model, total, active):
    """Within 1% of the published totals, 3% of active (5% for Kimi K2's unverified ~33B).
    The totals are the main models' (DeepSeek-V3's 671B); its multi-token-prediction module,
    14B as published with its copies of the token table and the head (which ours shares with
    the model: 2 x 129280 x 7168), within 5%."""
    m = compose_config([f"model={model}"]).model
    s = shape(m)
    assert s.total - s.ahead == pytest.approx(total, rel=0.01)
    if m.mtp_depth:
        assert s.ahead + 2 * m.vocab_size * m.dim == pytest.approx(14e9, rel=0.05)
    if active is not None:  # active: the matmul weights a token meets (output head included)
        rel = 0.05 if model == "kimi_k2" else 0.03
        main = dataclasses.replace(m, mtp_depth=0)  # the published figure is the main model's
        assert active_matmul_params_per_token(shape(main), main) == pytest.approx(active, rel=rel)


@pytest.mark.parametrize(
    ("model", "billions"),
    [
        ("gpt_1_7b", 1.7),
        ("gpt_3_6b", 3.6),
        ("gpt_7_5b", 7.5),
        ("gpt_18_4b", 18.4),
        ("gpt_39_1b", 39.1),
        ("gpt_76_1b", 76.1),
        ("gpt_145_6b", 145.6),
        ("gpt_175b", 175),
        ("gpt_310_1b", 310.1),
        ("gpt_529_6b", 529.6),
        ("gpt_1008b", 1008),
    ],
)
def test_megatron_gpt_sizes(model, billions):
    """Narayanan et al.'s P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)), tied embeddings."""
    m = compose_config([f"model={model}"]).model
    n, h = m.n_layers, m.dim
    formula = 12 * n * h**2 * (1 + 13 / (12 * h) + (m.vocab_size + 2048) / (12 * n * h))
    assert shape(m).total == pytest.approx(formula, rel=1e-4)
    assert shape(m).total / 1e9 == pytest.approx(billions, rel=0.03)


def test_configured_stage_splits():
    assert stage_split(126, 16) == [7] + [8] * 14 + [7]
    assert stage_split(32, 4, first=5, last=6) == [5, 11, 10, 6]
    assert stage_split(32, 4, first=2) == [2, 10, 10, 10]
    assert stage_split(8, 2, explicit=(3, 5)) == [3, 5]
