"""Parameter counts and FLOPs per token, from the model config alone (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import ModelConfig


def head_dim(m: ModelConfig) -> int:
    return m.head_dim if m.head_dim is not None else m.dim // m.n_heads


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # token embedding (first pipeline stage)
    per_layer: int  # one transformer block
    head: int  # final norm + output projection (last pipeline stage)
    n_layers: int

    @property
    def total(self) -> int:
        return self.embedding + self.per_layer * self.n_layers + self.head

    @property
    def non_embedding(self) -> int:
        """Parameters that do matmul work per token (the output projection included)."""
        return self.total - self.embedding

    @property
    def largest_unit(self) -> int:
        """Largest group FSDP gathers at once: a block, or the root (embedding + head)."""
        return max(self.per_layer, self.embedding + self.head)


def llama_params(m: ModelConfig) -> ParamCounts:
    e = head_dim(m)
    attention = m.dim * m.n_heads * e * 2 + m.dim * m.n_kv_heads * e * 2  # wq, wo, wk, wv
    mlp = 3 * m.dim * m.ffn_dim  # w1, w2, w3
    norms = 2 * m.dim
    return ParamCounts(
        embedding=m.vocab_size * m.dim,
        per_layer=attention + mlp + norms,
        head=m.dim + m.dim * m.vocab_size,
        n_layers=m.n_layers,
    )


PARAM_COUNTS = {"llama": llama_params}


def param_counts(m: ModelConfig) -> ParamCounts:
    return PARAM_COUNTS[m.family](m)


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: 6 N plus causal attention.

    N counts the non-embedding parameters. Attention scores and the weighted sum each cost
    2 s H E per token per layer forward; causal masking halves that and backward doubles it,
    so 6 L H E s per token in all.
    """
    n = param_counts(m).non_embedding
    attention = 6 * m.n_layers * m.n_heads * head_dim(m) * seq_len
    return 6.0 * n + attention
