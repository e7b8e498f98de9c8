"""Every rule of the plan, each with its message; degree inference; the CLI's exit status."""

from __future__ import annotations

import io
import random
from dataclasses import fields, replace

import pytest
from conftest import compose_config, run_cli
from rich.console import Console

from launcher.layout import AXES, SCHEDULES, Layout
from launcher.models.families import DENSE, FAMILIES
from launcher.plan import make_plan
from launcher.plan.limitations import LIMITATIONS
from launcher.plan.report import print_plan
from launcher.plan.rules import LAYOUT_RULES, engine_problems

H100 = ["hardware=h100_80g"]


def rules(overrides):
    plan = make_plan(compose_config(overrides))
    return plan, {p.rule for p in plan.errors}, " ".join(p.message for p in plan.errors)


def test_default_is_valid_and_fits():
    plan, _, _ = rules([])
    assert plan.ok, plan.errors
    assert plan.degrees["dp_shard"] == 2 and plan.world_size == 2


@pytest.mark.parametrize(
    ("overrides", "shard", "accum"),
    [
        (["hardware.devices_per_node=4"], 4, 1),
        (["hardware.devices_per_node=4", "parallel.dp_replicate=2"], 2, 1),
        (["hardware.devices_per_node=1"], 1, 4),
        (["hardware.devices_per_node=1", "train.micro_batch_size=2"], 1, 8),
        (H100 + ["parallel.tp=8", "model=llama3_8b"], 1, 4),
    ],
)
def test_degree_inference_and_accumulation(overrides, shard, accum):
    plan, _, _ = rules(overrides)
    assert plan.valid, plan.errors
    assert plan.degrees["dp_shard"] == shard and plan.layout.microbatches == accum


def test_world_size_mismatch_names_values():
    _, found, msg = rules(["parallel.dp_shard=3"])
    assert found == {"world_size", "batch"}
    assert "dp_shard=3 = 3 but nodes x devices_per_node = 2" in msg


def test_dp_shard_not_inferable():
    _, found, msg = rules(["parallel.dp_replicate=3"])
    assert found == {"world_size"} and "does not divide nodes x devices_per_node = 2" in msg


def test_8_devices_with_tp4_dp_shard4():
    _, found, msg = rules(H100 + ["model=llama3_8b", "parallel.tp=4", "parallel.dp_shard=4"])
    assert "world_size" in found
    assert "tp=4" in msg and "dp_shard=4 = 16 but nodes x devices_per_node = 8" in msg


def test_llama3_8b_tp3():
    _, found, msg = rules(
        H100
        + [
            "model=llama3_8b",
            "hardware.devices_per_node=3",
            "parallel.tp=3",
            "train.global_batch_size=1",
            "train.micro_batch_size=1",
        ]
    )
    assert found == {"tp_heads", "tp_ffn"}  # 128256 = 3 x 42752: the vocabulary divides
    assert "tp=3 must divide n_heads=32 (model=llama3_8b)" in msg


def test_kv_heads_fewer_than_tp_is_refused_and_says_why():
    _, found, msg = rules(
        H100 + ["model=llama3_8b", "hardware.devices_per_node=16", "parallel.tp=16"]
    )
    assert "tp_kv_heads" in found
    assert "n_kv_heads=8" in msg and "never replicated" in msg


def test_deepseek_v3_ep7():
    _, found, msg = rules(
        [
            "model=deepseek_v3",
            "hardware=h800",
            "hardware.nodes=7",
            "parallel.ep=7",
            "train.global_batch_size=56",
            "train.micro_batch_size=1",
        ]
    )
    assert "ep_experts" in found
    assert "ep=7 must divide n_routed_experts=256 (model=deepseek_v3)" in msg


def test_ep_must_divide_the_ranks_it_borrows():
    _, found, msg = rules(
        [
            "model=mixtral_8x7b",
            *H100,
            "parallel.ep=8",
            "parallel.pp=2",
            "train.global_batch_size=8",
            "train.micro_batch_size=1",
        ]
    )
    assert "ep_degree" in found and "dp_shard x cp x tp = 4 x 1 x 1 = 4" in msg


def test_ep_on_a_dense_model():
    _, found, _ = rules([*H100, "model=llama3_8b", "parallel.ep=2"])
    assert "ep_dense" in found


def test_llama3_8b_pp64():
    _, found, msg = rules(
        H100
        + [
            "model=llama3_8b",
            "hardware.nodes=8",
            "parallel.pp=64",
            "train.global_batch_size=64",
            "train.micro_batch_size=1",
        ]
    )
    assert "pp_layers" in found
    assert "pp=64 x stages_per_rank=1 = 64 stages need at least one layer each" in msg
    assert "n_layers=32" in msg


def test_global_batch_100_on_dp64():
    _, found, msg = rules(
        H100
        + [
            "model=llama3_8b",
            "hardware.nodes=8",
            "train.global_batch_size=100",
            "train.micro_batch_size=1",
        ]
    )
    assert found == {"batch"}
    assert (
        "global_batch_size=100 must be divisible by train.micro_batch_size=1 x "
        "data-parallel size 64" in msg
    )


def test_seq_8191_with_cp2():
    _, found, msg = rules(
        H100
        + [
            "model=llama3_8b",
            "parallel.cp=2",
            "train.seq_len=8191",
            "train.global_batch_size=8",
            "train.micro_batch_size=1",
        ]
    )
    assert found == {"cp_seq"}
    assert "seq_len=8191 must be divisible by 4 (2 x cp load-balanced chunks, cp=2)" in msg


def test_sequence_parallel_needs_seq_divisible_by_tp():
    _, found, msg = rules(
        H100
        + [
            "model=llama3_8b",
            "parallel.tp=8",
            "tensor=sequence_parallel",
            "train.seq_len=1001",
            "train.global_batch_size=8",
            "train.micro_batch_size=1",
        ]
    )
    assert found == {"sp_seq"} and "seq_len=1001 must be divisible by tp=8" in msg


def test_405b_on_one_h100_node_is_valid_but_does_not_fit():
    plan, found, msg = rules(
        H100 + ["model=llama3_405b", "train.micro_batch_size=1", "train.global_batch_size=8"]
    )
    assert plan.valid and not plan.fits and found == {"memory"}
    assert "model=llama3_405b" in msg and "memory_gib=79.6" in msg


@pytest.mark.parametrize(
    "recompute, advice",
    [
        (["recompute=selective"], "use recompute=op or full (recompute.every=k"),
        (["recompute=op"], "use recompute=full, shrink"),
        (["recompute=full", "recompute.every=2"], "recompute on more blocks (recompute.every=2"),
        (["recompute=full"], "shard more (dp_shard, tp, pp), shrink"),
    ],
)
def test_a_memory_refusal_advises_only_the_recompute_not_in_use_and_lists_every_part(
    recompute, advice
):
    """Its parts add up to its total (the master weights of bf16_mixed among them)."""
    plan, found, msg = rules(
        [
            *H100,
            "model=llama3_70b",
            "precision=bf16_mixed",
            "data_parallel=zero1",
            "train.global_batch_size=32",
            *recompute,
        ]  # fmt: skip
    )
    assert found == {"memory"} and advice in msg, msg
    m = plan.memory
    parts = (m.params, m.grads, m.master, m.optimizer, m.activations, m.other)
    assert f"master {m.master / 2**30:,.1f}" in msg and sum(parts) == pytest.approx(m.total)


def test_405b_on_cpu_does_not_fit():
    plan, found, msg = rules(["model=llama3_405b"])
    assert found == {"memory"} and not plan.fits and "memory_gib=8" in msg


PIPE = H100 + ["model=llama3_8b", "parallel.pp=4", "train.micro_batch_size=1"]


def test_microbatches_fewer_than_pp():
    _, found, msg = rules(PIPE + ["train.global_batch_size=2"])
    assert "pp_microbatches" in found and "1 micro-batches per step are fewer than pp=4" in msg


def test_dualpipev_needs_two_stages_per_rank():
    _, found, msg = rules(
        PIPE + ["pipeline=dualpipev", "pipeline.stages_per_rank=3", "train.global_batch_size=16"]
    )
    assert found == {"pp_stages"} and "exactly 2 stages per rank" in msg
    # With pp = 1 as well (the V is then one rank's; once an IndexError in the estimate).
    for overrides in (["parallel.dp_shard=3"], []):
        _, found, msg = rules(
            [*H100, "model=llama3_8b", "pipeline=dualpipev", "pipeline.stages_per_rank=1"]
            + overrides
        )
        assert "pp_stages" in found and "exactly 2 stages per rank" in msg


def test_dualpipev_needs_a_microbatch_per_stage():
    _, found, msg = rules(PIPE + ["pipeline=dualpipev", "train.global_batch_size=12"])
    assert found == {"pp_microbatches"}
    assert "dualpipev needs at least one micro-batch per stage (2 x pp = 8); got 6" in msg


def test_reshard_each_microbatch_needs_fsdp_under_a_full_backward_pipeline():
    _, found, msg = rules(PIPE + ["pipeline.reshard_each_microbatch=true", "data_parallel=zero1"])
    assert found == {"pp_reshard"} and "got pp=4, zero_stage=1, dp_shard=2" in msg
    _, found, msg = rules(
        PIPE
        + ["pipeline=zbv", "pipeline.reshard_each_microbatch=true", "train.global_batch_size=16"]
    )
    assert found == {"pp_reshard"} and "zbv computes the weight gradients in a separate" in msg
    plan, found, _ = rules(PIPE + ["pipeline.reshard_each_microbatch=true"])
    assert not found and plan.valid
    default, _, _ = rules(PIPE)  # gathered parameters, unreduced gradients in param dtype
    assert plan.memory.params == pytest.approx(default.memory.params / 2)
    assert plan.memory.total < default.memory.total
    assert plan.estimate.time["dp"] > default.estimate.time["dp"]


def test_interleaved_microbatches_multiple_of_pp():
    _, found, msg = rules(PIPE + ["pipeline=interleaved_1f1b", "train.global_batch_size=12"])
    assert found == {"pp_microbatches"}
    assert "micro-batches per step (6) to be a multiple of pp=4" in msg


def test_interleaved_needs_virtual_stages_and_1f1b_refuses_them():
    _, found, _ = rules(
        PIPE
        + ["pipeline=interleaved_1f1b", "pipeline.stages_per_rank=1", "train.global_batch_size=16"]
    )
    assert found == {"pp_stages"}
    _, found, _ = rules(PIPE + ["pipeline.stages_per_rank=2", "train.global_batch_size=16"])
    assert found == {"pp_stages"}


def test_explicit_microbatches_must_match_the_batch():
    _, found, msg = rules(PIPE + ["pipeline.microbatches=6", "train.global_batch_size=16"])
    assert found == {"batch"} and "pipeline.microbatches=6" in msg


def test_warnings_tp_across_nodes_bubble_tiny_batch():
    plan, _, _ = rules(
        H100
        + [
            "model=llama3_70b",
            "hardware.nodes=2",
            "parallel.tp=16",
            "train.seq_len=256",
            "train.micro_batch_size=1",
            "train.global_batch_size=1",
        ]
    )
    assert {"tp_node", "micro_batch"} <= {w.rule for w in plan.warnings}
    plan, _, _ = rules(PIPE + ["train.global_batch_size=8"])
    assert "bubble" in {w.rule for w in plan.warnings}


def test_unknown_schedule_and_fp16():
    _, found, msg = rules(
        ["pipeline.schedule=zigzag", "precision.compute_dtype=fp16", "precision.param_dtype=fp16"]
    )
    assert found == {"schedule", "precision"} and "zigzag" in msg and "loss scaling" in msg


def test_missing_data_file():
    _, found, msg = rules(["data.path=/nonexistent/tokens.bin"])
    assert found == {"data"} and "launcher.prepare" in msg


@pytest.mark.parametrize("axis", ["tp", "ep"])
def test_train_runs_expert_layers_under_tp_and_ep(axis):
    overrides = [*H100, "model=mixtral_8x7b", f"parallel.{axis}=2", "train.micro_batch_size=1"]
    plan, _, _ = rules(overrides)
    assert engine_problems(plan.cfg, plan.layout) == []


def test_routed_tokens_split_over_tp_need_a_divisible_sequence():
    overrides = ["model=mixtral_debug", "parallel.tp=2", "parallel.dp_shard=1", "train.seq_len=127"]
    _, found, msg = rules(overrides)
    assert "tp_routed_seq" in found and "train.seq_len=127 must be divisible by tp=2" in msg


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


@pytest.mark.e2e
def test_train_refuses_bad_context_parallel_input_with_named_errors():
    """Exit 2 before any process: a sequence that does not split into 2 x cp load-balanced
    chunks, and (separately) an unknown method."""
    result = run_cli(
        "launcher.train",
        "model=gpt_debug",
        "parallel.cp=4",
        "parallel.dp_shard=1",
        "hardware.devices_per_node=4",
        "train.seq_len=100",
        "train.global_batch_size=16",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "train.seq_len=100 must be divisible by 8 (2 x cp load-balanced chunks" in result.stderr
    result = run_cli("launcher.train", "parallel.cp=2", "context.method=ringg")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "ringg" in result.stderr and "allgather" in result.stderr and "ring" in result.stderr


def test_deepseek_trains_under_tp_ep_and_cp():
    for layout in (
        ["parallel.tp=2", "parallel.dp_shard=1"],
        ["parallel.ep=2"],
        ["parallel.cp=2", "parallel.dp_shard=1"],
    ):
        cfg = compose_config(["model=deepseek_debug", "hardware.devices_per_node=2", *layout])
        assert engine_problems(cfg, make_plan(cfg).layout) == []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.score_func=tanh"], "model.score_func=tanh is not softmax or sigmoid"),
        (["model.score_func=softmax"], "model.n_group=4 with score_func=softmax: the softmax"),
        (["model.n_group=3"], "n_group=3 must divide n_routed_experts=8"),
        (["model.topk_group=5"], "need 1 <= topk_group=5 <= n_group=4"),
        (["model.n_group=8", "model.topk_group=1"], "n_group=8 groups of 8 experts: a group"),
        (["model.topk_group=1", "model.top_k=3"], "top_k=3 experts cannot come from"),
    ],
)
def test_routing_rules(overrides, expected):
    _, names, msg = rules(["model=deepseek_debug", *overrides])
    assert "model" in names and expected in msg, msg


def test_yarn_is_deepseek_only():
    _, names, msg = rules(["model.rope_yarn_factor=4"])
    assert "model" in names and "model.rope_yarn_factor=4: YaRN RoPE is deepseek's" in msg


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["parallel.tp=3", "hardware.devices_per_node=3", "train.global_batch_size=12"],
            "[tp_heads] tp=3 must divide n_heads=8 (model=llama3_debug)",
        ),
        (
            [
                "parallel.tp=2",
                "parallel.dp_shard=1",
                "tensor=sequence_parallel",
                "train.seq_len=127",
            ],
            "[sp_seq] train.seq_len=127 must be divisible by tp=2",
        ),
    ],
    ids=["tp does not divide heads", "sp with seq not divisible"],
)
def test_train_refuses_bad_tp_with_the_planners_error(overrides, expected):
    result = run_cli("launcher.train", *overrides)
    assert result.returncode == 2 and expected in result.stderr
    assert "Traceback" not in result.stderr


def test_configured_split_must_cover_the_layers():
    plan, found, msg = rules(
        PIPE + ["train.global_batch_size=16", "pipeline.layers_per_stage=[8,8,8,7]"]
    )
    assert found == {"pp_split"} and "sum to n_layers=32" in msg
    plan, found, _ = rules(PIPE + ["train.global_batch_size=16", "pipeline.first_stage_layers=30"])
    assert found == {"pp_split"}
    plan, found, _ = rules(
        PIPE
        + [
            "train.global_batch_size=16",
            "pipeline.first_stage_layers=5",
            "pipeline.last_stage_layers=6",
        ]
    )
    assert plan.valid and plan.layout.stage_layers == (5, 11, 10, 6)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["parallel.ep=3", "hardware.devices_per_node=3"], "ep=3 must divide n_routed_experts=4"),
        (
            ["parallel.ep=4", "hardware.devices_per_node=2", "parallel.dp_shard=2"],
            "ep=4 must divide dp_shard x cp x tp = 2 x 1 x 1 = 2",
        ),
        (["model.top_k=5"], "1 <= top_k=5 <= n_routed_experts=4"),
        (
            ["model.n_dense_layers=1"],
            "model.n_dense_layers=1: every layer of a mixtral model is an MoE one (dense first "
            "layers: deepseek)",
        ),
        (
            ["model=deepseek_debug", "model.n_dense_layers=4"],
            "model.n_dense_layers=4 must be in [0, n_layers=4)",
        ),
        (
            ["model.n_routed_experts=0"],
            "model.n_routed_experts=0: a mixtral model needs routed experts (>= 1)",
        ),
        (
            ["model=llama3_debug", "model.n_routed_experts=4"],
            "model.n_routed_experts=4: a llama model has no routed experts (the MoE families: "
            f"{', '.join(n for n, f in FAMILIES.items() if f.feed_forward != DENSE)}) "
            "(model=llama3_debug)",
        ),
        (
            ["model=deepseek_debug", "model.kv_lora_rank=0"],
            "deepseek (multi-head latent attention) needs model.kv_lora_rank (>= 1)",
        ),
        (
            ["model.mtp_depth=1"],
            "model.mtp_depth=1: a mixtral model has no multi-token prediction (the families "
            "with it: deepseek) (model=mixtral_debug)",
        ),
        (["model=deepseek_debug", "model.mtp_depth=-1"], "model.mtp_depth=-1"),
    ],
)
def test_moe_mistakes_are_named(overrides, expected):
    """What a family's record says it has (launcher/models/families.py): routed experts, dense first
    layers. Before the records, a llama with n_routed_experts=4 planned as an MoE (674,944
    parameters) and trained as a dense model (869,504)."""
    _, _, msg = rules(["model=mixtral_debug", *overrides])
    assert expected in msg, msg


@pytest.mark.e2e
def test_cli_refuses_an_ep_that_does_not_divide_the_experts():
    result = run_cli("launcher.train", "model=mixtral_debug", "parallel.ep=3",
                     "hardware.devices_per_node=3")  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "ep=3 must divide n_routed_experts=4 (model=mixtral_debug)" in result.stderr


def test_split_backward_schedules_recompute_fully_but_not_per_op():
    """DeepSeek-V3's layout (dualpipev x EP x ZeRO-1) with full recompute trains (the EP parity
    file trains it 12 steps); per-op recompute under a split schedule is refused."""
    base = ["recipe=deepseek_v3_debug"]
    for ok in (["recompute=full"], ["recompute=none"], ["recompute=op", "pipeline=1f1b"]):
        cfg = compose_config([*base, *ok])
        assert engine_problems(cfg, make_plan(cfg).layout) == [], ok
    cfg = compose_config([*base, "recompute=op"])
    refused = " ".join(str(p) for p in engine_problems(cfg, make_plan(cfg).layout))
    assert "recompute=op with pipeline.schedule=dualpipev is not available" in refused


def test_op_with_pipeline_and_fsdp_sharded_experts_is_refused():
    base = ["model=mixtral_debug", "hardware.devices_per_node=4", "parallel.pp=2"]
    base += ["parallel.ep=2", "pipeline=interleaved_1f1b", "pipeline.stages_per_rank=2"]
    cfg = compose_config([*base, "recompute=op"])
    refused = " ".join(str(p) for p in engine_problems(cfg, make_plan(cfg).layout))
    assert "recompute=op with parallel.pp=2, FSDP and routed experts" in refused
    # What the message offers instead (the DDP one: the EP parity row `pp=2 x ep=2 ddp op`).
    for ok in (["recompute=full"], ["recompute=op", "data_parallel=ddp"]):
        cfg = compose_config([*base, *ok])
        assert engine_problems(cfg, make_plan(cfg).layout) == [], ok


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["recompute=full", "recompute.every=0"], "recompute.every=0 must be >= 1"),
        (["hardware.efficiency_scale=0"], "hardware.efficiency_scale=0.0 must be > 0"),
    ],
)
def test_recompute_every_and_efficiency_scale_are_checked(overrides, message):
    plan = make_plan(compose_config(overrides))
    assert message in " ".join(str(p) for p in plan.errors)
    assert not plan.valid  # and no estimate was attempted on it (every=0 would divide by 0)


def test_a_recipes_recompute_every_under_recompute_none_is_a_warning():
    # `recipe=llama3_405b_16384gpu recompute=none` (its header's comparison) keeps the
    # recipe's every=2.
    plan = make_plan(compose_config(["recipe=llama3_405b_16384gpu", "recompute=none"]))
    assert plan.valid and plan.estimate is not None
    assert "recompute.every=2 has no effect with recompute=none" in " ".join(
        str(p) for p in plan.warnings
    )
    full = make_plan(
        compose_config(["recipe=llama3_405b_16384gpu", "recompute=full", "recompute.every=1"])
    )
    assert plan.estimate.memory.total > full.estimate.memory.total
    # The report does not claim that none applies on blocks 0, 2, 4, ...
    console = Console(file=io.StringIO(), width=200)
    print_plan(plan, console)
    row = next(line for line in console.file.getvalue().splitlines() if "│ recompute " in line)
    assert "blocks" not in row and "none" in row


@pytest.mark.parametrize(
    ("model", "kind"),
    [("mixtral_debug", "routed experts"), ("deepseek_debug", "routed experts")],
)
def test_alternate_matmuls_are_refused_where_the_planner_cannot_count_them(model, kind):
    plan = make_plan(
        compose_config([f"model={model}", "recompute=op", "recompute.matmuls=alternate"])
    )
    message = " ".join(str(p) for p in plan.errors)
    assert f"model={model} has {kind}" in message and "recompute.matmuls=all" in message
    assert not plan.valid


def test_alternate_matmuls_outside_op_are_a_warning_and_change_nothing():
    base = ["model=llama3_debug", "recompute=full"]
    plan = make_plan(compose_config([*base, "recompute.matmuls=alternate"]))
    assert plan.valid
    assert "recompute.matmuls=alternate has no effect with recompute=full" in " ".join(
        str(p) for p in plan.warnings
    )
    same = make_plan(compose_config(base))
    assert plan.estimate.time.step == same.estimate.time.step
    assert plan.estimate.memory.total == same.estimate.memory.total


# Values each Layout field may take, for the random layouts below.
VALUES = {
    **dict.fromkeys(AXES, (1, 2, 3, 4, 8)),
    "zero_stage": (0, 1, 2, 3),
    "micro_batch_size": (1, 2),
    "microbatches": (1, 2, 4, 8),
    "recompute": ("none", "selective", "op", "full"),
    "recompute_every": (1, 2, 3),
    "recompute_matmuls": ("all", "alternate"),
    "sequence_parallel": (False, True),
    "loss_parallel": (False, True),
    "context_method": ("allgather", "ring"),
    "schedule": SCHEDULES,
    "stages_per_rank": (1, 2, 3),
    "stage_layers": ((), (1, 1), (2, 2), (1, 2, 1), (1, 1, 1, 1)),
    "reshard_each_microbatch": (False, True),
}


def test_the_random_layouts_vary_every_field():
    assert set(VALUES) == {f.name for f in fields(Layout)}


def limitation_says(x, cfg, lay):
    return x.message(cfg, lay) if x.applies(cfg, lay) else None


@pytest.mark.parametrize("model", ["llama3_8b", "mixtral_8x7b", "deepseek_debug", "gpt_debug"])
def test_each_rule_and_limitation_reads_only_the_fields_it_declares(model):
    """make_plan skips the rules that read an unresolved degree, and `rules.readers` lists what
    reads a layout option, by what each declares: a Layout field it does not declare, changed,
    changes none of its messages (random layouts)."""
    rng = random.Random(0)
    cfg = compose_config([f"model={model}", "train.seq_len=96", "train.global_batch_size=24"])
    base = make_plan(cfg).layout
    checks = [(r.name, r.reads, lambda lay, r=r: list(r.check(cfg, lay))) for r in LAYOUT_RULES]
    checks += [
        (x.name, x.reads, lambda lay, x=x: limitation_says(x, cfg, lay)) for x in LIMITATIONS
    ]
    for _ in range(100):
        lay = replace(base, **{name: rng.choice(v) for name, v in VALUES.items()})
        for name, reads, says in checks:
            said = says(lay)
            for moved in (f for f in VALUES if f not in reads):
                other = replace(lay, **{moved: rng.choice(VALUES[moved])})
                assert said == says(other), (name, moved, lay)
