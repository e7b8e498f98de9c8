"""Context-parallel attention against full attention in one process. A job of tests/group.py on
cp processes (`jobs.mesh_job("parallel.cp_attention:job", (cp,), ("cp",))`): each rank's
OUT/RANK.json holds "seq_len" and, for
each case ("method/balanced|contiguous/gqa|mha|mla/fp32|bf16"; mla: MHA with a value head
dim V narrower than the query and key head dim E, as MLA's), this rank's max errors of the
output and of dq, dk, dv against the reference's slices ({name: [max abs error, that / max abs
reference]}), their dtypes, and the blocks it computed ({pass: [blocks, score entries]});
"dropout" holds the same errors for attention dropout (p = 0.25, GQA, fp32, each method and
balance), against the reference dropping the same probabilities (the masks the ranks draw,
laid out over the full sequence), and the fraction of the causal probabilities kept.

Every rank builds the same seeded full-sequence q, k, v and upstream gradient, computes the
reference (plain softmax(q k^T / sqrt(E)) v, repeat_interleave for GQA, fp32) and its gradients,
then feeds its shard_sequence slices to context_attention. The blocks are counted by
wrapping the block functions both methods run, so what is counted is what ran. "ring" runs its
blocks in the fused CPU kernel, "ring-matmul" in the matmul form other devices use.
"""

from __future__ import annotations

import contextlib
import math

import torch
from jobs import patched

from launcher.parallel import context_parallel as cpa

B, H, S, E = 2, 4, 32, 16
HEADS = {"gqa": (2, E), "mha": (H, E), "mla": (H, 8)}  # kv heads, value head dim
COUNTS = {"forward": [0, 0], "backward": [0, 0]}  # pass -> [blocks, score entries]
METHODS = (*cpa.METHODS, "ring-matmul")
FUSED = cpa._fused


def counted(name: str, which: str):
    """context_parallel.`name`, counting each call and its (queries x keys) in COUNTS[which]."""
    fn = getattr(cpa, name)

    def wrapped(q, k, *args):
        COUNTS[which][0] += 1
        COUNTS[which][1] += q.shape[-2] * k.shape[-2]
        return fn(q, k, *args)

    return patched(cpa, name, wrapped)


def reference(q, k, v, keep=None, documents=None):
    """Full causal attention, the way a reader would write it; keep: the dropout's scaled
    keep-mask (B, H, S, S) or None; documents (B, S): each token sees its own document only."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    if documents is not None:
        mask = mask & (documents[:, None, :, None] == documents[:, None, None, :])
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs if keep is None else probs * keep) @ v


def dropout_masks(drop, cp: int, balanced: bool) -> torch.Tensor:
    """The scaled keep-masks every cp rank draws for its blocks, laid out over the full (S, S)
    scores at their query and key positions: (B, H, S, S). Entries that no block computes are
    masked by causality, and stay 1."""
    full = torch.ones(B, H, S, S)
    k_pos_all = torch.stack([cpa.chunk_positions(S, cp, r, balanced) for r in range(cp)])
    for r in range(cp):
        q_pos = k_pos_all[r]
        for src, (rows, keys, _) in enumerate(cpa._block_bounds(q_pos, k_pos_all)):
            if rows >= q_pos.numel() or keys == 0:
                continue
            shape = (B, H, q_pos.numel() - rows, keys)
            scale = cpa.dropout_scale(drop, shape, torch.device("cpu"), r * cp + src)
            full[:, :, q_pos[rows:, None], k_pos_all[src][None, :keys]] = scale
    return full


def errors(got: torch.Tensor, want: torch.Tensor) -> list[float]:
    err = (got.double() - want.double()).abs().max().item()
    return [err, err / want.abs().max().item()]


def case(name: str, balanced: bool, heads: str, dtype: torch.dtype, group, documents=None) -> dict:
    """One method against the reference; documents (B, S): under document masking."""
    method, _, kernel = name.partition("-")
    cpa._fused = FUSED if kernel != "matmul" else (lambda *_: False)
    cp, rank = group.size(), group.rank()
    kv_heads, v_dim = HEADS[heads]
    torch.manual_seed(0)
    full = {
        "q": torch.randn(B, H, S, E),
        "k": torch.randn(B, kv_heads, S, E),
        "v": torch.randn(B, kv_heads, S, v_dim),
    }
    grad_out = torch.randn(B, H, S, v_dim)
    leaves = {n: t.clone().requires_grad_() for n, t in full.items()}
    reference(**leaves, documents=documents).backward(grad_out)
    want = {
        "out": reference(**full, documents=documents),
        **{f"d{n}": t.grad for n, t in leaves.items()},
    }

    def shard(t):
        return cpa.shard_sequence(t, cp, rank, balanced, dim=2)

    local = {n: shard(t).to(dtype).requires_grad_() for n, t in full.items()}
    pos = cpa.chunk_positions(S, cp, rank, balanced)
    for counts in COUNTS.values():
        counts[:] = [0, 0]
    out = cpa.context_attention(
        local["q"], local["k"], local["v"], pos, group, method, documents=documents
    )
    out.backward(shard(grad_out).to(dtype))
    got = {"out": out, **{f"d{n}": t.grad for n, t in local.items()}}
    result = {n: errors(got[n], shard(want[n])) for n in want}
    result["dtype"] = [str(t.dtype) for t in got.values()]
    result["counts"] = {p: list(c) for p, c in COUNTS.items()}
    return result


def dropout_case(method: str, balanced: bool, group, p: float = 0.25) -> dict:
    """Attention dropout under CP against the reference dropping the same probabilities."""
    cp, rank = group.size(), group.rank()
    torch.manual_seed(0)
    full = {
        "q": torch.randn(B, H, S, E),
        "k": torch.randn(B, 2, S, E),
        "v": torch.randn(B, 2, S, E),
    }
    grad_out = torch.randn(B, H, S, E)
    torch.manual_seed(1)  # context_attention draws its seed from the global generator
    drop = (p, int(torch.randint(2**62, ())))
    keep = dropout_masks(drop, cp, balanced)
    leaves = {n: t.clone().requires_grad_() for n, t in full.items()}
    out_ref = reference(**leaves, keep=keep)
    out_ref.backward(grad_out)
    want = {"out": out_ref.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}

    def shard(t):
        return cpa.shard_sequence(t, cp, rank, balanced, dim=2)

    local = {n: shard(t).requires_grad_() for n, t in full.items()}
    pos = cpa.chunk_positions(S, cp, rank, balanced)
    torch.manual_seed(1)
    out = cpa.context_attention(local["q"], local["k"], local["v"], pos, group, method, dropout=p)
    out.backward(shard(grad_out))
    got = {"out": out, **{f"d{n}": t.grad for n, t in local.items()}}
    result = {n: errors(got[n], shard(want[n])) for n in want}
    causal = torch.ones(S, S, dtype=torch.bool).tril().expand(B, H, S, S)
    result["kept"] = (keep[causal] > 0).float().mean().item()
    return result


# Document masking: row 0 two documents of 16, row 1 three (0-4, 5-15, 16-31). With the
# boundary at the middle in both rows, a query in the second half sees no key of the first:
# those blocks are skipped.
DOCUMENTS = torch.tensor([[0] * 16 + [1] * 16, [0] * 5 + [1] * 11 + [2] * 16])


def run(mesh) -> dict:
    group = mesh.get_group("cp")
    results = {"seq_len": S}
    for method in METHODS:
        for balanced in (False, True):
            for heads in HEADS:
                for dtype in (torch.float32, torch.bfloat16):
                    name = "/".join(
                        [
                            method,
                            "balanced" if balanced else "contiguous",
                            heads,
                            "bf16" if dtype == torch.bfloat16 else "fp32",
                        ]
                    )
                    results[name] = case(method, balanced, heads, dtype, group)
    results["dropout"] = {
        f"{method}/{'balanced' if balanced else 'contiguous'}": dropout_case(
            method, balanced, group
        )
        for method in cpa.METHODS
        for balanced in (False, True)
    }
    results["documents"] = {
        f"{method}/{'balanced' if balanced else 'contiguous'}/{heads}": case(
            method, balanced, heads, torch.float32, group, DOCUMENTS
        )
        for method in METHODS
        for balanced in (False, True)
        for heads in ("gqa", "mla")
    }
    return results


def job(mesh) -> dict:
    with contextlib.ExitStack() as stack:
        stack.enter_context(counted("_block_forward", "forward"))
        stack.enter_context(counted("_block_backward", "backward"))
        stack.enter_context(patched(cpa, "_fused", FUSED))  # case() swaps the kernel choice
        return run(mesh)
