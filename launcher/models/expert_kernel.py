"""Where the routed experts run as torch's grouped matmul, and why not elsewhere: one rule for
the model (launcher/models/moe.py, at run time) and the planner (which prices the per-expert loop
that runs instead). No torch import: the planner reads it without torch."""

from __future__ import annotations


def loop_reason(device_type: str, dtype: str, has_grouped_mm: bool = True) -> str | None:
    """Why the experts run one at a time on `device_type` computing in `dtype` ("bf16",
    "fp32", "fp16", or torch's name), None where the grouped kernel runs them: a torch
    without it, CUDA's kernel (bf16 only), or a dtype no kernel takes (CPU: 16- and 32-bit
    floats). Compiled blocks call the kernel too (launcher/models/moe.py: eagerly where the compiler
    cannot trace it)."""
    name = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)
    if not has_grouped_mm:
        return "this torch has no grouped matmul"
    if name != "bf16" and device_type == "cuda":
        return f"CUDA's grouped matmul takes bf16 only, the experts compute in {name}"
    if name not in ("bf16", "fp32", "fp16"):
        return f"torch's grouped matmul takes 16- and 32-bit floats, the experts compute in {name}"
    return None
