"""Per-rank memory: model states by ZeRO stage and dtype, activations, transient buffers, reserve.

Model states follow the ZeRO paper with the dtypes taken from config: parameters (param_dtype),
gradients (grad_dtype), a master copy when its dtype differs from param_dtype, and two Adam
moments (optimizer_dtype). Stage 1 shards the optimizer side (master + moments), stage 2 also
the gradients, stage 3 also the parameters, each over the sharding group.

Activations per layer and token are counted tensor by tensor (Korthikanti et al. 2022,
generalised to GQA, MLA, gated and routed MLPs): see `layer_activation_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import DType

GIB = 1024**3
BYTES = {DType.fp32: 4, DType.bf16: 2, DType.fp16: 2}


def reserve_gib(device_type: str, capacity_gib: float) -> float:
    """Allocator fragmentation, communication buffers and runtime (CUDA context, NCCL).

    CUDA: 2 GiB plus 5% of the device; CPU processes: 0.5 GiB.
    """
    return 2.0 + 0.05 * capacity_gib if device_type == "cuda" else 0.5


def state_bytes(
    n_params: float, shard: int, stage: int, param_b: int, grad_b: int, master_b: int, optim_b: int
) -> tuple[float, float, float, float]:
    """(params, grads, master, optimizer states) bytes per rank for n_params on `shard` ranks.

    master_b is 0 when the parameters themselves are the master copy; optim_b counts both Adam
    moments. ZeRO: stage >= 1 shards the optimizer side, >= 2 the gradients, 3 the parameters.
    """
    if shard <= 1:
        stage = 0
    params = n_params * param_b / (shard if stage >= 3 else 1)
    grads = n_params * grad_b / (shard if stage >= 2 else 1)
    opt_shard = shard if stage >= 1 else 1
    return params, grads, n_params * master_b / opt_shard, n_params * optim_b / opt_shard


@dataclass(frozen=True)
class Saved:
    """What one block can save for backward, per token, in elements (the widths of the model's
    Shape for a dense or an MoE block): q, k, v after their projections, the attention output
    (o), MLA's latents, the inputs of per-head norms (`normed`: Qwen3's q and k), the MLP's
    tensors, the routed experts' copies (`routed`) and the router's bytes, the heads of
    unfused attention's scores; whole_mlp: an MLP (dense, or shared experts) takes the whole
    norm output."""

    dim: int
    q: int = 0
    k: int = 0
    v: int = 0
    o: int = 0
    latent: int = 0
    normed: int = 0
    mlp: int = 0
    routed: int = 0
    routed_bytes: float = 0
    n_heads: int = 0
    whole_mlp: bool = True


@dataclass(frozen=True)
class Split:
    """How a layout splits a block's tensors: tensor parallelism over tp ranks, with sequence
    parallelism (sp; a compiled block keeps SP's gathered inputs whole: sp_keeps_gathered),
    and context parallelism over cp ranks by its method."""

    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_method: str = "allgather"
    sp_keeps_gathered: bool = False


def layer_activation_bytes(
    saved: Saved,
    split: Split,
    *,
    seq: int,
    recompute: str,
    flash: bool,
    dropout: bool,
    act_b: int,
) -> float:
    """Bytes one block saves for backward, per token of one micro-batch on one rank.

    - outside the tensor-parallel region (divided by tp only with sequence parallelism): the
      two norm inputs and outputs (4 h) and, with dropout, two 1-byte residual masks (2 h);
    - inside it (divided by tp): q, k, v after their projections (and before per-head norms,
      their inputs: `normed`), the attention output fed to the output projection, and the
      MLP's saved tensors (`mlp` elements: 2 x ffn for GeLU, its
      input and output; 3 x ffn for SwiGLU: the w1 and w3 outputs and their product fed to w2,
      silu recomputed in backward);
    - routed experts (`routed` elements: each of the top-k copies of the token, its 3 x
      moe_ffn SwiGLU tensors and output row; `routed_bytes`: the router's fp32 scores and
      int64 indices), divided by tp: each tp rank routes a tp-th of the tokens (its sequence
      shard, or a slice of the whole);
    - MLA latents (replicated over tp);
    - an MoE layer under tp without sequence parallelism routes a copied tp-th slice of the
      norm output; the whole one is kept only when shared experts take it (whole_mlp);
    - without fused attention, the softmax output (H s per token) and with dropout its mask
      (1 byte) and output: Korthikanti's 5 a s / h; selective recompute drops these;
    - full recompute keeps only the block input (h), plus one block recomputed at a time
      (added by the caller);
    - with sequence parallelism the engine, like Megatron, keeps the sequence shards of the
      norm outputs that the column-parallel projections gather, and gathers them again in
      backward. A compiled block keeps the gathered (whole-sequence) tensors instead
      (sp_keeps_gathered: 2 h, not divided by tp, in place of the shards): the hooks that
      keep the shard cannot run inside it.
    - context parallelism (cp > 1, `seq` is then this rank's S / cp) changes only what the
      attention core keeps, so only without recompute (selective recomputes the core from its
      inputs q, k, v): neither method saves a score matrix or a mask, and both save their output
      as the very tensor the output projection keeps; allgather keeps the gathered K and V of
      all cp ranks in place of this rank's ((cp - 1)(k + v) more, divided by tp: only the local
      kv heads are gathered), ring only this rank's.
    For a GPT layer with dropout in 16 bits and Megatron's SP this is Korthikanti et al.'s table:
    34 + 5 a s / h (times s b h) without parallelism, (34 + 5 a s / h) / t with TP and SP.
    """
    dim, q, k, v, o, mlp, routed = (
        saved.dim,
        saved.q,
        saved.k,
        saved.v,
        saved.o,
        saved.mlp,
        saved.routed,
    )
    tp, sp, cp = split.tp, split.sp, split.cp
    if recompute == "full":
        return dim * act_b / (tp if sp else 1)
    outside = 4 * dim * act_b + (2 * dim if dropout else 0)
    inside = (q + k + v + o + saved.normed + mlp) * act_b
    if cp > 1 and recompute == "none":
        if split.cp_method == "allgather":
            inside += (cp - 1) * (k + v) * act_b
    elif not flash and recompute != "selective":
        inside += saved.n_heads * seq * (act_b + (1 + act_b if dropout else 0))
    if sp and tp > 1 and split.sp_keeps_gathered:  # norm outputs kept whole, not as shards
        outside -= 2 * dim * act_b
        inside += 2 * dim * act_b * tp
    if routed and tp > 1 and not sp:
        # Each tp rank routes a slice of the whole norm output (a copy); the whole one is kept
        # only if an MLP takes it (shared experts: whole_mlp).
        outside += dim * act_b / tp - (0 if saved.whole_mlp else dim * act_b)
    routed_total = routed * act_b + saved.routed_bytes
    return outside / (tp if sp else 1) + (inside + routed_total) / tp + saved.latent * act_b


@dataclass(frozen=True)
class OpSaved:
    """What per-op selective recompute can keep of one block, per token, in elements: the
    outputs of the projections into heads, of the MLP's up projections and of MLA's latent
    projections, the attention output (o), the routed experts' (`routed_out`), and how many
    row-parallel output projections (wo, w2) the block has and how many the policy keeps
    (None: all)."""

    dim: int
    heads_out: int = 0
    o: int = 0
    latent_out: int = 0
    mlp_out: int = 0
    row_parallel: int = 0
    row_parallel_kept: int | None = None
    routed_out: float = 0


def op_layer_activation_bytes(
    saved: OpSaved, split: Split, *, flash: bool, act_b: int, compiled: bool = False
) -> float:
    """Bytes one block keeps for backward under per-op selective recompute (recompute=op), per
    token of one micro-batch on one rank: what the checkpoint's policy saves, nothing else.

    - the block input (the checkpoint's), a sequence shard under sequence parallelism;
    - the outputs of the matmuls: the projections into heads and the MLP's up projections
      (`heads_out`, `mlp_out`, sharded by tp), MLA's latent projections (replicated);
    - the `row_parallel` output projections (wo, w2: dim each): the outputs of the
      `row_parallel_kept` of them the policy keeps (all, or under recompute.matmuls=alternate
      those at odd places in the block's order) without tp; under tp the reductions of all
      their partial sums (all-reduce, or reduce-scatter: a shard), the partial sums themselves
      recomputed, except in `compiled` blocks, which keep the kept ones too
      (launcher/parallel/recompute.py); `heads_out` and `mlp_out` count the kept ones;
    - fused attention's output (o, sharded by tp); unfused, the core is recomputed;
    - routed experts (`routed_out` per token: each copy's up projections and output row, and
      the router's scores), their tokens split over tp.
    """
    dim, row, tp, sp = saved.dim, saved.row_parallel, split.tp, split.sp
    kept = row if saved.row_parallel_kept is None else saved.row_parallel_kept
    block_input = dim / (tp if sp else 1)
    inside = (saved.heads_out + saved.mlp_out + (saved.o if flash else 0)) / tp
    if tp == 1:
        outputs = kept * dim
    else:
        outputs = row * dim / (tp if sp else 1) + (kept * dim if compiled else 0)
    return (block_input + inside + saved.latent_out + outputs + saved.routed_out / tp) * act_b


def cp_transient_bytes(
    *,
    k: int,
    v: int,
    cp: int,
    tp: int,
    method: str,
    recompute: str,
    act_b: int,
) -> float:
    """Bytes context parallelism holds while one layer runs, beyond what it saves for backward,
    per token of this rank's micro-batch (k and v the layer's K/V widths, of which this rank
    holds 1 / tp).

    - ring: the remote K/V block being attended and the next one arriving, in the compute
      dtype, and in backward the fp32 dK/dV accumulators (the one being added to and the one
      arriving from the previous rank);
    - allgather: the gradient of the gathered K/V before it is reduce-scattered; under selective
      recompute also the regathered K/V (without recompute they are saved; under full
      recompute the recomputed block, which the caller counts, holds them).
    """
    kv = (k + v) / tp
    if method == "ring":
        return kv * (2 * act_b + 2 * 4)
    gathered = cp * kv * act_b
    if recompute == "selective":
        return 2 * gathered
    return gathered
