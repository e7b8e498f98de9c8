"""First per-rank memory estimate: model states by ZeRO stage and dtypes, activations, reserve.

Model states follow the ZeRO paper with the dtypes taken from config: unsharded parameters
(param_dtype), gradients (grad_dtype), a master copy when its dtype differs from param_dtype,
and two Adam moments (optimizer_dtype). Stage 1 shards the optimizer side (master + moments),
stage 2 also the gradients, stage 3 also the parameters, each over the dp_shard group.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import Config, DType, ModelConfig
from launcher.plan.model_size import ParamCounts, head_dim

GIB = 1024**3
BYTES = {DType.fp32: 4, DType.bf16: 2, DType.fp16: 2}
# Allocator fragmentation, communication buffers and the runtime (CUDA context, gloo buffers).
RESERVE_GIB = {"cuda": 3.0, "cpu": 0.5}


@dataclass(frozen=True)
class Memory:
    """Bytes on the most loaded rank."""

    params: float
    grads: float
    optimizer: float  # master weights + Adam moments
    activations: float
    other: float  # transient unsharded parameters, logits, reserve

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.other


def model_state_bytes(cfg: Config, n_params: float, shard: int) -> tuple[float, float, float]:
    """(params, grads, optimizer incl. master) bytes per rank for n_params on `shard` ranks."""
    p = cfg.precision
    param_b, grad_b = BYTES[p.param_dtype], BYTES[p.grad_dtype]
    master_b = BYTES[p.master_dtype] if p.master_dtype != p.param_dtype else 0
    optim_b = master_b + 2 * BYTES[p.optimizer_dtype]
    stage = cfg.data_parallel.zero_stage if shard > 1 else 0
    params = n_params * param_b / (shard if stage >= 3 else 1)
    grads = n_params * grad_b / (shard if stage >= 2 else 1)
    optimizer = n_params * optim_b / (shard if stage >= 1 else 1)
    return params, grads, optimizer


def activation_bytes_per_layer(m: ModelConfig, seq: int, micro: int, act_b: int) -> float:
    """Bytes one Llama block saves for backward for one micro-batch (no recompute, no TP).

    Counted tensor by tensor: the two RMSNorm inputs and outputs (4 sbh), q/k/v after RoPE and
    the attention output (sb(2 H E + 2 K E)), the SwiGLU's w1 and w3 outputs, the silu output and
    the product fed to w2 (4 sb ffn); without fused attention the softmax probabilities
    (b H s^2) and, with dropout, its mask and the residual-branch masks (1 byte each).
    """
    sb, e = seq * micro, head_dim(m)
    saved = 4 * sb * m.dim + sb * (2 * m.n_heads * e + 2 * m.n_kv_heads * e) + 4 * sb * m.ffn_dim
    total = saved * act_b
    if not m.flash_attention:
        total += micro * m.n_heads * seq * seq * act_b
        if m.dropout > 0:
            total += micro * m.n_heads * seq * seq
    if m.dropout > 0:
        total += 2 * sb * m.dim
    return total


def estimate(cfg: Config, counts: ParamCounts, dp_shard: int) -> Memory:
    """Memory of the most loaded rank with data parallelism only (later axes divide further)."""
    params, grads, optimizer = model_state_bytes(cfg, counts.total, dp_shard)
    act_b = BYTES[cfg.precision.compute_dtype]
    t, m = cfg.train, cfg.model
    activations = m.n_layers * activation_bytes_per_layer(m, t.seq_len, t.micro_batch_size, act_b)
    # Logits in the compute dtype plus their fp32 log-softmax for the loss.
    logits = t.micro_batch_size * t.seq_len * m.vocab_size * (act_b + 4)
    transient = 0.0
    if cfg.data_parallel.zero_stage >= 3 and dp_shard > 1:
        # FSDP gathers one unit while prefetching the next: two unsharded units in flight.
        transient = 2 * counts.largest_unit * BYTES[cfg.precision.param_dtype]
    reserve = RESERVE_GIB[cfg.hardware.device_type.value] * GIB
    return Memory(params, grads, optimizer, activations, logits + transient + reserve)
