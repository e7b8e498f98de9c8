"""The torchtitan contender of MoE workloads is a fair peer: torchtitan's DeepSeek-V3 model and
its Mixtral-shaped Qwen3 MoE blocks of the workload's shape have this project's parameter
count, parameter shapes (a strict state-dict load) and, with the same weights, its logits (fp32,
CPU). Its experts always compute in bf16 (launcher/bench/titan_moe.py), so ours run theirs in
bf16 here too, through the experts' `dispatch` hook; everything else, routers included, in
fp32. `python -m launcher.bench.gpu --workload` runs its MoE workloads at a tiny size."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose_config

from launcher import models
from launcher.bench import gpu, titan_moe
from launcher.bench.peers import Workload
from launcher.models.moe import MoE, grouped_swiglu

try:
    titan_moe._titan()
except ImportError as e:
    pytest.skip(f"torchtitan is not importable: {e}", allow_module_level=True)

SOFTMAX = dict(score_func="softmax", n_group=1, topk_group=1, bias_update_speed=0.0)
SHAPES = {
    # Sigmoid scores with a (random, below) expert bias, group-limited top-2 of 8, renormalised
    # and scaled; a q latent; YaRN with equal magnitudes; one shared expert.
    "deepseek_debug": ("deepseek_debug", {}),
    # DeepSeek-V2-Lite's routing and attention: softmax top-3 of 8, not renormalised, 2 shared
    # experts, queries without a latent, YaRN factor 40 over 16 positions, mscale 0.707.
    "v2_lite_like": (
        "deepseek_debug",
        dict(
            SOFTMAX,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            top_k=3,
            n_shared_experts=2,
            q_lora_rank=0,
            rope_yarn_factor=40.0,
            rope_yarn_original_max_seq_len=16,
            rope_yarn_mscale=0.707,
            rope_yarn_mscale_all_dim=0.707,
        ),
    ),
    # No shared experts, no dense layer, plain RoPE, sigmoid without groups or bias update.
    "bare_moe": (
        "deepseek_debug",
        dict(
            n_shared_experts=0,
            n_dense_layers=0,
            rope_yarn_factor=1.0,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            bias_update_speed=0.0,
            norm_eps=1e-5,
        ),
    ),
    "mixtral_debug": ("mixtral_debug", {}),
}

# Their state-dict names -> ours (the fused wqkv's state dict is already wq / wk / wv).
NAMES = {
    "lm_head.": "output.",
    "qkv_linear.": "",
    ".moe.": ".feed_forward.",
    "routed_experts.inner_experts.": "experts.",
    "_EFD": "",
    "_EDF": "",
    "shared_experts.": "shared.",
    "feed_forward.expert_bias_E": "feed_forward.router.expert_bias",
}


def workload(model: str, **fields) -> Workload:
    cfg = compose_config([f"model={model}", "train.seq_len=64"])
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0)
    )
    micro = [(tokens[:, :-1], tokens[:, 1:])]
    return Workload(
        {**vars(cfg.model), **fields}, micro, cfg.train, torch.device("cpu"), torch.float32, False
    )


def ours_with_their_weights(theirs: torch.nn.Module, m: dict) -> torch.nn.Module:
    ours = models.build(m["family"], m)
    state = {}
    for k, v in theirs.state_dict().items():
        for a, b in NAMES.items():
            k = k.replace(a, b)
        state[k] = v
    # Its expert bias exists only where ours moves one; ours has one for every sigmoid router.
    for k, v in ours.state_dict().items():
        if k.endswith("router.expert_bias"):
            state.setdefault(k, torch.zeros_like(v))
    ours.load_state_dict(state, strict=True)  # every name and shape
    return ours


def experts_in_bf16(x, counts, experts):
    """Ours' experts computing in bf16 as theirs do, the result back in fp32."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return grouped_swiglu(x, counts, experts.w1, experts.w2, experts.w3).float()


@pytest.mark.parametrize("shape", SHAPES)
def test_same_shape_and_logits_as_ours(shape):
    model, fields = SHAPES[shape]
    w = workload(model, **fields)
    theirs = titan_moe.build(w)
    with torch.no_grad():  # a bias that changes the choice, as after some balancing steps
        for name, b in theirs.named_buffers():
            if name.endswith("expert_bias_E"):
                b.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    ours = ours_with_their_weights(theirs, w.model)
    assert sum(p.numel() for p in theirs.parameters()) == sum(p.numel() for p in ours.parameters())
    for layer in ours.modules():
        if isinstance(layer, MoE):
            layer.parallelize(dispatch=experts_in_bf16)
    x = w.micro[0][0]
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ours(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "model, cls", [("deepseek_debug", "DeepSeekV3Model"), ("mixtral_debug", "Qwen3Model")]
)
def test_three_steps_train(model, cls):
    step = titan_moe.torchtitan(workload(model))
    assert type(step.model).__name__ == cls
    losses = [float(step()) for _ in range(3)]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "model, fields, message",
    [
        ("deepseek_debug", dict(dropout=0.1), "dropout"),
        ("deepseek_debug", dict(max_seq_len=32), "max_seq_len"),
        ("deepseek_debug", dict(rope_yarn_mscale=0.0), "rope_yarn_mscale"),
        ("deepseek_debug", dict(rope_yarn_mscale=0.707), "rope_yarn_mscale"),
        ("deepseek_debug", dict(score_func="softmax"), "n_group=4 with score_func=softmax"),
        ("mixtral_debug", dict(family="llama"), "family"),
        ("mixtral_debug", dict(dropout=0.1), "dropout"),
    ],
)
def test_refuses_what_it_cannot_express(model, fields, message):
    with pytest.raises(ValueError, match=message):
        titan_moe.build(workload(model, **fields))


@pytest.mark.parametrize(
    "name, model", [("deepseek_v2_lite", "deepseek_debug"), ("mixtral_8x7b", "mixtral_debug")]
)
def test_gpu_benchmark_moe_workload_at_a_tiny_size(name, model, tmp_path):
    tiny = [f"model={model}", "hardware=cpu", "train.compile=false", "train.seq_len=64"]
    argv = ["--workload", name, *tiny, "--peers", "torchtitan", "--steps", "1", "--warmup", "0"]
    gpu.main([*argv, "--json", str(tmp_path / "r.json")])
    r = json.loads((tmp_path / "r.json").read_text())
    # The workload's keys that were not overridden stay: its layers, batch, bf16 autocast.
    assert r["workload"] == name and r["model"] == model and r["dtype"] == "bfloat16"
    assert r["n_layers"] == {"deepseek_v2_lite": 4, "mixtral_8x7b": 2}[name]
    assert r["seq_len"] == 64 and r["micro_batches"] == 4 and r["tokens_per_step"] == 4 * 64
    for contender in ("engine", "torchtitan"):
        assert r["contenders"][contender]["tokens_per_s"] > 0, r["contenders"][contender]
