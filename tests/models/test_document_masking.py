"""Document masking (data.attention=document): a sequence of several documents, each token
attending only within its own and positioned from its document's start, gives the logits of
each document run alone. Every family, fused and matmul attention, with explicit positions
(what context parallelism passes) and without. Plain torch, one process."""

from __future__ import annotations

import pytest
import torch
from test_positions import build

from launcher.models.families import FAMILIES
from launcher.models.layers import (
    additive_mask,
    attention_mask,
    document_attention,
    document_ids,
    document_positions,
    masked_attention,
)

EOS = 7


def documents_of(tokens: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each document (an EOS ends its own)."""
    out = []
    for row in tokens.tolist():
        ends = [i + 1 for i, t in enumerate(row) if t == EOS]
        starts = [0, *ends]
        out.append([(a, b) for a, b in zip(starts, [*ends, len(row)], strict=True) if a < b])
    return out


def sequences() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(8, 96, (2, 32), generator=gen)
    tokens[0, [4, 5, 19]] = EOS  # a one-token document, a document at the end
    tokens[1, [0, 30, 31]] = EOS  # the first token an EOS, two at the end
    return tokens


def test_ids_and_positions():
    tokens = torch.tensor([[3, EOS, EOS, 4, 5, EOS, 6]])
    docs = document_ids(tokens, EOS)
    assert docs.tolist() == [[0, 0, 1, 2, 2, 2, 3]]
    assert document_positions(docs).tolist() == [[0, 1, 0, 0, 1, 2, 0]]
    mask = attention_mask(torch.arange(7), torch.arange(7), docs)[0, 0]
    assert mask.sum(1).tolist() == [1, 2, 1, 1, 2, 3, 1]


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "matmul"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("explicit", [False, True], ids=["", "positions"])
def test_masked_sequence_equals_each_document_alone(family, fused, explicit):
    torch.manual_seed(0)
    model = build(family, fused)
    tokens = sequences()
    docs = document_ids(tokens, EOS)
    positions = torch.arange(32) if explicit else None
    with torch.no_grad():
        logits = model(tokens, positions, docs)
        for row, spans in enumerate(documents_of(tokens)):
            for a, b in spans:
                alone = model(tokens[row : row + 1, a:b])[0]
                torch.testing.assert_close(logits[row, a:b], alone, rtol=0, atol=1e-5)
        # and it is not the causal model's answer: later documents see less
        causal = model(tokens)
    assert (logits[0, 6:] - causal[0, 6:]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_no_mask_is_kept_for_backward(family):
    """The (B, 1, S, S) mask is rebuilt from the (B, S) ids in backward, never saved."""
    model = build(family, True).train()
    tokens = sequences()
    docs = document_ids(tokens, EOS)
    squares = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4 and t.shape[-2:] == (32, 32):  # (B, 1 or H, S, S)
            squares.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, None, docs).sum()
    assert squares == []  # (backward's rerun holds its own transiently)
    loss.backward()


@pytest.mark.parametrize(
    ("fused", "v_dim", "p"),
    [(True, 16, 0.0), (False, 16, 0.0), (True, 8, 0.0), (True, 16, 0.25), (False, 16, 0.25)],
    ids=["cpu flash", "matmul", "narrow values (MLA)", "sdpa dropout", "matmul dropout"],
)
def test_gradients_equal_autograd_through_the_mask(fused, v_dim, p):
    """document_attention's backward (the kernel's with the rebuilt mask, or a rerun) gives
    autograd's gradients through the same masked attention, dropout's masks included."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, 16, generator=gen)
    k = torch.randn(2, 2, 32, 16, generator=gen)
    v = torch.randn(2, 2, 32, v_dim, generator=gen)
    grad = torch.randn(2, 4, 32, v_dim, generator=gen)
    docs = document_ids(sequences(), EOS)
    pos = torch.arange(32)
    results = []
    for attend in (document_attention, None):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(5)
        if attend is None:
            mask = additive_mask(pos, docs, torch.float32 if fused else torch.bool)
            out = masked_attention(*leaves, mask, p, fused)
        else:
            out = attend(*leaves, pos, docs, p, fused)
        out.backward(grad)
        results.append([out, *(t.grad for t in leaves)])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unfused_attention_keeps_five_bytes_a_score_in_bf16():
    """The unfused core saves the probabilities in bf16 (2 bytes a score, softmax computed in
    fp32), dropout's mask (1) and its output (2): Korthikanti et al.'s 5, the planner's count,
    whatever the device's autocast does with a plain softmax (CUDA's returns fp32)."""
    b, h, s, e = 2, 4, 32, 8
    q, k, v = (torch.randn(b, h, s, e, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    scores = []

    def pack(t):
        if t.numel() == b * h * s * s:
            scores.append(t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = masked_attention(q, k, v, None, 0.1, fused=False)
    assert sum(scores) == 5, scores
    out.sum().backward()
    assert q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad).all()
