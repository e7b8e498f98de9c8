"""The rules a layout must satisfy. Each broken rule becomes a Problem naming values and rule."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import Config, DType, ParallelConfig
from launcher.data import data_vocab_size

# Axes whose engine is not built yet: refused by name, never silently ignored.
NOT_AVAILABLE = {
    "tp": "tensor parallelism",
    "pp": "pipeline parallelism",
    "cp": "context parallelism",
    "ep": "expert parallelism",
}
FAMILIES = ("llama",)


@dataclass(frozen=True)
class Problem:
    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


def resolve_degrees(p: ParallelConfig, world: int) -> tuple[dict[str, int], list[Problem]]:
    """Fill in dp_shard=-1 and check that the degrees multiply to the world size."""
    degrees = {k: getattr(p, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")}
    problems = [
        Problem("degree", f"parallel.{k}={v} must be a positive integer")
        for k, v in degrees.items()
        if v < 1 and not (k == "dp_shard" and v == -1)
    ]
    if world < 1:
        problems.append(Problem("world_size", f"nodes x devices_per_node = {world} must be >= 1"))
    if problems:
        return degrees, problems
    others = degrees["dp_replicate"] * degrees["tp"] * degrees["pp"] * degrees["cp"]
    product = " x ".join(f"{k}={degrees[k]}" for k in ("dp_replicate", "tp", "pp", "cp"))
    if degrees["dp_shard"] == -1:
        if world % others:
            problems.append(
                Problem(
                    "world_size",
                    f"parallel.dp_shard=-1 cannot be inferred: {product} = {others} does not "
                    f"divide nodes x devices_per_node = {world}",
                )
            )
            return degrees, problems
        degrees["dp_shard"] = world // others
    elif others * degrees["dp_shard"] != world:
        problems.append(
            Problem(
                "world_size",
                f"{product} x dp_shard={degrees['dp_shard']} = {others * degrees['dp_shard']} "
                f"but nodes x devices_per_node = {world}: the product of the degrees must equal "
                "the world size",
            )
        )
    return degrees, problems


def _data_vocab(path: str | None, err) -> int | None:
    try:
        return data_vocab_size(path)
    except (OSError, ValueError, KeyError) as e:
        err(
            "data",
            f"data.path={path} is not a readable token file ({e}); build one with "
            "`python -m launcher.prepare --out PATH FILES...`",
        )
        return None


def check(cfg: Config, d: dict[str, int]) -> tuple[list[Problem], list[Problem]]:
    """Every rule over a config whose degrees resolved; returns (errors, warnings)."""
    errors: list[Problem] = []
    warnings: list[Problem] = []
    err = lambda rule, msg: errors.append(Problem(rule, msg))
    m, t, hw, prec = cfg.model, cfg.train, cfg.hardware, cfg.precision
    name = f"model={m.name}"

    for axis, what in NOT_AVAILABLE.items():
        if d[axis] > 1:
            err("not_available", f"parallel.{axis}={d[axis]}: {what} is not available yet")

    # Model shape.
    if m.family not in FAMILIES:
        err("model", f"model.family={m.family} is not one of {', '.join(FAMILIES)}")
    if m.head_dim is None and m.dim % m.n_heads:
        err("model", f"model.dim={m.dim} must be divisible by n_heads={m.n_heads} ({name})")
    if m.n_heads % m.n_kv_heads:
        err(
            "model", f"n_heads={m.n_heads} must be a multiple of n_kv_heads={m.n_kv_heads} ({name})"
        )

    # Sharded dimensions under tensor parallelism.
    tp = d["tp"]
    if tp > 1:
        if m.n_heads % tp:
            err("tp_heads", f"tp={tp} must divide n_heads={m.n_heads} ({name})")
        if m.n_kv_heads % tp:
            err(
                "tp_kv_heads",
                f"tp={tp} must divide n_kv_heads={m.n_kv_heads} ({name}): kv heads are sharded, "
                "not replicated, so tp may not exceed the kv heads",
            )
        if m.ffn_dim % tp:
            err("tp_ffn", f"tp={tp} must divide ffn_dim={m.ffn_dim} ({name})")
        if m.vocab_size % tp:
            err("tp_vocab", f"tp={tp} must divide vocab_size={m.vocab_size} ({name})")
    if d["pp"] > m.n_layers:
        err(
            "pp_layers",
            f"pp={d['pp']} stages need at least one layer each; {name} has n_layers={m.n_layers}",
        )

    # Batch decomposition: global = micro x accumulation x data-parallel size.
    dp = d["dp_replicate"] * d["dp_shard"]
    for key in ("global_batch_size", "micro_batch_size", "seq_len", "steps"):
        if getattr(t, key) < 1:
            err("train", f"train.{key}={getattr(t, key)} must be >= 1")
    if t.micro_batch_size >= 1 and t.global_batch_size % (t.micro_batch_size * dp):
        err(
            "batch",
            f"train.global_batch_size={t.global_batch_size} must be divisible by "
            f"train.micro_batch_size={t.micro_batch_size} x data-parallel size {dp} "
            f"(dp_replicate={d['dp_replicate']} x dp_shard={d['dp_shard']}) = "
            f"{t.micro_batch_size * dp}",
        )
    if t.seq_len > m.max_seq_len:
        err("seq_len", f"train.seq_len={t.seq_len} exceeds max_seq_len={m.max_seq_len} ({name})")
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        err("lr", f"need 0 <= train.min_lr={t.min_lr} <= train.lr={t.lr} and lr > 0")
    if t.warmup_steps < 0:
        err("schedule", f"train.warmup_steps={t.warmup_steps} must be >= 0")
    elif t.warmup_steps > t.steps:
        warnings.append(
            Problem(
                "schedule",
                f"train.warmup_steps={t.warmup_steps} > steps="
                f"{t.steps}: the run ends before warmup does",
            )
        )
    for key in ("eval_interval", "grad_clip", "weight_decay"):
        if getattr(t, key) < 0:
            err("train", f"train.{key}={getattr(t, key)} must be >= 0")
    if t.eval_interval and t.eval_batches < 1:
        err("train", f"train.eval_batches={t.eval_batches} must be >= 1 when evaluating")
    data_vocab = _data_vocab(cfg.data.path, err)
    if data_vocab is not None and m.vocab_size < data_vocab:
        err(
            "vocab",
            f"model.vocab_size={m.vocab_size} is smaller than the data's vocabulary "
            f"{data_vocab} ({name}, data.path={cfg.data.path})",
        )
    if not 0 < cfg.data.val_fraction < 1:
        err("data", f"data.val_fraction={cfg.data.val_fraction} must be in (0, 1)")

    if cfg.data_parallel.zero_stage not in (0, 1, 2, 3):
        err("zero_stage", f"data_parallel.zero_stage={cfg.data_parallel.zero_stage} must be 0-3")

    # Precision: what the engine implements.
    dtypes = {
        k: getattr(prec, f"{k}_dtype") for k in ("compute", "param", "grad", "master", "optimizer")
    }
    fp16 = [f"precision.{k}_dtype" for k, v in dtypes.items() if v == DType.fp16]
    if fp16:
        err(
            "precision",
            f"{', '.join(fp16)}=fp16 needs loss scaling, which is not available yet; use bf16",
        )
    if prec.optimizer_dtype != prec.master_dtype:
        err(
            "precision",
            f"precision.optimizer_dtype={prec.optimizer_dtype.value} must equal "
            f"master_dtype={prec.master_dtype.value}: Adam moments live beside the master weights",
        )
    if prec.compute_dtype != prec.param_dtype:
        err(
            "precision",
            f"precision.compute_dtype={prec.compute_dtype.value} must equal "
            f"param_dtype={prec.param_dtype.value}: forward runs in the parameters' dtype",
        )

    for key in ("nodes", "devices_per_node"):
        if getattr(hw, key) < 1:
            err("hardware", f"hardware.{key}={getattr(hw, key)} must be >= 1")
    for key in ("memory_gib", "peak_tflops", "intra_node_gbps", "inter_node_gbps"):
        if getattr(hw, key) <= 0:
            err("hardware", f"hardware.{key}={getattr(hw, key)} must be > 0")

    if t.micro_batch_size * t.seq_len < 512 and hw.device_type.value == "cuda":
        warnings.append(
            Problem(
                "micro_batch",
                f"micro-batch of {t.micro_batch_size} x "
                f"{t.seq_len} tokens is too small to keep a GPU busy",
            )
        )
    return errors, warnings
