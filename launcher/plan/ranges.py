"""The range of every numeric setting, as data: finite, its sign, its bounds.

`RANGES` maps each numeric key of the schema (launcher/config.py) to the values it may take;
`range_problems` checks a config against it before any other rule reads the values (a
dimension of 0 or a NaN learning rate would otherwise crash a later rule, or train into
nonsense). tests/plan/test_ranges.py holds the table to the schema: a numeric setting added
without a range fails it. The parallel degrees are checked by rules.resolve_degrees, which
knows that dp_shard=-1 means "the rest of the world".
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

from launcher.config import Config


@dataclass(frozen=True)
class Range:
    """low <= value <= high (strict where `open_low` / `open_high`); None: unbounded."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    why: str = ""

    def __post_init__(self):
        # The planner checks every setting on every plan: the comparison is worked out once.
        # An unbounded end is a strict infinite one, which NaN and the infinities fail.
        object.__setattr__(self, "_low", -math.inf if self.low is None else self.low)
        object.__setattr__(self, "_high", math.inf if self.high is None else self.high)
        object.__setattr__(self, "_strict_low", self.open_low or self.low is None)
        object.__setattr__(self, "_strict_high", self.open_high or self.high is None)

    def holds(self, v: float) -> bool:
        """Inside, and finite: NaN fails every comparison, an infinity the open unbounded end."""
        return (v > self._low if self._strict_low else v >= self._low) and (
            v < self._high if self._strict_high else v <= self._high
        )

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.open_low else "[", ")" if self.open_high else "]"
            text = f"in {left}{self.low:g}, {self.high:g}{right}"
        elif self.low is not None:
            text = f"{'>' if self.open_low else '>='} {self.low:g}"
        elif self.high is not None:
            text = f"{'<' if self.open_high else '<='} {self.high:g}"
        else:
            text = "finite"
        return text + (f" ({self.why})" if self.why else "")


def at_least(low: float, why: str = "") -> Range:
    return Range(low=low, why=why)


def above(low: float, why: str = "") -> Range:
    return Range(low=low, open_low=True, why=why)


POSITIVE = at_least(1)
COUNT = at_least(0)
FRACTION = Range(0, 1, open_high=True)

RANGES: dict[str, Range] = {
    # model
    "model.dim": POSITIVE,
    "model.n_layers": POSITIVE,
    "model.n_heads": POSITIVE,
    "model.n_kv_heads": POSITIVE,
    "model.head_dim": at_least(1, "unset: dim // n_heads"),
    "model.ffn_dim": POSITIVE,
    "model.vocab_size": POSITIVE,
    "model.max_seq_len": POSITIVE,
    "model.rope_theta": above(0, "the RoPE base"),
    "model.rope_scaling_factor": at_least(1, "1 turns Llama 3 scaling off"),
    "model.rope_low_freq_factor": above(0),
    "model.rope_high_freq_factor": above(0),
    "model.rope_original_max_seq_len": POSITIVE,
    "model.norm_eps": above(0, "RMSNorm / LayerNorm divide by sqrt(mean + eps)"),
    "model.dropout": FRACTION,
    "model.n_routed_experts": COUNT,
    "model.n_shared_experts": COUNT,
    "model.top_k": COUNT,
    "model.moe_ffn_dim": COUNT,
    "model.n_dense_layers": COUNT,
    "model.n_group": POSITIVE,
    "model.topk_group": POSITIVE,
    "model.routed_scaling_factor": above(0),
    "model.aux_loss_coef": COUNT,
    "model.seq_aux_loss_coef": COUNT,
    "model.bias_update_speed": COUNT,
    "model.rope_yarn_factor": at_least(0, "0 or 1 turn YaRN off"),
    "model.rope_yarn_original_max_seq_len": POSITIVE,
    "model.rope_yarn_beta_fast": above(0),
    "model.rope_yarn_beta_slow": above(0),
    "model.rope_yarn_mscale": COUNT,
    "model.rope_yarn_mscale_all_dim": COUNT,
    "model.q_lora_rank": COUNT,
    "model.kv_lora_rank": COUNT,
    "model.qk_nope_head_dim": COUNT,
    "model.qk_rope_head_dim": COUNT,
    "model.v_head_dim": COUNT,
    "model.mtp_depth": COUNT,
    "model.mtp_loss_weight": COUNT,
    "model.mtp_loss_weight_after": COUNT,
    "model.mtp_loss_weight_switch_tokens": COUNT,
    # hardware
    "hardware.nodes": POSITIVE,
    "hardware.devices_per_node": POSITIVE,
    "hardware.memory_gib": above(0),
    "hardware.peak_tflops": above(0),
    "hardware.peak_tflops_fp8": at_least(0, "0: the part has no FP8 units"),
    "hardware.intra_node_gbps": above(0),
    "hardware.inter_node_gbps": above(0),
    "hardware.storage_gbps": above(0),
    "hardware.memory_gbps": above(0),
    "hardware.collective_latency_us": COUNT,
    "hardware.intra_node_hop_us": COUNT,
    "hardware.inter_node_hop_us": COUNT,
    "hardware.op_overhead_us": COUNT,
    "hardware.microbatch_overhead_us": COUNT,
    "hardware.efficiency": Range(0, 1, why="a fraction of peak_tflops; 0: the Megatron-LM fit"),
    "hardware.efficiency_scale": above(0, "this generation's efficiency relative to the A100 fit"),
    "hardware.compile_factor": above(0, "what compiled kernels gain on this part"),
    "hardware.efficiency_scale_fp8": above(0, "float8 GEMMs' share of the fp8 peak"),
    "hardware.attention_efficiency": Range(
        0, 1, why="a fraction of peak_tflops; 0: as the part's widest GEMM"
    ),
    # layout details (the degrees: rules.resolve_degrees)
    "data_parallel.zero_stage": Range(0, 3, why="0 DDP, 1-2 ZeRO, 3 FSDP"),
    "pipeline.microbatches": at_least(0, "0: global batch / (micro-batch x dp)"),
    "pipeline.stages_per_rank": POSITIVE,
    "pipeline.first_stage_layers": at_least(0, "0: even"),
    "pipeline.last_stage_layers": at_least(0, "0: even"),
    "recompute.every": at_least(1, "1: every block"),
    # training
    "train.steps": POSITIVE,
    "train.seed": Range(0, 2**63 - 1),
    "train.global_batch_size": POSITIVE,
    "train.micro_batch_size": POSITIVE,
    "train.seq_len": POSITIVE,
    "train.lr": above(0),
    "train.warmup_steps": COUNT,
    "train.min_lr": COUNT,
    "train.decay_fraction": Range(0, 1, open_low=True, why="wsd's decaying share of the steps"),
    "train.weight_decay": COUNT,
    "train.beta1": FRACTION,
    "train.beta2": FRACTION,
    "train.grad_clip": at_least(0, "0 turns clipping off"),
    "train.eval_interval": at_least(0, "0 turns evaluation off"),
    "train.eval_batches": COUNT,
    "train.max_restarts": COUNT,
    "train.max_skipped_steps": at_least(0, "0: the first non-finite step stops the run"),
    "train.timeout_s": above(0, "seconds"),
    "optimizer.momentum": FRACTION,
    "optimizer.ns_steps": Range(1, 99, why="Newton-Schulz iterations"),
    "optimizer.qk_clip": at_least(0, "the largest attention logit kept; 0: off"),
    "checkpoint.interval": at_least(0, "0: only at the end and on a stop"),
    "checkpoint.keep": at_least(0, "0 keeps all"),
    "data.val_fraction": Range(0, 1, open_low=True, open_high=True),
    "logging.log_interval": POSITIVE,
    "launch.min_nodes": at_least(0, "0: all of hardware.nodes"),
    "plan.top_k": POSITIVE,
    "plan.candidate": at_least(-1, "-1: off"),
    "selftest.steps": at_least(2, "a step after the first shows the update"),
    "selftest.budget_s": above(0, "seconds"),
}


def numeric_keys(schema: type = Config, prefix: str = "") -> dict[str, type]:
    """Every int or float setting of the schema (optional ones included), dotted key -> type.
    Lists (pipeline.layers_per_stage) are checked by their own rule."""
    out: dict[str, type] = {}
    for f in dataclasses.fields(schema):
        hint = typing.get_type_hints(schema)[f.name]
        if dataclasses.is_dataclass(hint):
            out.update(numeric_keys(hint, f"{prefix}{f.name}."))
            continue
        kinds = [a for a in typing.get_args(hint) or (hint,) if a in (int, float)]
        if kinds and not isinstance(hint, type(list[int])):
            out[f"{prefix}{f.name}"] = kinds[0]
    return out


# (key, group, field, range) of every setting, split once: every numeric setting sits one
# group deep.
_CHECKS = [(key, *key.split("."), rng) for key, rng in RANGES.items()]


def range_problems(cfg: Config) -> list[tuple[str, str]]:
    """(group, message) for every setting outside its range (None: unset, always allowed)."""
    out = []
    for key, group, name, rng in _CHECKS:
        v = getattr(getattr(cfg, group), name)
        if v is None or v.__class__ is bool or rng.holds(v):
            continue
        out.append((group, f"{key}={v} must be {rng}"))
    return out
