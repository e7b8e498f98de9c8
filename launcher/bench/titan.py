"""torchtitan's own Llama 3 as a contender of the speed benchmark: `torchtitan(w)`.

Builds torchtitan 0.3.0's `Llama3Model` of exactly the workload's shape, layer by layer as
its model registry builds a flavor (`torchtitan.models.llama3`: fused wqkv, complex RoPE
with Llama 3 scaling, its per-layer depth-scaled init tables), on the meta device, then
materialised and initialised by its own `init_weights`, as its trainer does; with compile,
each TransformerBlock goes through its own `apply_compile`. Attention is torchtitan's
`ScaledDotProductAttention` (causal), the kernel the other contenders run: 0.3.0's registry
defaults to flex attention with per-document block masks instead.

It is a fair peer because only the model code differs: same shape, parameter count and
logits for the same weights as this project's model (tests/bench/test_titan.py), and the
step is the shared `plain_loop`. What torchtitan's trainer adds around the model (FSDP2
mixed precision, chunked loss, activation checkpointing) is not measured.
"""

from __future__ import annotations

import torch

from launcher.bench.peers import Step, Workload, plain_loop
from launcher.models import families

WHEELS = "torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0"


class _NoDataParallelMeshDims:
    """Stands in for torch.distributed.fsdp.DataParallelMeshDims (torch >= 2.12), which
    torchtitan.models.llama3 imports but only its full-DTensor FSDP path uses."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("DataParallelMeshDims needs torch >= 2.12")


def _titan():
    """torchtitan's modules, or an ImportError saying what to install."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = _NoDataParallelMeshDims
    try:
        import torchtitan.models.common as common
        import torchtitan.models.llama3 as llama3
        from torchtitan.models.common import config_utils
    except ModuleNotFoundError as e:
        raise ImportError(
            f"the torchtitan contender cannot import {e.name!r}: install torchtitan and what "
            f"it imports, e.g. `pip install --no-deps --target DIR {WHEELS}` (and triton, "
            "which CUDA builds of torch bring), then put DIR on PYTHONPATH"
        ) from e
    return common, llama3, config_utils


def _config(m: dict, seq_len: int, common, llama3, config_utils, experts: bool = False):
    """Llama3Model.Config of exactly the shape in `m` (ModelConfig fields), its RoPE tables
    cut to the `seq_len` trained on, as its trainer's update_from_config cuts them. `experts`:
    the caller replaces the feed-forward by routed experts (its attention, norms and embeddings
    are then Llama's: the family's torchtitan peer is "qwen3_moe_blocks")."""
    peer = families.family(m["family"]).titan
    if peer != ("qwen3_moe_blocks" if experts else "llama3"):
        raise ValueError(
            f"torchtitan's Llama 3 cannot express model.family={m['family']} ("
            + (f"its torchtitan model is {peer})" if peer else "torchtitan has no model of it)")
        )
    if m["dropout"]:
        raise ValueError(f"torchtitan's Llama 3 cannot express dropout={m['dropout']!r}")
    if seq_len > m["max_seq_len"]:
        raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={m['max_seq_len']}")
    dim, n_heads, vocab = m["dim"], m["n_heads"], m["vocab_size"]
    head_dim = m["head_dim"] or dim // n_heads
    factor = m["rope_scaling_factor"]
    rope = common.ComplexRoPE.Config(
        dim=head_dim,
        max_seq_len=seq_len,  # one table per layer: 131072 rows would be 34 MB each at 1B
        theta=m["rope_theta"],
        scaling="none" if factor == 1.0 else "llama",
        scaling_factor=factor,
        low_freq_factor=m["rope_low_freq_factor"],
        high_freq_factor=m["rope_high_freq_factor"],
        original_max_position_embeddings=m["rope_original_max_seq_len"],
    )
    norm = {"normalized_shape": dim, "eps": m["norm_eps"], "param_init": llama3._NORM_INIT}
    layers = [
        llama3.Llama3TransformerBlock.Config(
            attention_norm=common.RMSNorm.Config(**norm),
            ffn_norm=common.RMSNorm.Config(**norm),
            attention=config_utils.make_gqa_config(
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=m["n_kv_heads"],
                head_dim=m["head_dim"],  # None: dim // n_heads, as its flavors leave it
                wqkv_param_init=llama3._LINEAR_INIT,
                wo_param_init=llama3._depth_init(i),
                inner_attention=common.ScaledDotProductAttention.Config(),
                fuse_qkv=True,
                rope=rope,
            ),
            feed_forward=config_utils.make_ffn_config(
                dim=dim,
                hidden_dim=m["ffn_dim"],  # the exact SwiGLU width, no rounding
                w1_param_init=llama3._LINEAR_INIT,
                w2w3_param_init=llama3._depth_init(i),
            ),
        )
        for i in range(m["n_layers"])
    ]
    tied = m["tie_embeddings"]
    return llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=tied,
        tok_embeddings=common.Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init=llama3._EMBEDDING_SKIP_INIT if tied else llama3._EMBEDDING_INIT,
        ),
        norm=common.RMSNorm.Config(**norm),
        lm_head=common.Linear.Config(
            in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)
        ),
        layers=layers,
    )


def materialise(config, w: Workload) -> torch.nn.Module:
    """The model of a torchtitan `config` as its trainer makes one: built on the meta device,
    with w.compile each block compiled by its apply_compile (as its parallelize functions do:
    after building, before materialising; one process), then materialised on w.device and
    initialised by its own init_weights; in training mode. (Its apply_compile also sets
    dynamo's capture_scalar_outputs for the whole process.)"""
    with torch.device("meta"):
        model = config.build()
    if w.compile:
        from torchtitan.config import CompileConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.compile import apply_compile

        one = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
        apply_compile(model, compile_config=CompileConfig(enable=True), parallel_dims=one)
    model.to_empty(device=w.device)
    torch.manual_seed(w.train.seed)
    with torch.no_grad():
        model.init_weights(buffer_device=w.device)
    return model.train()


def build(w: Workload) -> torch.nn.Module:
    """torchtitan's Llama3Model for `w`, initialised on w.device (compiled blocks with
    w.compile), in training mode."""
    common, llama3, config_utils = _titan()
    return materialise(_config(w.model, w.micro[0][0].shape[1], common, llama3, config_utils), w)


def torchtitan(w: Workload) -> Step:
    """torchtitan's Llama 3 of the workload's shape in the plain loop."""
    model = build(w)

    def forward(x: torch.Tensor) -> torch.Tensor:
        # As its trainer calls a maskless backend: no attention masks, and no positions, so
        # each row is one sequence at 0..S-1 (the causal triangle, as for the other contenders).
        return model(x)  # (B, S, V) logits

    return plain_loop(model, w, forward)
