"""DeepSeek-V2 / V3 (and Kimi K2): multi-head latent attention (MLA) with a decoupled RoPE key,
YaRN RoPE scaling, and fine-grained routed + shared experts after the first dense layers.

MLA compresses keys and values into one latent per token: kv_lora_rank values, RMS-normed and
expanded per head into a key part without position (nope) and a value. Position lives in a
separate qk_rope_head_dim-wide key that all heads share, rotated by RoPE, concatenated to
each head's nope key; queries (optionally through their own latent) get both parts too. The
blocks are Llama's (pre-norm, residual) with this attention, a dense SwiGLU MLP in the first
n_dense_layers and a models.moe.MoE after. Plain torch, no distributed import.

Shapes: B batch, S sequence, D dim, H heads, Q q_lora_rank, C kv_lora_rank, N qk_nope_head_dim,
R qk_rope_head_dim, V v_head_dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from launcher.models.layers import IGNORE, AttentionCore, RMSNorm, apply_rope, rope_table
from launcher.models.llama import LlamaArgs, Transformer, TransformerBlock
from launcher.models.moe import MoE, Router, attach_loss

# The latent norms' epsilon: DeepSeek's reference code and transformers' both build them with
# their default, whatever rms_norm_eps the block norms use.
LATENT_NORM_EPS = 1e-6


@dataclass(kw_only=True)
class DeepSeekArgs(LlamaArgs):
    """The model config fields this family reads (their defaults: launcher/models/config.py)."""

    n_routed_experts: int
    n_shared_experts: int
    top_k: int
    moe_ffn_dim: int
    n_dense_layers: int
    score_func: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    aux_loss_coef: float
    seq_aux_loss_coef: float
    q_lora_rank: int  # 0: queries projected directly from dim (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # YaRN (launcher/models/config.py says what each does); factor <= 1: plain RoPE.
    rope_yarn_factor: float
    rope_yarn_original_max_seq_len: int
    rope_yarn_beta_fast: float
    rope_yarn_beta_slow: float
    rope_yarn_mscale: float
    rope_yarn_mscale_all_dim: float
    mtp_depth: int
    mtp_loss_weight: float


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(args: DeepSeekArgs) -> torch.Tensor:
    """Inverse frequencies (R/2,) of the rotated key/query part, with YaRN's scaling: the
    pairs whose wavelength fits the original length many times (above beta_fast turns) keep
    their frequency, the slow ones (below beta_slow turns) are divided by the factor, and a
    linear ramp over the pair index blends the ones between."""
    r, theta = args.qk_rope_head_dim, args.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    factor = args.rope_yarn_factor
    if factor <= 1:
        return inv_freq.float()
    old_len = args.rope_yarn_original_max_seq_len

    def pair_index(turns: float) -> float:  # the pair that turns `turns` times over old_len
        return r * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_index(args.rope_yarn_beta_fast)), 0)
    high = min(math.ceil(pair_index(args.rope_yarn_beta_slow)), r - 1)
    ramp = (torch.arange(r // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
    ramp = ramp.clamp(0, 1)  # 0: keep, 1: divide by factor
    return (inv_freq / factor * ramp + inv_freq * (1 - ramp)).float()


def yarn_scales(args: DeepSeekArgs) -> tuple[float, float]:
    """(scale of the rotated parts' cos and sin, multiplier of the softmax scale): YaRN's
    attention temperature, as transformers applies it."""
    factor, m, m_all = args.rope_yarn_factor, args.rope_yarn_mscale, args.rope_yarn_mscale_all_dim
    if factor <= 1:
        return 1.0, 1.0
    # The ratio only when both are set; otherwise mscale(factor, 1), whatever one is set.
    rotated = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else None
    return rotated or yarn_mscale(factor), yarn_mscale(factor, m_all) ** 2  # m_all 0: 1


class MLAttention(nn.Module):
    """Multi-head latent attention; x (B, S, D) -> (B, S, D), called as Llama's Attention."""

    def __init__(self, args: DeepSeekArgs):
        super().__init__()
        self.nope_dim, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim, self.kv_rank = args.v_head_dim, args.kv_lora_rank
        h, qk = args.n_heads, args.qk_nope_head_dim + args.qk_rope_head_dim
        self.q_latent = args.q_lora_rank > 0
        if self.q_latent:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, h * qk, bias=False)
        else:
            self.wq = nn.Linear(args.dim, h * qk, bias=False)
        # The kv latent and the shared rotated key, in one projection: (C + R) rows.
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        # The rotated key, one for all heads: a named point so that an engine splitting the
        # heads over ranks can sum its gradient over them (nothing else here needs that).
        self.shared_key = nn.Identity()
        self.wkv_b = nn.Linear(
            args.kv_lora_rank, h * (args.qk_nope_head_dim + args.v_head_dim), bias=False
        )
        self.wo = nn.Linear(h * args.v_head_dim, args.dim, bias=False)
        self.core = AttentionCore(args.dropout, args.flash_attention)
        # The core scales by 1/sqrt(N + R); YaRN's softmax temperature is folded into q.
        self.q_scale = yarn_scales(args)[1]

    def qk_clip_rows(self, gamma: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """QK-clip of MLA as Kimi K2 writes it, scaling each head's logits by gamma (H,): the
        head's own query and key parts (q_nope's and k_nope's rows) by sqrt(gamma), its
        rotated query (q_rope's rows) by gamma, the rotated key shared by every head untouched."""
        n, r, root = self.nope_dim, self.rope_dim, gamma.sqrt()[:, None]
        query = torch.cat([root.expand(-1, n), gamma[:, None].expand(-1, r)], dim=1)
        key = torch.cat([root.expand(-1, n), torch.ones_like(root).expand(-1, self.v_dim)], 1)
        wq = self.wq_b if self.q_latent else self.wq
        return [(wq.weight, query.reshape(-1)), (self.wkv_b.weight, key.reshape(-1))]

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rope: the whole (S_max, 2, R) table without positions or documents, else exactly
        their angles."""
        b, s, _ = x.shape
        n, r = self.nope_dim, self.rope_dim
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_latent else self.wq(x)
        q_nope, q_rope = q.view(b, s, -1, n + r).split([n, r], dim=-1)  # (B, S, H, N), (..., R)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, r], dim=-1)  # (B, S, C), (B, S, R)
        k_rope = self.shared_key(k_rope)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, -1, n + self.v_dim)  # (B, S, H, N + V)
        k_nope, v = kv.split([n, self.v_dim], dim=-1)
        # A copy of its own: backward then keeps H x V values per token for v, not the whole
        # (N + V)-wide up-projection it is a view of (k_nope is copied by the cat below).
        v = v.contiguous()
        angles = rope[:s] if positions is None and documents is None else rope
        q_rope = apply_rope(q_rope, angles)
        k_rope = apply_rope(k_rope.unsqueeze(2), angles)  # (B, S, 1, R): one for every head
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, S, H, N + R)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.core(q, k, v, positions, documents)  # (B, H, S, V)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # (B, S, D)


class PredictionDepth(nn.Module):
    """One multi-token-prediction module (the DeepSeek-V3 report, section 2.2): position i's
    hidden state from the depth before and the embedding of the token k ahead, each
    RMS-normed, concatenated (the embedding first, as the released checkpoint's eh_proj
    expects: vLLM and Megatron-Core concatenate so), projected back to dim and through one
    block; `norm` is the norm before the shared output head (HF: shared_head.norm).
    Returns (its hidden state, which the next depth reads; that state normed for the head)."""

    def __init__(self, args: DeepSeekArgs, block: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.block = block

    def forward(self, h, embedded, rope, positions=None, documents=None):
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        h = self.block(x, rope, positions, documents)
        return h, self.norm(h)


class DeepSeek(Transformer):
    def __init__(self, args: DeepSeekArgs):
        super().__init__(args)
        # The prediction depths' blocks are numbered after the model's (HF: layer n_layers + k).
        self.mtp = nn.ModuleDict(
            {
                str(k): PredictionDepth(args, self.make_block(args, args.n_layers + k))
                for k in range(args.mtp_depth)
            }
        )
        # Each depth's mean loss, summed over the training forwards since the engine read it.
        self.mtp_loss_sum = torch.zeros(max(args.mtp_depth, 1))
        # The gradient scale of the attached loss (the trainer: 1 / micro-batches).
        self.mtp_grad_scale = 1.0
        # The whole sequence's length where this rank holds part of it (context parallelism:
        # the trainer sets it), so that each rank's share of a depth's mean is over the whole
        # sequence's positions with a target; None: the sequence given is whole.
        self.mtp_whole: int | None = None
        # The depths' loss weight now (the trainer moves it to mtp_loss_weight_after).
        self.mtp_weight = args.mtp_loss_weight
        # Whether a training forward adds to mtp_loss_sum (off for a pipeline stage's shape
        # inference, as models.moe's count_steps).
        self.count_steps = True

    def forward(self, tokens, positions=None, documents=None, future=None) -> torch.Tensor:
        """As Transformer.forward; future (B, S, mtp_depth + 1) (layers.future_tokens) in training:
        the prediction depths' loss is attached to the logits (its gradient starts in their
        backward) and each depth's value summed into mtp_loss_sum."""
        h, rope = self.features(tokens, positions, documents)
        if self.output is None:
            return h
        logits = self.output(h)
        if future is None or not len(self.mtp) or not self.training:
            return logits
        losses = []
        whole = self.mtp_whole or h.shape[1]
        for k, depth in enumerate(self.mtp.values()):
            embedded = self.tok_embeddings(future[..., k].clamp(min=0))  # t_{i+k+1}
            h, normed = depth(h, embedded, rope, positions, documents)
            ahead = self.output(normed).flatten(0, 1).float()
            target = future[..., k + 1].flatten()  # t_{i+k+2}; IGNORE past the end
            total = F.cross_entropy(ahead, target, ignore_index=IGNORE, reduction="sum")
            # The mean over the whole sequence's positions that have a target (k + 1 fewer
            # than it has): each context-parallel rank's share of it.
            losses.append(total / target.numel() * (whole / (whole - k - 1)))
        losses = torch.stack(losses)
        value = losses.detach()  # a replicated DTensor under loss parallelism: its value
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        if self.count_steps:
            self.mtp_loss_sum = self.mtp_loss_sum.to(value.device) + value
        weight = self.mtp_weight / len(losses)
        return attach_loss(logits, weight * losses.sum(), self.mtp_grad_scale)

    def as_stage(self, first: bool, last: bool) -> None:
        """As Transformer's, and the prediction depths on the last stage, which keeps a copy of
        the token table too (they embed the tokens ahead with it: pipeline_tied)."""
        super().as_stage(first or (last and len(self.mtp) > 0), last)
        if not last:
            self.mtp = nn.ModuleDict()

    def pipeline_tied(self) -> tuple[str, str] | None:
        if len(self.mtp):
            return "tok_embeddings.weight", "tok_embeddings.weight"
        return super().pipeline_tied()

    def blocks(self) -> list[tuple[int, nn.Module]]:
        n = self.args.n_layers
        return [*super().blocks(), *((n + int(k), d.block) for k, d in self.mtp.items())]

    def set_block(self, index: int, block: nn.Module) -> None:
        if index < self.args.n_layers:
            super().set_block(index, block)
        else:
            self.mtp[str(index - self.args.n_layers)].block = block

    def init_buffers(self) -> None:
        super().init_buffers()
        self.mtp_loss_sum = torch.zeros_like(self.mtp_loss_sum, device=self.rope.device)

    def make_block(self, args: DeepSeekArgs, index: int) -> nn.Module:
        attention = MLAttention(args)
        if index < args.n_dense_layers:  # a dense SwiGLU MLP of ffn_dim
            return TransformerBlock(args, attention=attention)
        router = Router(
            args.dim,
            args.n_routed_experts,
            args.top_k,
            score_func=args.score_func,
            n_group=args.n_group,
            topk_group=args.topk_group,
            normalize=args.norm_topk_prob,
            scale=args.routed_scaling_factor,
        )
        moe = MoE(
            args.dim,
            args.moe_ffn_dim,
            args.n_routed_experts,
            router,
            n_shared=args.n_shared_experts,
            aux_loss_coef=args.aux_loss_coef,
            seq_aux_loss_coef=args.seq_aux_loss_coef,
        )
        return TransformerBlock(args, feed_forward=moe, attention=attention)

    def make_rope(self) -> torch.Tensor:
        """(S_max, 2, R): the rotated part's table, YaRN-scaled frequencies and magnitude."""
        scale, _ = yarn_scales(self.args)
        return rope_table(yarn_frequencies(self.args), self.args.max_seq_len, scale)
