"""The plan step: every rule with its message, degree inference, parameter counts, memory."""

from __future__ import annotations

import pytest
from conftest import compose_config, run_cli

from launcher.plan import make_plan
from launcher.plan.memory import state_bytes
from launcher.plan.model_size import param_counts


def rules(overrides):
    plan = make_plan(compose_config(overrides))
    return plan, {p.rule for p in plan.errors}, " ".join(p.message for p in plan.errors)


def test_default_is_valid_and_fits():
    plan, found, _ = rules([])
    assert plan.valid and plan.fits, plan.errors
    assert plan.degrees["dp_shard"] == 2 and plan.world_size == 2


@pytest.mark.parametrize(
    ("overrides", "shard", "accum"),
    [
        (["hardware.devices_per_node=4"], 4, 1),
        (["hardware.devices_per_node=4", "parallel.dp_replicate=2"], 2, 1),
        (["hardware.devices_per_node=1"], 1, 4),
        (["hardware.devices_per_node=1", "train.micro_batch_size=2"], 1, 8),
    ],
)
def test_degree_inference_and_accumulation(overrides, shard, accum):
    plan, _, _ = rules(overrides)
    assert plan.valid, plan.errors
    assert plan.degrees["dp_shard"] == shard and plan.grad_accum == accum


def test_world_size_mismatch_names_values():
    plan, found, msg = rules(["parallel.dp_shard=3"])
    assert found == {"world_size", "batch"}
    assert "dp_shard=3 = 3 but nodes x devices_per_node = 2" in msg


def test_dp_shard_not_inferable():
    _, found, msg = rules(["parallel.dp_replicate=3"])
    assert found == {"world_size"} and "does not divide nodes x devices_per_node = 2" in msg


def test_batch_not_divisible():
    _, found, msg = rules(
        ["train.global_batch_size=100", "hardware.devices_per_node=8", "train.micro_batch_size=1"]
    )
    assert found == {"batch"}
    assert (
        "global_batch_size=100 must be divisible by train.micro_batch_size=1 x "
        "data-parallel size 8" in msg
    )


@pytest.mark.parametrize("axis", ["tp", "pp", "cp", "ep"])
def test_unbuilt_axes_are_refused_by_name(axis):
    overrides = [f"parallel.{axis}=2"]
    if axis != "ep":
        overrides.append("parallel.dp_shard=1")
    _, found, msg = rules(overrides)
    assert "not_available" in found and f"parallel.{axis}=2" in msg and "not available yet" in msg


def test_tp_divisibility_rules_collected_together():
    _, found, msg = rules(
        [
            "parallel.tp=3",
            "hardware.devices_per_node=3",
            "parallel.dp_shard=1",
            "train.global_batch_size=15",
            "train.micro_batch_size=3",
            "model.ffn_dim=385",
        ]
    )
    assert {"not_available", "tp_heads", "tp_kv_heads", "tp_ffn", "tp_vocab"} <= found
    assert "tp=3 must divide n_heads=8 (model=llama3_debug)" in msg


def test_405b_on_cpu_does_not_fit():
    plan, found, msg = rules(["model=llama3_405b"])
    assert found == {"memory"} and not plan.fits
    assert "model=llama3_405b" in msg and "memory_gib=8" in msg


def test_fp16_and_mismatched_optimizer_dtype_refused():
    _, found, msg = rules(
        [
            "precision.compute_dtype=fp16",
            "precision.param_dtype=fp16",
            "precision.optimizer_dtype=bf16",
        ]
    )
    assert found == {"precision"} and "loss scaling" in msg and "optimizer_dtype=bf16" in msg


def test_missing_data_file():
    _, found, msg = rules(["data.path=/nonexistent/tokens.bin"])
    assert found == {"data"} and "launcher.prepare" in msg


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("llama3_8b", 8_030_261_248),
        ("llama3_70b", 70_553_706_496),
        ("llama3_405b", 405_853_388_800),
    ],
)
def test_param_counts_match_reference(model, expected):
    assert param_counts(compose_config([f"model={model}"]).model).total == expected


@pytest.mark.parametrize(
    ("stage", "bytes_per_param"),
    [(0, 16), (1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)],
)
def test_zero_bytes_per_param_bf16_mixed(stage, bytes_per_param):
    """ZeRO paper: 16, 4 + 12/N, 2 + 14/N, 16/N bytes per parameter (bf16 params and grads)."""
    cfg = compose_config(
        ["hardware=h100_80g", f"data_parallel.zero_stage={stage}", "precision.grad_dtype=bf16"]
    )
    assert sum(model_state_bytes(cfg, 1.0, 8)) == pytest.approx(bytes_per_param)


@pytest.mark.e2e
def test_cli_reports_every_problem_and_exits_2():
    result = run_cli(
        "launcher.train", "model=llama3_405b", "parallel.dp_shard=3", "train.global_batch_size=7"
    )
    assert result.returncode == 2
    assert "2 problems" in result.stderr and "[world_size]" in result.stderr
    assert "[batch]" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.e2e
def test_405b_on_cpu_exits_2_before_any_process():
    result = run_cli("launcher.train", "model=llama3_405b", "hardware=cpu")
    assert result.returncode == 2 and "[memory]" in result.stderr
    assert "torch.distributed.run" not in result.stderr and "Traceback" not in result.stderr
