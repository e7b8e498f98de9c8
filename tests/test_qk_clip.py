"""QK-clip (launcher/training/qk_clip.py) on one process against the Kimi K2 report's rule,
written here from the report (Kimi Team 2025, "Kimi K2: Open Agentic Intelligence", section
2.1 and Algorithm 1): for every attention head h, S_max^h = max over the batch and the causal
pairs of q_i^h . k_j^h / sqrt(d); where S_max^h > tau, gamma_h = tau / S_max^h and, for MHA,
W_q^h and W_k^h are each scaled by sqrt(gamma_h); for MLA the head-specific parts q^C and k^C
by sqrt(gamma_h), the head-specific rotary query q^R by gamma_h, the shared rotary key k^R not
at all. Grouped-query attention (which the report does not cover) is held to what the clip is
for: after it, each head's largest logit on the same inputs is min(S_max^h, tau)."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
import torch

from launcher import models
from launcher.cli import compose
from launcher.models.layers import max_logits
from launcher.runtime.distributed import single
from launcher.training import qk_clip

MHA = ("model=llama3_debug", "model.n_kv_heads=8")  # 8 query heads, 8 key heads
GQA = ("model=llama3_debug",)  # 8 query heads over 4 key heads
MLA = ("model=deepseek_debug",)


def built(overrides, seed: int = 0):
    cfg = compose(list(overrides))
    torch.manual_seed(seed)
    net = models.build(cfg.model.family, {**asdict(cfg.model), "dropout": 0.0})
    net.init_weights(seed=seed)
    return cfg, net.train()


def tokens(cfg, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.model.vocab_size, (2, 24), generator=gen)


def captured(net) -> tuple[list, list]:
    """Hooks keeping each attention module's call (to call it again) and each core's q, k."""
    calls, qk = [], []
    for m in qk_clip.attentions([net]):
        m.register_forward_hook(
            lambda mod, args, kwargs, out: calls.append((mod, args, kwargs)), with_kwargs=True
        )
        m.core.register_forward_hook(
            lambda mod, args, out: qk.append([a.detach() for a in args[:2]])
        )
    return calls, qk


def report_smax(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """S_max^h of (B, H, S, E) queries and keys, the causal pairs only, as the report defines it
    (keys repeated to the query heads under GQA)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return logits.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3)).float()


def test_max_logits_is_the_largest_allowed_logit_of_each_head():
    """Under GQA, with positions (B, S) and documents, chunked over query rows."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 10, 4, generator=gen), torch.randn(2, 3, 10, 4, generator=gen)
    pos = torch.arange(10).expand(2, 10)
    documents = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    kk = k.repeat_interleave(2, dim=1)
    logits = q @ kk.transpose(-2, -1) / 2.0
    allowed = torch.ones(10, 10, dtype=torch.bool).tril() & (
        documents[:, :, None] == documents[:, None, :]
    ).unsqueeze(1)
    expected = logits.masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3))
    import launcher.models.layers as layers

    for chunk in (1 << 24, 30):  # one chunk, and several rows at a time
        old, layers.MAX_LOGIT_CHUNK = layers.MAX_LOGIT_CHUNK, chunk
        try:
            got = max_logits(q, k, pos, pos, documents)
        finally:
            layers.MAX_LOGIT_CHUNK = old
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # Causal alone: every head's maximum lies on or below the diagonal.
    assert not torch.equal(max_logits(q, k, pos[0], pos[0]), logits.amax(dim=(0, 2, 3)))


def clipped(overrides, tau_share: float):
    """A model's training forward with the cores recording, the report's S_max from the cores'
    q and k, then our clip at tau = tau_share x the largest S_max."""
    cfg, net = built(overrides)
    calls, qk = captured(net)
    qk_clip.track([net])
    net(tokens(cfg))
    smax = [report_smax(q, k) for q, k in qk]
    tau = tau_share * max(float(s.max()) for s in smax)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    stats = qk_clip.clip([net], tau, single("cpu"))
    return net, calls, smax, tau, before, stats


@pytest.mark.parametrize("overrides", [MHA, MLA], ids=["mha", "mla"])
def test_the_clip_scales_the_weights_as_the_report_writes(overrides):
    net, _, smax, tau, before, stats = clipped(overrides, 0.6)
    expected = dict(before)
    clipped_heads = 0
    for (i, m), s in zip(enumerate(qk_clip.attentions([net])), smax, strict=True):
        gamma = torch.where(s > tau, tau / s, torch.ones_like(s))
        clipped_heads += int((s > tau).sum())
        name = f"layers.{i}.attention"
        if hasattr(m, "wkv_b"):  # MLA: q = [q^C q^R] per head, wkv_b = [k^C v] per head
            n, r, v = m.nope_dim, m.rope_dim, m.v_dim
            wq = f"{name}.{'wq_b' if m.q_latent else 'wq'}.weight"  # deepseek_debug: q_lora
            q = expected[wq].view(len(s), n + r, -1).clone()
            q[:, :n] *= gamma.sqrt()[:, None, None]
            q[:, n:] *= gamma[:, None, None]
            kv = expected[f"{name}.wkv_b.weight"].view(len(s), n + v, -1).clone()
            kv[:, :n] *= gamma.sqrt()[:, None, None]
            expected[wq] = q.reshape(-1, q.shape[-1])
            expected[f"{name}.wkv_b.weight"] = kv.reshape(-1, kv.shape[-1])
        else:  # MHA: W_q^h and W_k^h by sqrt(gamma_h)
            for w in ("wq", "wk"):
                rows = expected[f"{name}.{w}.weight"].view(len(s), m.head_dim, -1)
                expected[f"{name}.{w}.weight"] = (rows * gamma.sqrt()[:, None, None]).flatten(0, 1)
    assert 0 < clipped_heads < sum(len(s) for s in smax)  # some heads clipped, not all
    assert stats == {"max_logit": pytest.approx(max(float(s.max()) for s in smax), rel=1e-5),
                     "clipped_heads": clipped_heads}  # fmt: skip
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], rtol=1e-6, atol=0, msg=n)
    # MLA's shared rotary key (in wkv_a) is untouched: so is everything but q's and k's rows.
    changed = {n for n, p in net.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {
        n for n in before if n.endswith(("wq.weight", "wq_b.weight", "wk.weight", "wkv_b.weight"))
    }


@pytest.mark.parametrize("overrides", [MHA, GQA, MLA], ids=["mha", "gqa", "mla"])
def test_after_the_clip_each_heads_largest_logit_is_at_most_tau(overrides):
    """Each attention called again on its own inputs: S_max^h becomes min(S_max^h, tau)."""
    net, calls, smax, tau, _, _ = clipped(overrides, 0.6)
    _, qk = captured(net)
    with torch.no_grad():
        for mod, args, kwargs in list(calls):  # the hooks append to calls
            mod(*args, **kwargs)
    for before, (q, k) in zip(smax, qk, strict=True):
        torch.testing.assert_close(report_smax(q, k), before.clamp(max=tau), rtol=1e-5, atol=0)


def test_evaluation_forwards_record_nothing():
    cfg, net = built(GQA)
    qk_clip.track([net])
    with torch.no_grad():
        net(tokens(cfg))
    net.eval()
    net(tokens(cfg))
    assert all(qk_clip.core(m).max_logit is None for m in qk_clip.attentions([net]))


def test_per_op_recompute_keeps_nothing_of_the_record():
    """Under recompute=op a block keeps its matmuls' outputs, but not the record's: its score
    chunks (a sequence x sequence matmul per head) would outweigh the block's own; the replay
    reruns the record instead (the parity row `muonclip cp=2 ring op` holds its values)."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from launcher.models.layers import LogitRecord
    from launcher.parallel.recompute import _op_policy

    mm, ctx = torch.ops.aten.mm.default, SimpleNamespace(is_recompute=False)
    assert _op_policy(ctx, mm) == CheckpointPolicy.MUST_SAVE
    with LogitRecord().recorder():
        assert _op_policy(ctx, mm) == CheckpointPolicy.PREFER_RECOMPUTE
    assert _op_policy(ctx, mm) == CheckpointPolicy.MUST_SAVE
