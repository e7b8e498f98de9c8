"""How fast a device runs a step's kernels: each GEMM at an efficiency set by its shape, the
attention core, the memory-bound work between them at the device's memory bandwidth, and the
host's time per operator.

The constants and where they come from:
- EFFICIENCY_MAX, EFFICIENCY_DIM: a GEMM runs at EFFICIENCY_MAX x w / (w + EFFICIENCY_DIM) of
  peak, w its narrowest dimension as this rank runs it (a tp shard's width, the tokens an
  expert receives). Fitted to the Megatron-LM table (A100, docs/sources.md) by `python -m
  launcher.plan.calibrate`; the attention core runs at EFFICIENCY_MAX, or at the hardware
  preset's attention_efficiency where the fused kernel's own rate on the part is known (the
  Hopper presets: docs/sources.md, "Hardware").
- What compiling gains beyond the fused memory-bound work and the fewer launches counted below
  is the hardware preset's `compile_factor`, fitted per part with its efficiency_scale
  (`python -m launcher.plan.calibrate --hopper`).
- ELEMENTWISE (each family record's `elementwise`, launcher/models/families.py; ELEMENTWISE_SCORES):
  bytes the non-matmul operators of one block read and write per token, forward and backward,
  counted on this engine's own blocks with a TorchDispatchMode over every ATen operator other than
  matmuls, attention and views (llama3_debug at dim 128 and 256, FFN 384 and 768; gpt_debug at
  sequence 128 and 256): elements per token = a x dim + b x MLP hidden width (+ c x heads x sequence
  where attention is unfused), counted at the compute dtype. Compiled blocks fuse chains of them: a
  third of the traffic (an assumption).
- OPS: ATen operators per block, forward and backward (the same count): 187 for a dense llama
  block, 182 for gpt, 273 for a mixtral block, 36 for the embedding, head and loss. Compiled
  blocks launch about a tenth as many (an assumption).
- Loss traffic: bytes moved per logit element by the loss's forward and backward, counted with a
  TorchDispatchMode over launcher.training.trainer.loss_fn (bf16 logits: the cast to fp32, 2 + 4;
  the log-softmax, 4 + 4; nll_loss's backward, 8; log-softmax's backward, 12; the cast back, 4 + 2;
  40 in all, 28 for fp32 logits, which need no cast). Compiled, one fused pass reads the logits
  forward and one reads them and writes their gradient backward: 3 x the compute dtype's bytes. On
  an H200, compiling the loss made Llama 3.2 1B's step at 8,192 tokens 45 ms (7%) faster.
- MOE_BYTES: bytes an MoE layer's routed path moves per token, forward and backward, outside its
  GEMMs and SwiGLU: per routed copy and dim (gathering each token's copies in expert order,
  putting them back, weighting and summing them) and per token and routed expert (the
  router's fp32 scores, top-k and balance statistics). Counted with a TorchDispatchMode over
  launcher/models/moe.py's layer under bf16 autocast (T 256-512, D 64-128, E 8-32, top-k 2-4, F
  64-128; least squares, residuals within 5%); the same fit gave 32 bytes per copy and FFN
  unit (ELEMENTWISE's 16 elements in bf16) and 33 per stack element (the three stacks' casts
  to bf16 and their gradients' back, 36 by count).
- OPS_PER_EXPERT: operators per expert of the per-expert loop (launcher/models/moe.py, where no
  grouped kernel runs), forward and backward, counted from the code: 6 + 25.
- FP8_CAST_BYTES: bytes torchao's float8 linear (precision.fp8) moves outside its three GEMMs,
  forward and backward: each operand's amax, scale and cast to float8, done twice (the input and
  the weight again in backward, whose autograd saves them in bf16; the output gradient once per
  GEMM it feeds). Per element of the input and of the output, per token: 66; per weight element,
  per micro-batch: 72 (fp32 weights under autocast). Counted with a TorchDispatchMode over a
  Float8Linear's forward and backward under bf16 autocast (emulated, so the GEMMs' own
  operators are not seen; tokens 256-1024, sides 64-256: exact for tensorwise, within 1% for
  rowwise). Compiled, a third of it, as ELEMENTWISE_COMPILED.
- FP8_ROWWISE: a rowwise-scaled float8 GEMM's speed relative to a tensorwise one, fitted to this
  engine's pair of Llama 3.2 1B runs on one H200 that differ in precision.fp8 alone
  (`calibrate --hopper`).
- CP_ATTENTION_SLOWDOWN: the attention core's time over cp >= 4 ranks against the same FLOPs
  unsplit, fitted to torchtitan's Llama 3.1 8B FP8 run at sequence 128K on CP 4 and held to its
  256K run on CP 8 (`calibrate --published`; docs/sources.md): its 64K run on CP 2 lands with the
  rows without CP, its CP 4 and CP 8 runs about 1.6 times slower than their attention FLOPs
  price, the same at both degrees, where each rank attends the same 16K-token chunks; so from
  cp 4 on, not at 2.
- DTENSOR_HOST: an operator of a tensor-parallel block costs the host this many times a plain
  one, every operator of the block counted as a DTensor one: (t * 2 + 1).sum() forward and
  backward on a replicated 64 x 64 DTensor took 141 us against 31.4 us on a plain tensor (one
  process of torchrun, one thread, gloo, on the 2-core CPU machine).
"""

from __future__ import annotations

EFFICIENCY_MAX = 0.698
EFFICIENCY_DIM = 220.0

ELEMENTWISE_SCORES = 19.4  # per score of unfused attention (softmax, mask, dropout)
ELEMENTWISE_COMPILED = 1 / 3

MOE_BYTES = (104.0, 137.0)  # per routed copy and dim, per token and routed expert

OPS_DENSE, OPS_MOE, OPS_OUTSIDE = 187, 273, 36
OPS_PER_EXPERT = 31
OPS_COMPILED = 0.1
DTENSOR_HOST = 4.5

# The attention core over cp >= CP_SLOW_FROM ranks runs CP_ATTENTION_SLOWDOWN times slower than
# the same FLOPs unsplit (see above).
CP_SLOW_FROM = 4
CP_ATTENTION_SLOWDOWN = 1.67

FP8_CAST_BYTES = (66.0, 72.0)  # per input or output element and token, per weight element
FP8_ROWWISE = 0.631


def loss_traffic_bytes(act_b: float, compiled: bool) -> float:
    """Bytes moved per logit element by the loss, forward and backward (see above)."""
    if compiled:
        return 3 * act_b
    return 28.0 if act_b >= 4 else 2 * act_b + 36.0


def gemm_efficiency(width: float, scale: float) -> float:
    """Fraction of peak a GEMM sustains whose narrowest dimension is `width`."""
    return EFFICIENCY_MAX * scale * width / (width + EFFICIENCY_DIM)


def model_efficiency(dim: int, scale: float) -> float:
    """The efficiency of a whole block of width `dim` without tensor parallelism (its GEMMs'
    narrowest dimension): the figure the report shows as the model's."""
    return gemm_efficiency(dim, scale)
