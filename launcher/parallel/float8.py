"""precision.fp8: the transformer blocks' linear layers compute in float8 through torchao's
float8 training (torchao.float8), as torchtitan's FP8 runs do.

Each block linear becomes a Float8Linear holding the same weight Parameter (so the names,
the initial values, the checkpoints and the optimizer see nothing new): its forward casts the
input and the weight to float8_e4m3 with dynamic scales (one per tensor, or per row), its
backward the output gradient to float8_e5m2, and the three matmuls run as float8 GEMMs whose
outputs come back in the compute dtype. Embeddings, the output head, norms, the MoE router and
the grouped experts (3-D parameters, not nn.Linear) stay in the compute dtype; so does a linear
whose sides are not both multiples of 16 (the float8 GEMM's tile: DeepSeek's wkv_a at debug
size). On CPU the GEMMs are emulated (the same casts, the matmul in the input dtype).

Applied first, on the meta device, before every axis (parallelize), as torchtitan applies its
model converters before parallelizing.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import replace

from torch import nn

# A float8 GEMM's sides must be multiples of this (torch._scaled_mm).
FLOAT8_ALIGN = 16


def block_linear(module: nn.Module, fqn: str) -> bool:
    """Whether the module `fqn` is a block linear that computes in float8 (tests/test_fp8.py
    holds the conversion to it, family by family)."""
    parts = fqn.split(".")
    return (
        isinstance(module, nn.Linear)
        and parts[0] == "layers"
        and "router" not in parts
        and module.in_features % FLOAT8_ALIGN == 0
        and module.out_features % FLOAT8_ALIGN == 0
    )


@contextmanager
def quiet_torchao():
    """Around torchao's first import: it warns that its C++ extensions (not used by float8
    training) do not match this torch, and makes torch warn about an enum it registers; noise
    in a run's log, quieted. (transformers imports torchao too, where installed, when it
    builds a model: launcher.bench's peer.)"""
    noisy = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in noisy]
    for log in noisy:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(noisy, levels, strict=True):
            log.setLevel(level)


def float8_config(scaling: str, emulate: bool):
    """torchao's recipe for `scaling` (tensorwise | rowwise), emulated where the device has no
    float8 GEMM (CPU)."""
    # torchao is imported only where precision.fp8 is set: it takes ~3 s.
    with quiet_torchao():
        from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(scaling)
    return replace(config, emulate=emulate)


def apply_float8(model: nn.Module, scaling: str, emulate: bool) -> None:
    """Swap `model`'s block linears for Float8Linear in place."""
    config = float8_config(scaling, emulate)  # first: it quiets torchao's import
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, config=config, module_filter_fn=block_linear)
