"""Every problem at once: rules that do not read an unresolved degree are still checked, an
invalid layout still gets its memory and time, search entries carry a plan's verdicts, and the
batch error names values that work."""

from __future__ import annotations

import io
import json
import re

import pytest
from conftest import compose_config
from rich.console import Console

from launcher.plan import make_plan
from launcher.plan.report import plan_json, print_plan
from launcher.plan.search import run_search

H100_8B = ["model=llama3_8b", "hardware=h100_80g"]


def rules(overrides):
    plan = make_plan(compose_config(overrides))
    return plan, {p.rule for p in plan.errors}, " ".join(p.message for p in plan.errors)


def text_of(plan) -> str:
    out = io.StringIO()
    print_plan(plan, Console(file=out, width=400))
    return out.getvalue()


def test_tp3_on_8_gpus_reports_the_world_size_and_the_heads():
    plan, found, msg = rules([*H100_8B, "parallel.tp=3"])
    # The batch rule reads dp_shard, which cannot be inferred: checking it would be noise.
    assert found == {"world_size", "tp_heads", "tp_ffn"}, msg
    assert "parallel.dp_shard=-1 cannot be inferred" in msg
    assert "tp=3 must divide n_heads=32 (model=llama3_8b)" in msg
    assert plan.layout is None and plan.estimate is None
    assert "unresolved (dp_replicate=1, dp_shard=-1)" in text_of(plan)


def test_a_degree_below_one_still_checks_the_other_axes_without_noise():
    _, found, msg = rules([*H100_8B, "parallel.tp=0", "parallel.pp=64"])
    assert found == {"degree", "pp_layers"}, msg
    # pp=0 stands in as 1 for the rules that do not read it; those that do stay silent
    # ("stages_per_rank=2 needs pp > 1" would be nonsense).
    _, found, msg = rules([*H100_8B, "parallel.pp=0", "pipeline.stages_per_rank=2"])
    assert found == {"degree"}, msg


@pytest.mark.parametrize(
    ("overrides", "rule"),
    [
        (H100_8B, "batch"),  # the CPU-sized default batch on 8 GPUs
        (
            H100_8B
            + ["hardware.devices_per_node=3", "parallel.tp=3", "train.global_batch_size=12"],
            "tp_heads",
        ),
        (
            H100_8B + ["parallel.pp=4", "train.micro_batch_size=1", "train.global_batch_size=2"],
            "pp_microbatches",
        ),
    ],
    ids=["batch", "heads", "microbatches"],
)
def test_an_invalid_layout_still_reports_memory_and_time(overrides, rule):
    plan, found, _ = rules(overrides)
    assert rule in found and not plan.valid and "memory" not in found
    out = json.loads(json.dumps(plan_json(plan)))
    assert not out["valid"] and out["memory_gib"]["total"] > 0
    assert out["memory_gib"]["from_invalid_layout"] and out["predicted"]["from_invalid_layout"]
    assert out["predicted"]["step_time_s"] > 0 and out["fits"] == plan.fits
    text = text_of(plan)
    assert "indicative only" in text and "step time" in text and "(invalid layout)" in text


def test_a_valid_plan_marks_nothing_and_an_invalid_one_that_does_not_fit_is_not_a_memory_error():
    out = plan_json(make_plan(compose_config([])))
    assert out["valid"] and not out["memory_gib"]["from_invalid_layout"]
    plan, found, _ = rules(
        ["model=llama3_405b", "parallel.dp_shard=3", "train.global_batch_size=7"]
    )
    assert found == {"world_size", "batch"} and plan.estimate is not None and not plan.fits


def test_unknown_schedule_and_zero_stage_are_reported_not_raised():
    plan, found, _ = rules(["pipeline.schedule=bogus", "parallel.pp=2", "parallel.dp_shard=1"])
    assert "schedule" in found and plan.estimate is None and "bogus" in text_of(plan)
    plan, found, _ = rules(["data_parallel.zero_stage=5"])
    assert found == {"data_parallel"} and "zero_stage=5 must be in [0, 3]" in text_of(plan)
    assert plan.estimate is None


def test_search_entries_carry_valid_and_fits(capsys):
    cfg = compose_config(["plan.top_k=3"])
    assert run_search(cfg, as_json=True) == 0
    top = json.loads(capsys.readouterr().out)["top"]
    assert top and all(e["valid"] is True and e["fits"] is True for e in top)


def suggested(message: str) -> list[list[str]]:
    """The overrides a batch message suggests, each a list of key=value."""
    fix = message.split(": set ", 1)[1]
    return [[f"{k}={v}"] for k, v in re.findall(r"([a-z_.]+)=(\d+)", fix)]


@pytest.mark.parametrize(
    "overrides",
    [
        H100_8B,
        H100_8B + ["hardware.nodes=8", "train.global_batch_size=100", "train.micro_batch_size=1"],
        ["parallel.dp_shard=3", "hardware.devices_per_node=3", "train.global_batch_size=7"],
        ["hardware.devices_per_node=4", "train.global_batch_size=24", "train.micro_batch_size=5"],
        H100_8B
        + [
            "parallel.pp=4",
            "train.micro_batch_size=1",
            "pipeline.microbatches=6",
            "train.global_batch_size=16",
        ],
        H100_8B
        + [
            "parallel.pp=4",
            "train.micro_batch_size=4",
            "pipeline.microbatches=4",
            "train.global_batch_size=12",
        ],
    ],
    ids=["8b-default", "100-on-64", "7-on-3", "micro-5", "microbatches", "microbatches-and-micro"],
)
def test_the_batch_error_names_values_that_work(overrides):
    plan, found, _ = rules(overrides)
    batch = [p.message for p in plan.errors if p.rule == "batch"]
    assert len(batch) == 1 and "\n" not in batch[0]
    fixes = suggested(batch[0])
    assert fixes, batch[0]
    for fix in fixes:
        fixed, found, msg = rules(overrides + fix)
        assert "batch" not in found, (fix, msg)
