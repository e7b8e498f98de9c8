"""The DeepSeek model: its size as the planner counts it, YaRN against transformers' own
formula at the published presets' settings, and its initialisation. Its logits against
transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM are in tests/hf/test_hf_mapping.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_config

from launcher import models
from launcher.models.deepseek import DeepSeekArgs, yarn_frequencies, yarn_scales
from launcher.models.layers import future_tokens
from launcher.plan.model_size import shape

PRESETS = ["deepseek_debug", "deepseek_v2_lite", "deepseek_v3", "kimi_k2"]


def args_of(name: str) -> DeepSeekArgs:
    m = vars(compose_config([f"model={name}"]).model)
    return DeepSeekArgs(**{f.name: m[f.name] for f in dataclasses.fields(DeepSeekArgs)})


@pytest.mark.parametrize("name", PRESETS)
def test_module_parameters_match_planner_count(name):
    cfg = compose_config([f"model={name}"])
    with torch.device("meta"):
        model = models.build(cfg.model.family, vars(cfg.model))
    assert sum(p.numel() for p in model.parameters()) == shape(cfg.model).total


@pytest.mark.parametrize("name", PRESETS)
def test_yarn_matches_transformers(name):
    """Frequencies and both temperature factors as transformers computes them from the same
    rope parameters (its rotated-part factor from the rope init, the softmax one from MLA)."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    a = args_of(name)
    rope = {
        "rope_type": "yarn",
        "rope_theta": a.rope_theta,
        "factor": a.rope_yarn_factor,
        "original_max_position_embeddings": a.rope_yarn_original_max_seq_len,
        "beta_fast": a.rope_yarn_beta_fast,
        "beta_slow": a.rope_yarn_beta_slow,
        "mscale": a.rope_yarn_mscale,
        "mscale_all_dim": a.rope_yarn_mscale_all_dim,
    }
    config = DeepseekV3Config(
        hidden_size=a.dim,
        num_attention_heads=a.n_heads,
        num_hidden_layers=1,
        qk_rope_head_dim=a.qk_rope_head_dim,
        max_position_embeddings=a.max_seq_len,
        rope_parameters=rope,
    )
    inv_freq, rotated = ROPE_INIT_FUNCTIONS["yarn"](config)
    torch.testing.assert_close(yarn_frequencies(a), inv_freq, rtol=1e-6, atol=0)
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    softmax = yarn_apply_mscale(config.rope_parameters, qk**-0.5) * math.sqrt(qk)
    assert yarn_scales(a) == pytest.approx((rotated, softmax), rel=1e-12)
    assert a.rope_yarn_factor > 1  # every preset uses YaRN: the check above is not vacuous


def test_yarn_off_is_plain_rope():
    a = dataclasses.replace(args_of("deepseek_debug"), rope_yarn_factor=1.0)
    r = a.qk_rope_head_dim
    plain = 1.0 / (a.rope_theta ** (torch.arange(0, r, 2).double() / r))
    torch.testing.assert_close(yarn_frequencies(a), plain.float())
    assert yarn_scales(a) == (1.0, 1.0)


def test_init_weights():
    """Latent norms start at 1, the residual branches' output projections (attention wo,
    dense and shared w2, stacked experts' w2) at the depth-scaled std, routers unbiased."""
    cfg = compose_config(["model=deepseek_debug"])
    model = models.build("deepseek", vars(cfg.model))
    for _, b in model.named_buffers():
        if b.dtype.is_floating_point:
            b.fill_(7.0)
    model.init_weights(0)
    params = dict(model.named_parameters())
    assert torch.equal(params["layers.1.attention.q_norm.weight"], torch.ones(64))
    assert torch.equal(params["layers.1.attention.kv_norm.weight"], torch.ones(32))
    out_std = 0.02 / math.sqrt(2 * cfg.model.n_layers)
    for name in (
        "layers.0.attention.wo.weight",
        "layers.0.feed_forward.w2.weight",
        "layers.1.feed_forward.experts.w2",
        "layers.1.feed_forward.shared.w2.weight",
    ):
        assert params[name].std().item() == pytest.approx(out_std, rel=0.1), name
    assert params["layers.1.attention.wkv_b.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    bias = model.layers["1"].feed_forward.router.expert_bias
    assert torch.equal(bias, torch.zeros(8))
    # The RoPE table is rebuilt: qk_rope_head_dim wide, for every position.
    assert model.rope.shape == (cfg.model.max_seq_len, 2, cfg.model.qk_rope_head_dim)


def test_initial_loss_is_near_uniform():
    torch.manual_seed(0)
    cfg = compose_config(["model=deepseek_debug"])
    model = models.build("deepseek", vars(cfg.model))
    model.init_weights(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 33))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert loss.item() == pytest.approx(math.log(cfg.model.vocab_size), rel=0.05)


def rms(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def test_multi_token_prediction_is_the_reports():
    """The prediction depths' loss against the DeepSeek-V3 report's formulas (section 2.2),
    written here over sequences cut to what each depth predicts: depth k takes the main
    model's normed hidden state h^0 (k = 1) or depth k-1's output over positions 1..T-k,
    eh_proj([RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]) (the embedding first, as the
    released weights are used by vLLM and Megatron-Core) through its block, the shared head
    after its own norm; L_k the mean cross-entropy of t_{i+k+1}, and the loss added to the
    next-token loss lambda / D * sum_k L_k. The model computes it over whole sequences with
    the positions past the end ignored and attaches it to its logits: the logged values and
    every parameter's gradient equal the reference's."""
    depth, weight = 2, 0.3
    cfg = compose_config(["model=deepseek_debug", f"model.mtp_depth={depth}", "model.dropout=0"])
    m = cfg.model
    model = models.build(m.family, vars(m))
    model.init_weights(0)
    with torch.no_grad():  # norm gains away from 1, so that each norm's weight is tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m.vocab_size, (2, 33), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    t = x.shape[1]

    def ours():
        model.zero_grad()
        model.mtp_loss_sum.zero_()
        logits = model(x, future=future_tokens(y, depth))
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        return model.mtp_loss_sum.clone(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def reference():
        model.zero_grad()
        h, rope = model.features(x)
        main = F.cross_entropy(model.output(h).flatten(0, 1), y.flatten())
        losses = []
        for k in range(1, depth + 1):
            d = model.mtp[str(k - 1)]
            h = h[:, : t - k]  # positions 1..T-k of the depth before
            embedded = model.tok_embeddings(tokens[:, k:t])  # t_{i+k}
            joined = torch.cat([rms(embedded, d.enorm.weight, d.enorm.eps),
                                rms(h, d.hnorm.weight, d.hnorm.eps)], dim=-1)  # fmt: skip
            h = d.block(joined @ d.eh_proj.weight.T, rope)
            logits = rms(h, d.norm.weight, d.norm.eps) @ model.output.weight.T
            losses.append(F.cross_entropy(logits.flatten(0, 1), tokens[:, k + 1 :].flatten()))
        (main + weight / depth * sum(losses)).backward()
        return torch.stack(losses).detach(), {
            n: p.grad.clone() for n, p in model.named_parameters()
        }

    logged, grads = ours()
    expected, expected_grads = reference()
    torch.testing.assert_close(logged, expected, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(expected_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert grads["mtp.1.eh_proj.weight"].abs().sum() > 0
    model.eval()  # evaluation and generation: the next-token logits alone
    assert torch.equal(model(x, future=future_tokens(y, depth)), model(x))


def test_the_prediction_loss_weight_switches_after_its_tokens():
    """V3's schedule (model.mtp_loss_weight 0.3, then mtp_loss_weight_after 0.1 once the run
    has trained on mtp_loss_weight_switch_tokens tokens): the trainer sets the last stage's
    model's weight before each step from the sequences trained so far, so a resumed run
    weighs each step as the uninterrupted one did; 0 never switches."""
    from types import SimpleNamespace

    from launcher.training.trainer import Trainer

    cfg = compose_config(["model=deepseek_v3", "train.seq_len=4096"])
    assert cfg.model.mtp_loss_weight_switch_tokens == 10**13
    model = SimpleNamespace(mtp_weight=None)
    trainer = SimpleNamespace(cfg=cfg, mtp_depth=1, last=True, parts=[model])
    weights = []
    for samples in (0, 10**13 // 4096 - 1, 10**13 // 4096, 10**13 // 4096 + 5):
        Trainer.mtp_weight(trainer, samples)
        weights.append(model.mtp_weight)
    assert weights == [0.3, 0.3, 0.1, 0.1]
    cfg.model.mtp_loss_weight_switch_tokens = 0
    Trainer.mtp_weight(trainer, 10**12)
    assert model.mtp_weight == 0.3
