"""Property test: random overrides never produce a traceback; each is accepted or rejected
with named rules (composition errors being the CLI's exit-2 path, tested in test_config)."""

from __future__ import annotations

import json

from conftest import CONF, compose_config
from hydra.errors import HydraException
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf.errors import OmegaConfBaseException

from launcher.plan import engine_plan
from launcher.plan.report import plan_json

MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
HARDWARE = sorted(p.stem for p in (CONF / "hardware").glob("*.yaml"))
INT = st.integers(min_value=-2, max_value=300)

OVERRIDES = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(MODELS),
        "hardware": st.sampled_from(HARDWARE),
        "hardware.nodes": st.integers(-1, 4096),
        "hardware.devices_per_node": st.integers(-1, 16),
        "hardware.memory_gib": st.floats(-1, 300, allow_nan=False),
        "parallel.dp_replicate": INT,
        "parallel.dp_shard": st.one_of(st.just(-1), INT),
        "parallel.tp": st.sampled_from([-1, 0, 1, 2, 3, 4, 8, 16, 64]),
        "parallel.pp": st.sampled_from([0, 1, 2, 4, 7, 16, 64, 200]),
        "parallel.cp": st.sampled_from([0, 1, 2, 4, 16]),
        "parallel.ep": st.sampled_from([0, 1, 2, 7, 8, 64]),
        "data_parallel": st.sampled_from(["ddp", "zero1", "zero2", "fsdp"]),
        "data_parallel.zero_stage": st.integers(-1, 5),
        "pipeline": st.sampled_from(
            ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"]
        ),
        "pipeline.schedule": st.sampled_from(["1f1b", "bogus"]),
        "pipeline.stages_per_rank": st.integers(-1, 8),
        "pipeline.microbatches": st.integers(-1, 64),
        "recompute": st.sampled_from(["none", "selective", "op", "full"]),
        "model.tie_embeddings": st.booleans(),
        "tensor": st.sampled_from(["plain", "sequence_parallel"]),
        "context": st.sampled_from(["allgather", "ring"]),
        "precision": st.sampled_from(["auto", "fp32", "bf16_mixed"]),
        "precision.grad_dtype": st.sampled_from(["fp32", "bf16", "fp16"]),
        "train.global_batch_size": st.integers(-1, 5000),
        "train.micro_batch_size": st.integers(-1, 16),
        "train.seq_len": st.integers(-1, 200_000),
        "train.steps": st.integers(-1, 10),
        "train.lr": st.floats(-1, 1, allow_nan=False),
        "model.n_heads": st.integers(-1, 128),
        "model.n_layers": st.integers(-1, 200),
        "model.dropout": st.floats(-0.5, 1.5, allow_nan=False),
        "model.flash_attention": st.booleans(),
    },
)


# How many examples: conftest's hypothesis profiles (40 in `make test`, 400 in `make test-all`).
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OVERRIDES)
def test_random_overrides_are_accepted_or_rejected_by_name(overrides):
    # Group choices first: Hydra applies a group's preset before the field overrides.
    ordered = sorted(overrides.items(), key=lambda kv: "." in kv[0])
    args = [f"{k}={v}" for k, v in ordered]
    try:
        cfg = compose_config(args)
    except (HydraException, OmegaConfBaseException):
        return  # a type or value the schema refuses: the CLI's exit 2 (test_config)
    plan = engine_plan(cfg)
    out = json.loads(json.dumps(plan_json(plan)))
    if plan.ok:
        assert out["valid"] and out["fits"] and not out["errors"]
        assert out["predicted"]["step_time_s"] > 0
    else:
        assert plan.errors, "rejected without a named rule"
        assert all(e["rule"] and e["message"] for e in out["errors"])
