"""`python -m launcher.generate`: the KV cache equals running the whole sequence again, for
every family; sampling's greedy, temperature and top-p rules."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from launcher import models
from launcher.cli import compose
from launcher.generate import CachedCore, generate, sample, with_kv_cache
from launcher.models.families import FAMILIES


def tiny(model: str):
    cfg = compose([f"model={model}"])
    torch.manual_seed(0)
    net = models.build(cfg.model.family, {**asdict(cfg.model), "dropout": 0.0})
    net.init_weights(seed=0)
    return net.eval()


@pytest.mark.parametrize("model", [f.debug for f in FAMILIES.values()])
def test_cached_decoding_equals_the_whole_sequence_run_again(model):
    """Greedy tokens from the KV cache, and the logits of every step, equal a plain forward of
    prompt + tokens so far at each step (fp32)."""
    net = tiny(model)
    prompt = [5, 17, 42, 7, 99, 3]
    plain = []
    with torch.no_grad():
        seq = list(prompt)
        for _ in range(8):
            logits = net(torch.tensor([seq]))[0, -1]
            plain.append(logits)
            seq.append(int(logits.argmax()))
    with_kv_cache(net)
    cores = [m.forward for m in net.modules() if isinstance(m.forward, CachedCore)]
    assert len(cores) == net.args.n_layers
    got = generate(net, prompt, 8)
    assert got == seq[len(prompt) :]
    # The cache holds prompt + 7 generated tokens' keys (the 8th was never fed back).
    assert cores[0].kpos.tolist() == list(range(len(prompt) + 7))
    # A fresh cache, step by step: each step's logits equal the plain forward's.
    with_kv_cache(net)
    with torch.no_grad():
        logits = net(torch.tensor([prompt]), positions=torch.arange(len(prompt)))[0, -1]
        for i, want in enumerate(plain):
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
            pos = torch.tensor([len(prompt) + i])
            logits = net(torch.tensor([[seq[len(prompt) + i]]]), positions=pos)[0, -1]


def test_sampling_rules():
    logits = torch.tensor([1.0, 3.0, 2.0, -5.0])
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, 0.0, 1.0, gen) == 1  # greedy
    # top_p 0.5: token 1 alone holds 0.66 of the mass; nothing else may be drawn.
    assert {sample(logits, 1.0, 0.5, gen) for _ in range(200)} == {1}
    # top_p 0.9: tokens 1 and 2 (0.66 + 0.24); token 3's 0.0002 is never drawn.
    drawn = {sample(logits, 1.0, 0.9, gen) for _ in range(400)}
    assert drawn <= {0, 1, 2} and {1, 2} <= drawn
    a = [sample(logits, 1.0, 1.0, torch.Generator().manual_seed(3)) for _ in range(5)]
    b = [sample(logits, 1.0, 1.0, torch.Generator().manual_seed(3)) for _ in range(5)]
    assert a == b  # seeded


def test_vocab_limit_and_eos_stop():
    net = tiny("llama3_debug")
    with_kv_cache(net)
    out = generate(net, [1, 2, 3], 30, vocab=10)
    assert all(t < 10 for t in out)
    with_kv_cache(net)
    first = generate(net, [1, 2, 3], 1)[0]
    with_kv_cache(net)
    assert generate(net, [1, 2, 3], 30, eos=first) == [first]  # stops at EOS, EOS included
