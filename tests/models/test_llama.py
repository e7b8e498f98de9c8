"""The Llama model against independent reference computations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_config

from launcher import models
from launcher.models.config import ModelConfig
from launcher.models.llama import Attention, LlamaArgs, rope_cache, rope_frequencies
from launcher.plan.model_size import shape
from launcher.training.trainer import build_model


def llama_args(**fields) -> LlamaArgs:
    """LlamaArgs of the model config's defaults (launcher/models/config.py), with these fields."""
    defaults = vars(ModelConfig())
    return LlamaArgs(**{f: fields.get(f, defaults[f]) for f in LlamaArgs.__dataclass_fields__})


def reference_attention(attn: Attention, x: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    """Per-head loops with complex-number RoPE: shares no code with the model's path."""
    b, s, _ = x.shape
    e, h, k = args.head_dim, args.n_heads, args.n_kv_heads
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, e, 2).double() / e))
    rot = torch.polar(
        torch.ones(s, e // 2, dtype=torch.float64), torch.outer(torch.arange(s).double(), inv)
    )

    def rope(t):  # (b, s, e) real pairs -> rotated
        c = torch.view_as_complex(t.double().reshape(b, s, e // 2, 2).contiguous())
        return torch.view_as_real(c * rot).reshape(b, s, e)

    q = x.double() @ attn.wq.weight.double().T
    kk = x.double() @ attn.wk.weight.double().T
    v = x.double() @ attn.wv.weight.double().T
    outs = []
    for head in range(h):
        kv = head // (h // k)  # GQA: consecutive query heads share a kv head
        qh = rope(q[..., head * e : (head + 1) * e])
        kh = rope(kk[..., kv * e : (kv + 1) * e])
        vh = v[..., kv * e : (kv + 1) * e]
        scores = qh @ kh.transpose(1, 2) / math.sqrt(e)
        scores = scores.masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
        outs.append(scores.softmax(-1) @ vh)
    return torch.cat(outs, -1) @ attn.wo.weight.double().T


@pytest.mark.parametrize("fused", [True, False])
def test_attention_matches_reference(fused):
    args = llama_args(dim=64, n_heads=8, n_kv_heads=2, rope_theta=10000.0, flash_attention=fused)
    torch.manual_seed(0)
    attn = Attention(args)
    x = torch.randn(2, 12, 64)
    out = attn(x, rope_cache(args, 12))
    torch.testing.assert_close(
        out.double(), reference_attention(attn, x, args), rtol=1e-5, atol=1e-5
    )


def test_llama3_rope_scaling():
    """Meta's published rule: wavelengths above original/low kept divided by the factor,
    below original/high kept, linear in between."""
    args = llama_args(
        head_dim=128, n_heads=32, dim=4096, rope_scaling_factor=8.0, rope_original_max_seq_len=8192
    )
    got = rope_frequencies(args).double()
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).double() / 128))
    for f, g in zip(base.tolist(), got.tolist(), strict=True):
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            want = f
        elif wavelen > 8192 / 1:
            want = f / 8
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            want = (1 - smooth) * f / 8 + smooth * f
        assert g == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("name", ["llama3_debug", "llama3_8b", "llama3_70b", "llama3_405b"])
def test_module_parameters_match_planner_count(name):
    cfg = compose_config([f"model={name}"])
    with torch.device("meta"):
        model = models.build(cfg.model.family, vars(cfg.model))
    assert sum(p.numel() for p in model.parameters()) == shape(cfg.model).total


def test_initial_loss_is_near_uniform():
    cfg = compose_config([])
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 257, (2, 33))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    assert loss.item() == pytest.approx(math.log(cfg.model.vocab_size), rel=0.05)


def test_rmsnorm_matches_the_elementwise_definition_and_its_gradients():
    from launcher.models.layers import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-5).double()
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), want)
    g = torch.randn_like(want)
    got = torch.autograd.grad(norm(x), (x, norm.weight), g)
    ref = torch.autograd.grad(want, (x, norm.weight), g)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b)
