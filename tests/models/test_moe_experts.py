"""The routed experts' kernels (launcher/models/moe.py): every path equals one expert at a time,
autocast reaches the grouped kernel in bf16, the routed path reads nothing back to the host, the
per-expert loop (where no grouped kernel runs) is linear in the expert count, and a compiled
MoE layer is one graph whatever the routing."""

from __future__ import annotations

import json
from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F

from launcher.models import moe
from launcher.models.moe import MoE, Router, grouped_swiglu


def per_expert(x, counts, w1, w2, w3):
    """The reference: each expert's SwiGLU on its rows, one after the other."""
    parts = x.split(counts.tolist())
    return torch.cat([(F.silu(p @ w1[e].T) * (p @ w3[e].T)) @ w2[e].T for e, p in enumerate(parts)])


def inputs(n: int, d: int, f: int, e: int, seed: int = 0):
    """Rows grouped by expert (expert 1 gets none) and the three stacks, all requiring grad."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.bincount(torch.randint(0, e, (n,), generator=g), minlength=e)
    counts[0] += counts[1]
    counts[1] = 0
    x = torch.randn(n, d, generator=g)
    ws = [torch.randn(e, *s, generator=g) * s[1] ** -0.5 for s in ((f, d), (d, f), (f, d))]
    return [t.requires_grad_() for t in (x, *ws)], counts


def loop_everywhere():
    """As on a device with no grouped kernel: the operator runs its per-expert loop."""
    return patch.object(moe, "expert_kernel", lambda *_: "no grouped kernel (test)")


PATHS = {
    "grouped": lambda x, c, *w: grouped_swiglu(x, c, *w),
    "grouped, rows aligned to 8": lambda x, c, *w: grouped_swiglu(x, c, *w, align=8),
    "operator, grouped": lambda x, c, *w: moe._experts_op(x, c, *w),
}


@pytest.mark.parametrize("shape", [(64, 32, 48, 4), (37, 10, 6, 5)], ids=["aligned", "D=10 F=6"])
@pytest.mark.parametrize("path", [*PATHS, "operator, per-expert loop"])
def test_every_path_equals_one_expert_at_a_time(path, shape):
    (x, *ws), counts = inputs(*shape)
    g = torch.randn(shape[0], shape[1])
    expected = per_expert(x, counts, *ws)
    expected_grads = torch.autograd.grad(expected, [x, *ws], g)
    if path in PATHS:
        got = PATHS[path](x, counts, *ws)
        grads = torch.autograd.grad(got, [x, *ws], g)
    else:
        with loop_everywhere():
            got = moe._experts_op(x, counts, *ws)
            grads = torch.autograd.grad(got, [x, *ws], g)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_autocast_runs_the_grouped_kernel_in_bf16():
    """One process, DDP and ZeRO-1 compute under autocast with fp32 weights and tokens: the
    experts still run as the grouped kernel, in bf16 (autocast does not cast it itself)."""
    (x, *ws), counts = inputs(64, 32, 48, 4)
    called = []
    real = moe._grouped_mm

    def spy(a, b, **kw):
        called.append((a.dtype, b.dtype))
        return real(a, b, **kw)

    with patch.object(moe, "_grouped_mm", spy), torch.autocast("cpu", torch.bfloat16):
        y = grouped_swiglu(x, counts, *ws)
    assert y.dtype == torch.bfloat16
    assert called == [(torch.bfloat16, torch.bfloat16)] * 3
    torch.testing.assert_close(y.float(), per_expert(x, counts, *ws), rtol=0.05, atol=0.05)
    y.float().sum().backward()
    assert all(w.grad is not None and w.grad.dtype == torch.float32 for w in ws)


def layer(experts: int = 16, dim: int = 32) -> MoE:
    torch.manual_seed(0)
    m = MoE(dim, 48, experts, Router(dim, experts, 2), n_shared=1, aux_loss_coef=0.01)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    m.init_buffers()
    return m.train()


def test_the_routed_path_never_reads_a_value_on_the_host():
    """Forward and backward on the meta device, where every tensor has a shape and no value:
    reading one back (tolist, item, a data-dependent shape such as bincount's) raises there.
    In bf16, the dtype the kernel's shape function takes."""
    m = layer().to("meta", torch.bfloat16)
    m.init_buffers()
    x = torch.randn(2, 16, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.shape == x.shape and m.experts.w1.grad.shape == m.experts.w1.shape


def backward_allocated_bytes(experts: int, run) -> int:
    """Bytes the CPU allocator hands out during the backward of `run` (x, counts, w1, w2, w3)
    on 128 token copies spread evenly over `experts` experts of 32 x 48."""
    x, *ws = (t.detach().requires_grad_() for t in inputs(128, 32, 48, experts)[0])
    counts = torch.full((experts,), 128 // experts)
    y = run(x, counts, *ws)
    g = torch.ones_like(y) + 0  # a real tensor: the grouped kernel refuses stride 0
    with torch.profiler.profile(profile_memory=True) as prof:
        y.backward(g)
    return sum(max(0, e.self_cpu_memory_usage) for e in prof.events())


def indexed_loop(x, counts, w1, w2, w3):
    """What the engine ran before: the stacks indexed per expert under autograd."""
    return torch.cat(
        [
            (F.silu(p @ w1[e].T) * (p @ w3[e].T)) @ w2[e].T
            for e, p in enumerate(x.split(counts.tolist()))
        ]
    )


def test_the_per_expert_loop_is_linear_in_the_expert_count():
    """Backward's allocations at 32 experts against 8 (same tokens): 4x the stacks, so about
    4x for a loop that writes each expert's gradient into one stack; indexing the stacks under
    autograd copies a whole stack per expert, about 16x (the control, which shows the
    measurement sees it)."""
    with loop_everywhere():

        def looped(*a):
            return moe._experts_op(*a)

        ratio = backward_allocated_bytes(32, looped) / backward_allocated_bytes(8, looped)
    control = backward_allocated_bytes(32, indexed_loop) / backward_allocated_bytes(8, indexed_loop)
    assert ratio < 6 and control > 10, (ratio, control)


def train_compiled(m: MoE, steps: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], dict]:
    """`steps` SGD steps of a fullgraph-compiled layer (fresh tokens each step, so routing
    changes), under autocast where dtype is bf16: the outputs and dynamo's counters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, fullgraph=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    outs, graphs = [], []
    for _ in range(steps):
        x = torch.randn(2, 16, m.router.gate.in_features, generator=g)
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = compiled(x)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(y.detach().float())
        graphs.append(counters["stats"]["unique_graphs"])
    return outs, {"graphs per step": graphs, "breaks": dict(counters["graph_break"])}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compiled_moe_is_one_graph_whatever_the_routing(dtype):
    """fullgraph=True: no graph break anywhere in the layer (bf16: the grouped kernel traced;
    fp32: the experts' operator, which the compiler calls without tracing). Six steps whose
    routing changes compile once, and train as eager does."""
    compiled = layer()
    eager = layer()
    outs, seen = train_compiled(compiled, 6, dtype)
    assert seen["graphs per step"] == [1] * 6 and not seen["breaks"], json.dumps(seen)
    opt = torch.optim.SGD(eager.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for step, out in enumerate(outs):
        x = torch.randn(2, 16, 32, generator=g)
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = eager(x)
        torch.testing.assert_close(out, y.detach().float(), rtol=tol, atol=tol, msg=f"step {step}")
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(compiled.router.load, eager.router.load)
