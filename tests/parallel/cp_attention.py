"""Context-parallel attention against full attention in one process. A job of tests/group.py on
cp processes (`jobs.mesh_job("parallel.cp_attention:job", (cp,), ("cp",))`): each rank's
OUT/RANK.json holds "seq_len" and, for
each case ("method/balanced|contiguous/gqa|mha/fp32|bf16"), this rank's max errors of the
output and of dq, dk, dv against the reference's slices ({name: [max abs error, that / max abs
reference]}), their dtypes, and the blocks it computed ({pass: [blocks, score entries]}).

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


def reference(q, k, v):
    """Full causal attention, the way a reader would write it."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def errors(got: torch.Tensor, want: torch.Tensor) -> list[float]:
    err = (got.double() - want.double()).abs().max().item()
    return [err, err / want.abs().max().item()]


def case(name: str, balanced: bool, kv_heads: int, dtype: torch.dtype, group) -> dict:
    method, _, kernel = name.partition("-")
    cpa._fused = FUSED if kernel != "matmul" else (lambda *_: False)
    cp, rank = group.size(), group.rank()
    torch.manual_seed(0)
    full = {
        "q": torch.randn(B, H, S, E),
        "k": torch.randn(B, kv_heads, S, E),
        "v": torch.randn(B, kv_heads, S, E),
    }
    grad_out = torch.randn(B, H, S, E)
    leaves = {n: t.clone().requires_grad_() for n, t in full.items()}
    reference(**leaves).backward(grad_out)
    want = {"out": reference(**full), **{f"d{n}": t.grad for n, t in leaves.items()}}

    def shard(t):
        return cpa.shard_sequence(t, cp, rank, balanced, dim=2)

    local = {n: shard(t).to(dtype).requires_grad_() for n, t in full.items()}
    pos = cpa.chunk_positions(S, cp, rank, balanced)
    for counts in COUNTS.values():
        counts[:] = [0, 0]
    out = cpa.context_attention(local["q"], local["k"], local["v"], pos, pos, group, method)
    out.backward(shard(grad_out).to(dtype))
    got = {"out": out, **{f"d{n}": t.grad for n, t in local.items()}}
    result = {n: errors(got[n], shard(want[n])) for n in want}
    result["dtype"] = [str(t.dtype) for t in got.values()]
    result["counts"] = {p: list(c) for p, c in COUNTS.items()}
    return result


def run(mesh) -> dict:
    group = mesh.get_group("cp")
    results = {"seq_len": S}
    for method in METHODS:
        for balanced in (False, True):
            for kv_heads in (2, H):
                for dtype in (torch.float32, torch.bfloat16):
                    name = "/".join(
                        [
                            method,
                            "balanced" if balanced else "contiguous",
                            "gqa" if kv_heads < H else "mha",
                            "bf16" if dtype == torch.bfloat16 else "fp32",
                        ]
                    )
                    results[name] = case(method, balanced, kv_heads, dtype, group)
    return results


def job(mesh) -> dict:
    with contextlib.ExitStack() as stack:
        stack.enter_context(counted("_block_forward", "forward"))
        stack.enter_context(counted("_block_backward", "backward"))
        stack.enter_context(patched(cpa, "_fused", FUSED))  # case() swaps the kernel choice
        return run(mesh)
