"""The model's fields, with their defaults: declared here once (no torch).

`model=NAME` presets (conf/model/) and overrides set them; each family's Args dataclass
(launcher/models/llama.py, ...) declares which of them its model reads, without defaults of its own,
and `models.build` refuses a field that is not one of these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    name: str = "llama3_debug"
    family: str = "llama"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int | None = None  # None: dim // n_heads
    ffn_dim: int = 768
    vocab_size: int = 320
    max_seq_len: int = 2048
    rope_theta: float = 500000.0
    # Llama 3 "llama3" RoPE frequency scaling; factor 1.0 turns it off.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    norm_eps: float = 1e-5
    dropout: float = 0.0
    # True: fused scaled-dot-product attention (no score matrices saved for backward).
    flash_attention: bool = True
    tie_embeddings: bool = False  # output projection shares the embedding matrix (gpt)
    # Mixture of experts (mixtral, deepseek); n_routed_experts=0 means a dense model.
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    top_k: int = 0
    moe_ffn_dim: int = 0
    n_dense_layers: int = 0  # the first layers keep a dense MLP of ffn_dim
    # Routing (launcher/models/moe.py): softmax top-k (Mixtral, DeepSeek-V2) or sigmoid scores with
    # a per-expert correction bias and group-limited choice (DeepSeek-V3, Kimi K2).
    score_func: str = "softmax"
    n_group: int = 1  # expert groups; a token's experts come from its topk_group best groups
    topk_group: int = 1
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    # Load balance: the Switch balance loss per micro-batch (Mixtral) and per sequence
    # (DeepSeek-V3's sequence-wise loss), and V3's auxiliary-loss-free bias update: after each
    # step every expert's bias moves by bias_update_speed towards the mean load.
    aux_loss_coef: float = 0.0
    seq_aux_loss_coef: float = 0.0
    bias_update_speed: float = 0.0
    # YaRN RoPE scaling (deepseek; transformers' rope_type "yarn"); a factor of 0 or 1 turns it
    # off. Frequencies that turn fewer than beta_slow times over the original length are
    # divided by the factor, more than beta_fast kept, a linear blend between. With
    # mscale(f, m) = 0.1 m ln f + 1, the rotated q/k parts are scaled by mscale(factor, mscale)
    # / mscale(factor, mscale_all_dim) (by mscale(factor, 1) unless both are set, as in
    # transformers) and the softmax by mscale(factor, mscale_all_dim)^2. 0: unset.
    rope_yarn_factor: float = 1.0
    rope_yarn_original_max_seq_len: int = 4096
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 0.0
    rope_yarn_mscale_all_dim: float = 0.0
    # Multi-head latent attention (deepseek); kv_lora_rank=0 means standard attention.
    q_lora_rank: int = 0  # 0: queries projected directly from dim
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Multi-token prediction (deepseek; the DeepSeek-V3 report's section 2.2): mtp_depth more
    # modules after the last block, the k-th predicting the token k + 1 ahead from the one
    # before it and the embedding of the token k ahead, through one block of its own; the
    # embedding and the output head are the model's. Their mean loss, times mtp_loss_weight,
    # is added to the next-token loss in training, and times mtp_loss_weight_after once the
    # run has trained on mtp_loss_weight_switch_tokens tokens (0: never; V3: 0.3 for its
    # first 10T tokens, then 0.1). Generation and evaluation use the model without them.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    mtp_loss_weight_after: float = 0.1
    mtp_loss_weight_switch_tokens: int = 0
