"""A mixture-of-experts MLP in four named pieces: router -> token reordering -> grouped experts ->
combine, plus always-on shared experts.

Each token goes to its top_k routed experts; their SwiGLU outputs are summed with the router's
weights. The experts are stacked weights (E, ...) run by one grouped matmul over the tokens
sorted by expert, so that expert parallelism can wrap `MoE.experts` (dispatch the sorted tokens
to the ranks that hold their experts, compute, send them back) without touching this file.
Plain torch, no distributed import: how the engine distributes a layer (tensor, expert and
context parallelism, pipeline stages) it sets through one interface, `MoE.parallelize` (the
fields of `MoEParallel`), and it reads the load each router saw since it last looked.

The experts compute in the compute dtype (autocast's where it is on, else the tokens'), as one
grouped matmul per weight stack wherever torch has the kernel (`expert_kernel` says where it
does not: then a per-expert loop, linear in E forward and backward). On a rank that holds all
its experts nothing in the routed path waits for the host (expert parallelism's split sizes
are its one wait per layer): token counts stay on the device, shapes stay static, so a
compiled block runs it without a graph break or a recompilation as routing changes.

Shapes: T tokens of this forward (B x S), D dim, E routed experts, k top_k, F expert FFN width,
N = T x k token copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from launcher.models.expert_kernel import loop_reason
from launcher.models.layers import FeedForward, swiglu

# torch's grouped matmul: the public name where this torch has it, else the private operator it
# wraps (which older releases have alone).
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def expert_kernel(device_type: str, dtype: torch.dtype) -> str | None:
    """Why the experts run one at a time here (None: as the grouped kernel); the rule, shared
    with the planner, is launcher/models/expert_kernel.py. The engine says it at start."""
    name = str(dtype).removeprefix("torch.")
    return loop_reason(device_type, name, has_grouped_mm=_grouped_mm is not None)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype x's matmuls compute in: autocast's where it is on for x's device, else x's."""
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def _pad(t: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """t with its trailing dimensions zero-padded up to `sizes`."""
    widths = []
    for have, want in reversed(list(zip(t.shape[-len(sizes) :], sizes, strict=True))):
        widths += [0, want - have]
    return F.pad(t, widths) if any(widths) else t


def _padded_dims(x: torch.Tensor, w1: torch.Tensor) -> tuple[int, int]:
    """D and F rounded up to 16 bytes, the strides the grouped kernel takes: zero-padded
    units compute zeros (silu(0) x 0 = 0) and are cut off the results."""
    unit = 16 // x.element_size()
    return -(-x.shape[1] // unit) * unit, -(-w1.shape[1] // unit) * unit


def _aligned_rows(counts: torch.Tensor, n: int, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of n rows grouped by expert (counts (G,) each, in order) goes so that every
    group starts at a multiple of `align` rows (16 bytes on CUDA, as torchtitan pads each
    expert's rows for the kernel's alignment; `python -m launcher.bench.cuda_paths` checks the
    kernel without it): the rows' places (n,) and the groups' ends (G,), in a static
    n + G x (align - 1) rows, computed on the device."""
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    first = counts.cumsum(0)
    expert = torch.searchsorted(first, torch.arange(n, device=counts.device), right=True)
    shift = (ends - padded) - (first - counts)  # (G,) how far each group's rows move
    return torch.arange(n, device=counts.device) + shift[expert], ends


def _grouped_swiglu(x, counts, w1, w2, w3, align: int) -> torch.Tensor:
    """The grouped kernel's SwiGLU under autograd (a compiled block traces it): dimensions
    padded to 16 bytes, rows aligned to `align` where the device wants it."""
    n, d = x.shape
    dp, fp = _padded_dims(x, w1)
    x, w1, w3, w2 = _pad(x, (dp,)), _pad(w1, (fp, dp)), _pad(w3, (fp, dp)), _pad(w2, (dp, fp))
    if align > 1:
        rows, ends = _aligned_rows(counts, n, align)
        x = x.new_zeros(n + counts.numel() * (align - 1), dp).index_copy(0, rows, x)
    else:
        ends = counts.cumsum(0)
    offs = ends.to(torch.int32)
    h = swiglu(
        _grouped_mm(x, w1.transpose(-2, -1), offs=offs),
        _grouped_mm(x, w3.transpose(-2, -1), offs=offs),
    )  # (rows, F)
    y = _grouped_mm(h, w2.transpose(-2, -1), offs=offs)  # (rows, D)
    if align > 1:
        y = y.index_select(0, rows)
    return y[:, :d] if dp != d else y


# -- The experts as one operator of their own ------------------------------------------------
# Where a compiled block cannot trace the grouped kernel (torch 2.13's shape function takes
# bf16 only, though the CPU kernel runs every float dtype), and where no grouped kernel runs at
# all (then one expert at a time), the experts are one custom operator with an explicit
# backward: opaque to the compiler (no graph break, whatever the routing), and each weight
# gradient written once into one stack (indexing the stacks under autograd would copy a whole
# stack per expert: O(E^2) in backward).


def _expert_rows(counts: torch.Tensor):
    """(expert, slice of its rows) for every expert with rows: the loop's host sync."""
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            yield e, slice(start, start + n)
        start += n


def _swiglu_grads(a, b, dh):
    """(h, da, db) of h = silu(a) x b, given h's gradient dh."""
    gate = torch.sigmoid(a)
    silu = a * gate
    return silu * b, dh * b * gate * (1 + a * (1 - gate)), dh * silu


@torch.library.custom_op("launcher::experts_swiglu", mutates_args=())
def _experts_op(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """grouped_swiglu's result, run eagerly: grouped where the kernel runs, else a loop."""
    if expert_kernel(x.device.type, x.dtype) is None:
        with torch.no_grad():
            return _grouped_swiglu(x, counts, w1, w2, w3, align=1)
    out = x.new_zeros(x.shape[0], w2.shape[1])
    for e, rows in _expert_rows(counts):
        part = x[rows]
        out[rows] = (F.silu(part @ w1[e].T) * (part @ w3[e].T)) @ w2[e].T
    return out


@torch.library.custom_op("launcher::experts_swiglu_backward", mutates_args=())
def _experts_backward_op(
    grad: torch.Tensor,
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of _experts_op for x and the three stacks, recomputing the hidden activations
    (a = x w1^T, b = x w3^T)."""
    if expert_kernel(x.device.type, x.dtype) is None:
        return _grouped_backward(grad, x, counts, w1, w2, w3)
    dx = torch.zeros_like(x)
    dw1, dw2, dw3 = torch.zeros_like(w1), torch.zeros_like(w2), torch.zeros_like(w3)
    for e, rows in _expert_rows(counts):
        part, g = x[rows], grad[rows]
        h, da, db = _swiglu_grads(part @ w1[e].T, part @ w3[e].T, g @ w2[e])
        dw2[e], dw1[e], dw3[e] = g.T @ h, da.T @ part, db.T @ part
        dx[rows] = da @ w1[e] + db @ w3[e]
    return dx, dw1, dw2, dw3


def _grouped_backward(grad, x, counts, w1, w2, w3):
    """_experts_backward_op with the grouped kernel: 2-D x 2-D grouped products give each
    expert's weight gradient into one stack."""
    d, f = x.shape[1], w1.shape[1]
    dp, fp = _padded_dims(x, w1)
    x, grad = _pad(x, (dp,)), _pad(grad, (dp,))
    w1, w3, w2 = _pad(w1, (fp, dp)), _pad(w3, (fp, dp)), _pad(w2, (dp, fp))
    offs = counts.cumsum(0).to(torch.int32)
    a = _grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    b = _grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    h, da, db = _swiglu_grads(a, b, _grouped_mm(grad, w2, offs=offs))
    dw2 = _grouped_mm(grad.T, h, offs=offs)
    dw1, dw3 = _grouped_mm(da.T, x, offs=offs), _grouped_mm(db.T, x, offs=offs)
    dx = _grouped_mm(da, w1, offs=offs) + _grouped_mm(db, w3, offs=offs)
    return dx[:, :d], dw1[:, :f, :d], dw2[:, :d, :f], dw3[:, :f, :d]


@_experts_op.register_fake
def _(x, counts, w1, w2, w3):
    return x.new_empty(x.shape[0], w2.shape[1])


@_experts_backward_op.register_fake
def _(grad, x, counts, w1, w2, w3):
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2), torch.empty_like(w3)


def _experts_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _experts_backward(ctx, grad):
    x, counts, w1, w2, w3 = ctx.saved_tensors
    dx, dw1, dw2, dw3 = _experts_backward_op(grad.contiguous(), x, counts, w1, w2, w3)
    return dx, None, dw1, dw2, dw3


_experts_op.register_autograd(_experts_backward, setup_context=_experts_setup)


def grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    align: int | None = None,
) -> torch.Tensor:
    """w2_e(silu(w1_e x) * w3_e x) for every row of x (N, D), rows grouped by expert in order:
    counts (G,) rows for each of the G experts of w1, w3 (G, F, D) and w2 (G, D, F). Computes
    in x's compute dtype (`compute_dtype`) and returns it. `align`: rows each group starts at a
    multiple of (default: 16 bytes' worth on CUDA, none elsewhere)."""
    dtype = compute_dtype(x)
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    if x.shape[0] == 0:
        # No tokens here: an empty result that still reaches x and every weight (zero
        # gradients), so that this rank's backward runs the same collectives as its peers'
        # (the all-to-all that brought x, the weights' gradient reduction).
        return x.new_zeros(0, w2.shape[1]) + 0 * (x.sum() + w1.sum() + w2.sum() + w3.sum())
    traced = dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    if expert_kernel(x.device.type, dtype) is not None or not traced:
        return _experts_op(x.contiguous(), counts, w1, w2, w3)
    if align is None:
        align = 16 // x.element_size() if x.device.type == "cuda" else 1
    return _grouped_swiglu(x, counts, w1, w2, w3, align)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights; forward takes the token copies sorted by expert.
    `dispatch` (set by MoE.parallelize) runs them instead where they live on other ranks."""

    def __init__(self, n_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.dispatch: Callable | None = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, D) sorted by expert, counts (E,) copies per expert -> (N, D) in the same order."""
        if self.dispatch is not None:
            return self.dispatch(x, counts, self)
        return grouped_swiglu(x, counts, self.w1, self.w2, self.w3)


class Router(nn.Module):
    """Scores every expert for every token and keeps the top_k.

    softmax (Mixtral, DeepSeek-V2): weights are the softmax probabilities of the chosen experts,
    renormalised over them when `normalize`.
    sigmoid (DeepSeek-V3, Kimi K2): independent sigmoid scores; the choice is made on scores plus
    `expert_bias` (a per-expert correction moved by the load-balance rule, never by gradient),
    limited to the `topk_group` best of `n_group` expert groups (a group's score: the sum of its
    two best biased scores); the weights are the unbiased scores of the chosen, renormalised.
    The weights are then multiplied by `scale` (routed_scaling_factor).
    """

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        score_func: str = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        normalize: bool = True,
        scale: float = 1.0,
    ):
        super().__init__()
        self.n_experts, self.top_k, self.score_func = n_experts, top_k, score_func
        self.n_group, self.topk_group, self.normalize, self.scale = (
            n_group,
            topk_group,
            normalize,
            scale,
        )
        self.gate = nn.Linear(dim, n_experts, bias=False)
        if score_func == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(n_experts))
        else:
            self.expert_bias = None
        # Routed copies per expert since the engine last read and zeroed it (training only).
        self.register_buffer("load", torch.zeros(n_experts), persistent=False)

    def init_buffers(self) -> None:
        """Unbiased, no load counted (also after building on the meta device)."""
        for b in (self.expert_bias, self.load):
            if b is not None:
                b.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, D) -> weights (T, k) in x's dtype, chosen (T, k) expert ids, and the
        normalised scores (T, E) in fp32 that the balance losses use."""
        logits = self.gate(x).float()  # (T, E)
        if self.score_func == "softmax":
            scores = logits.softmax(-1)
            weights, chosen = scores.topk(self.top_k, dim=-1)
            probs = scores
        else:
            scores = logits.sigmoid()
            biased = scores + self.expert_bias.float()
            if self.n_group > 1:
                groups = biased.unflatten(-1, (self.n_group, -1))  # (T, G, E/G)
                best = groups.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, -1).indices
                keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter(-1, best, True)
                # -inf, not 0: a biased score can be negative (the bias of an overloaded
                # expert is), and must still beat every expert of a group left out.
                biased = groups.masked_fill(~keep[..., None], float("-inf")).flatten(-2)
            chosen = biased.topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, chosen)
            probs = scores / scores.sum(-1, keepdim=True)
        if self.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * self.scale).type_as(x), chosen, probs


def balance_loss(
    chosen: torch.Tensor, probs: torch.Tensor, n_experts: int, reduce: Callable
) -> torch.Tensor:
    """The Switch Transformer balance loss per group of tokens, E * sum_e f_e P_e with f_e the
    fraction of the group's routed copies that go to expert e and P_e its mean normalised score
    (1 at perfect balance), averaged over the groups.

    chosen (G, T, k), probs (G, T, E). `reduce` sums a tensor over the ranks that hold other
    tokens of the same groups (context- or tensor-parallel ranks), with gradient.
    """
    k = chosen.shape[-1]
    copies = chosen.flatten(-2)  # (G, T x k)
    counts = torch.zeros(*chosen.shape[:-2], n_experts, device=chosen.device)
    counts = counts.scatter_add(-1, copies, torch.ones_like(copies, dtype=counts.dtype))
    tokens = torch.full(chosen.shape[:-2], float(chosen.shape[-2]), device=chosen.device)
    counts, prob_sum, tokens = reduce(counts.detach()), reduce(probs.sum(-2)), reduce(tokens)
    per_group = n_experts * (counts / (tokens[..., None] * k) * prob_sum / tokens[..., None])
    return per_group.sum(-1).mean()


class _AttachLoss(torch.autograd.Function):
    """Identity on x whose backward also starts the gradient of `loss` with `scale`: an
    auxiliary loss reaches the parameters through any pipeline stage without travelling to
    the stage that computes the main loss (Megatron-LM's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def attach_loss(x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """x, whose backward also starts `loss`'s gradient with `scale` (_AttachLoss)."""
    return _AttachLoss.apply(x, loss, scale)


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class MoEParallel:
    """How the engine runs one MoE layer, set only through `MoE.parallelize`; every field's
    default is one process's behaviour."""

    # Sums a tensor over the ranks that hold other tokens of the same batch (context and
    # tensor parallelism), with gradient: the balance losses' statistics.
    reduce_split: Callable[[torch.Tensor], torch.Tensor] = _no_reduce
    # Tensor parallelism without SP: this rank's share (B, S / tp, D) of the (B, S, D) tokens
    # every tp rank holds, routed here, and the routed output of every share gathered back.
    split_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None
    gather_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Expert parallelism: (x, counts, experts) -> the experts' output where they live on other
    # ranks (dispatch, compute, combine); the experts' module calls it.
    dispatch: Callable | None = None
    # The balance losses' gradient scale (the trainer: 1 / micro-batches it averages over).
    aux_grad_scale: float = 1.0
    # Whether a training forward counts in the router's load and the balance losses' sum (off
    # for a pipeline stage's shape inference).
    count_steps: bool = True


class MoE(nn.Module):
    """Routed experts (plus shared ones) in place of a dense MLP; x (B, S, D) -> (B, S, D).

    Balance losses: `aux_loss_coef` per forward's tokens (Mixtral, Switch), `seq_aux_loss_coef`
    per sequence (DeepSeek-V3's sequence-wise loss). Their gradient is attached in backward,
    scaled by `parallel.aux_grad_scale`; their sum over forwards accumulates in `aux_loss_sum`.
    """

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        n_experts: int,
        router: Router,
        n_shared: int = 0,
        aux_loss_coef: float = 0.0,
        seq_aux_loss_coef: float = 0.0,
    ):
        super().__init__()
        self.router = router
        self.experts = GroupedExperts(n_experts, dim, ffn_dim)
        self.shared = FeedForward(dim, n_shared * ffn_dim) if n_shared else None
        self.aux_loss_coef, self.seq_aux_loss_coef = aux_loss_coef, seq_aux_loss_coef
        self.parallel = MoEParallel()
        # The balance losses' sum over training forwards since the engine last read it.
        self.aux_loss_sum = torch.zeros(())

    def init_buffers(self) -> None:
        """The balance losses' sum at zero, where the layer lives (after a meta build too)."""
        self.aux_loss_sum = torch.zeros((), device=self.router.load.device)

    def parallelize(self, **settings) -> None:
        """Change how the engine runs this layer: fields of MoEParallel (an unknown name is a
        TypeError); the others keep their values."""
        self.parallel = replace(self.parallel, **settings)
        self.experts.dispatch = self.parallel.dispatch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.parallel
        routed = self.routed(x if p.split_tokens is None else p.split_tokens(x))
        out = routed if p.gather_tokens is None else p.gather_tokens(routed)
        return out if self.shared is None else out + self.shared(x)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' part alone (tensor parallelism splits its tokens over ranks,
        not the shared experts')."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (T, D)
        weights, chosen, probs = self.router(flat)
        k = chosen.shape[-1]
        # Reorder: the T x k copies sorted by expert (stable, so each expert sees its tokens
        # in order), and how many each expert gets.
        expert_of_copy = chosen.flatten()  # (N,)
        order = expert_of_copy.argsort(stable=True)
        # (E,) counted on the device: bincount would ask the host for its output's length.
        counts = torch.zeros(self.router.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, expert_of_copy, torch.ones_like(expert_of_copy)
        )
        token = order // k  # the token of each sorted copy
        # Counted in a training forward only: not in a recomputing backward (activation
        # checkpointing runs this again; a compiled block's recompute is in its backward
        # graph, which does not replay the count), nor where the engine says the forward is
        # not a training step (count_steps off: a pipeline stage's shape inference).
        recomputing = not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1
        counting = self.training and self.parallel.count_steps and not recomputing
        if counting:
            self.router.load += counts.detach().to(self.router.load.dtype)
        y = self.experts(flat[token], counts)  # (N, D) sorted by expert
        # Combine: the copies back in token order (index_select keeps only the index for
        # backward; index_add would keep its whole source), weighted and summed per token.
        y = y.index_select(0, order.argsort()).view(*chosen.shape, -1)  # (T, k, D)
        out = (y * weights[..., None]).sum(1).type_as(flat)
        if self.training and (self.aux_loss_coef or self.seq_aux_loss_coef):
            out = self._attach_balance_loss(out, chosen, probs, shape, counting)
        return out.view(shape)

    def _attach_balance_loss(self, out, chosen, probs, shape, counting) -> torch.Tensor:
        n, loss = self.router.n_experts, torch.zeros((), device=out.device)
        if self.aux_loss_coef:
            batch = balance_loss(chosen[None], probs[None], n, self.parallel.reduce_split)
            loss = loss + self.aux_loss_coef * batch
        if self.seq_aux_loss_coef and len(shape) == 3:
            b = shape[0]
            per_seq = balance_loss(
                chosen.view(b, -1, chosen.shape[-1]),
                probs.view(b, -1, n),
                n,
                self.parallel.reduce_split,
            )
            loss = loss + self.seq_aux_loss_coef * per_seq
        if counting:
            self.aux_loss_sum = self.aux_loss_sum.to(loss.device) + loss.detach()
        return attach_loss(out, loss, self.parallel.aux_grad_scale)
