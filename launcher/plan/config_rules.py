"""The config rules: what a run must satisfy whatever its layout (model, training, data,
precision, launch, profiling).

Each is a registered check, as the layout rules are (launcher/plan/rules.py): its name (the
Problem's), the settings it reads, and a generator of messages, one per way a config breaks
it. `first` rules (names and every value's range) run before the others, which divide by and
compare those values and run only when the first ones pass. The order of registration is the
order of the messages.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from launcher.config import Config, DType
from launcher.data.batches import data_sizes, split_sizes
from launcher.data.sources import chat_problems, is_chat_set, run_sources, validation_sources
from launcher.layout import SCHEDULES
from launcher.models import families
from launcher.plan.problem import Problem
from launcher.plan.ranges import range_problems

PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]+")


@dataclass(frozen=True)
class ConfigRule:
    """One config rule: its name, the settings it reads (groups or fields), its check (a
    message per way the config breaks it; a Problem where it names another rule), and whether
    it runs first."""

    name: str
    reads: tuple[str, ...]
    check: Callable[[Config], Iterable[str | Problem]]
    first: bool = False


CONFIG_RULES: list[ConfigRule] = []


def config_rule(name: str, reads: tuple[str, ...], first: bool = False):
    """Register the decorated check as a config rule (in order)."""

    def register(check):
        CONFIG_RULES.append(ConfigRule(name, reads, check, first))
        return check

    return register


def config_problems(cfg: Config) -> list[Problem]:
    """Every config rule's problems: the first rules', and the others' only when those pass."""

    def run(rules: list[ConfigRule]) -> list[Problem]:
        return [
            found if isinstance(found, Problem) else Problem(r.name, found)
            for r in rules
            for found in r.check(cfg)
        ]

    errors = run([r for r in CONFIG_RULES if r.first])
    return errors or run([r for r in CONFIG_RULES if not r.first])


def _name(cfg: Config) -> str:
    return f"model={cfg.model.name}"


@config_rule("model", ("model.family",), first=True)
def family_known(cfg):
    if cfg.model.family not in families.FAMILIES:
        yield f"model.family={cfg.model.family} is not one of {', '.join(families.FAMILIES)}"


@config_rule("model", ("model.name",), first=True)
def plain_name(cfg):
    name = cfg.model.name
    if not PLAIN_NAME.fullmatch(name) or name.startswith("."):
        # The run directory is outputs/<model.name>-<hash>: a name never places it elsewhere.
        yield (
            f"model.name={name!r} must be a plain name (letters, digits, '.', '_', '-'; not "
            "starting with '.'): it names the run directory outputs/<model.name>-<hash>"
        )


@config_rule("range", ("every numeric setting",), first=True)
def in_range(cfg):
    """Every value in its range (launcher/plan/ranges.py), under its group's name."""
    for group, message in range_problems(cfg):
        yield Problem(group, message)


@config_rule("model", ("model.dim", "model.n_heads", "model.n_kv_heads", "model.head_dim"))
def heads(cfg):
    m = cfg.model
    if m.head_dim is None and m.dim % m.n_heads:
        yield f"model.dim={m.dim} must be divisible by n_heads={m.n_heads} ({_name(cfg)})"
    if m.n_heads % m.n_kv_heads:
        yield f"n_heads={m.n_heads} must be a multiple of n_kv_heads={m.n_kv_heads} ({_name(cfg)})"


# The fields Family.problems reads: routed experts, dense first layers, those an attention
# needs (MLA's), multi-token prediction.
@config_rule(
    "model",
    (
        "model.family", "model.n_routed_experts", "model.n_dense_layers", "model.kv_lora_rank",
        "model.qk_rope_head_dim", "model.v_head_dim", "model.mtp_depth",
    ),
)  # fmt: skip
def family_fields(cfg):
    """What the config asks of its family's model (launcher/models/families.py: Family.problems)."""
    for problem in families.of(cfg.model).problems(cfg.model):
        yield f"{problem} ({_name(cfg)})"


@config_rule("model", ("model.n_routed_experts", "model.top_k", "model.n_dense_layers"))
def routed_experts(cfg):
    m = cfg.model
    if m.n_routed_experts and (not 1 <= m.top_k <= m.n_routed_experts or m.moe_ffn_dim < 1):
        yield (
            f"an MoE needs 1 <= top_k={m.top_k} <= n_routed_experts="
            f"{m.n_routed_experts} and moe_ffn_dim={m.moe_ffn_dim} >= 1 ({_name(cfg)})"
        )
    if m.n_routed_experts and not 0 <= m.n_dense_layers < m.n_layers:
        yield (
            f"model.n_dense_layers={m.n_dense_layers} must be in [0, n_layers={m.n_layers}): "
            f"the layers after the first n_dense_layers are the MoE ones ({_name(cfg)})"
        )


@config_rule("model", ("model.score_func", "model.n_group", "model.topk_group"))
def routing(cfg):
    """The router's settings (launcher/models/moe.py): a score function it has, and groups that
    split the experts evenly and leave top_k of them to choose from."""
    m, name = cfg.model, _name(cfg)
    if not m.n_routed_experts:
        return
    if m.score_func not in ("softmax", "sigmoid"):
        yield f"model.score_func={m.score_func} is not softmax or sigmoid ({name})"
    elif m.score_func == "softmax" and m.n_group > 1:
        yield (
            f"model.n_group={m.n_group} with score_func=softmax: the softmax router picks its "
            f"top_k greedily, group-limited routing is the sigmoid router's ({name})"
        )
    elif m.score_func == "sigmoid" and m.n_group > 1:
        if m.n_routed_experts % m.n_group:
            yield f"n_group={m.n_group} must divide n_routed_experts={m.n_routed_experts} ({name})"
        elif not 1 <= m.topk_group <= m.n_group:
            yield f"need 1 <= topk_group={m.topk_group} <= n_group={m.n_group} ({name})"
        elif m.n_routed_experts // m.n_group < 2:
            yield (
                f"n_group={m.n_group} groups of {m.n_routed_experts} experts: a group needs "
                f"two, its score is the sum of its two best ({name})"
            )
        elif m.topk_group * (m.n_routed_experts // m.n_group) < m.top_k:
            yield (
                f"top_k={m.top_k} experts cannot come from topk_group={m.topk_group} groups of "
                f"{m.n_routed_experts // m.n_group} ({name})"
            )


@config_rule("model", ("model.family", "model.rope_yarn_factor"))
def yarn(cfg):
    m = cfg.model
    if m.rope_yarn_factor > 1 and "yarn" not in families.of(m).rope:
        yield (
            f"model.rope_yarn_factor={m.rope_yarn_factor:g}: YaRN RoPE is "
            f"{families.named_with_rope('yarn')}'s "
            f"({_name(cfg)} is {m.family}; Llama 3 scaling is rope_scaling_factor)"
        )


@config_rule("seq_len", ("train.seq_len", "model.max_seq_len"))
def seq_len(cfg):
    t, m = cfg.train, cfg.model
    if t.seq_len > m.max_seq_len:
        yield f"train.seq_len={t.seq_len} exceeds max_seq_len={m.max_seq_len} ({_name(cfg)})"


@config_rule("lr", ("train.lr", "train.min_lr"))
def min_lr(cfg):
    if cfg.train.min_lr > cfg.train.lr:
        yield f"train.min_lr={cfg.train.min_lr} must be <= train.lr={cfg.train.lr}"


@config_rule("checkpoint", ("checkpoint.initial_load_*",))
def initial_load(cfg):
    ck = cfg.checkpoint
    if ck.initial_load_weights_only and not ck.initial_load_path:
        yield "checkpoint.initial_load_weights_only=true needs initial_load_path"
    if ck.initial_load_format.value == "hf" and not ck.initial_load_path:
        yield "checkpoint.initial_load_format=hf needs initial_load_path=HF_DIR"


@config_rule("train", ("train.eval_interval", "train.eval_batches"))
def eval_batches(cfg):
    if cfg.train.eval_interval and cfg.train.eval_batches < 1:
        yield f"train.eval_batches={cfg.train.eval_batches} must be >= 1 when evaluating"


@config_rule("data", ("data", "model.vocab_size", "train.seq_len"))
def data(cfg):
    """The run's data: a blend's sources and named validation sets, or one token file (the
    embedded corpus by default): readable, in the model's vocabulary, large enough."""
    if cfg.data.sources or cfg.data.val_sources or is_chat_set(cfg.data.path):
        yield from source_problems(cfg)
        return
    m, t = cfg.model, cfg.train
    source = "the embedded corpus" if cfg.data.path is None else f"data.path={cfg.data.path}"
    try:
        n_tokens, vocab = data_sizes(cfg.data.path)
    except (OSError, ValueError, KeyError) as e:
        yield (
            f"data.path={cfg.data.path} is not a readable token file ({e}); build one with "
            "`python -m launcher.prepare --out PATH FILES...`"
        )
        return
    if m.vocab_size < vocab:
        yield Problem(
            "vocab",
            f"model.vocab_size={m.vocab_size} is smaller than the vocabulary of {source}, "
            f"{vocab:,} tokens ({_name(cfg)}): set model.vocab_size >= {vocab}",
        )
    try:
        split_sizes(n_tokens, t.seq_len, cfg.data.val_fraction)
    except ValueError as e:
        yield Problem("data_size", f"{source}: {e}")


def source_problems(cfg: Config) -> Iterable[str | Problem]:
    """A blend's sources and the named validation sets: readable, agreeing on the tokenizer,
    in the model's vocabulary, each large enough for its windows (launcher.data.sources)."""
    m, t = cfg.model, cfg.train
    train, problems = run_sources(cfg.data)
    vals, more = validation_sources(cfg.data, train) if train else ([], [])
    yield from problems + more
    if not train or more:
        return
    vocab = train[0].vocab_size
    if m.vocab_size < vocab:
        yield Problem(
            "vocab",
            f"model.vocab_size={m.vocab_size} is smaller than the vocabulary of the data "
            f"sources, {vocab:,} tokens (model={m.name}): set model.vocab_size >= {vocab}",
        )
    for s in train:
        if s.chat:
            continue  # its windows are whole conversations: chat_problems
        try:
            split_sizes(s.n_tokens, t.seq_len, cfg.data.val_fraction)
        except ValueError as e:
            yield Problem("data_size", f"{s.label}: {e}")
    for text in chat_problems(train, t.seq_len, cfg.data.val_fraction):
        yield Problem("data_size", text)
    for text in chat_problems(vals, t.seq_len, None):
        yield Problem("data_size", text)
    if m.mtp_depth and any(s.chat for s in train):
        yield Problem(
            "chat_mtp",
            f"model.mtp_depth={m.mtp_depth} with a chat set: the prediction depths take their "
            "loss on every token, not on the answers its mask names (not built yet); set "
            "model.mtp_depth=0 to fine-tune on it",
        )
    for v in vals:
        if not v.chat and v.n_tokens < t.seq_len + 1:
            yield Problem(
                "data_size",
                f"data.val_sources.{v.label}: n_tokens={v.n_tokens:,} is too few for one "
                f"window of train.seq_len + 1 = {t.seq_len + 1} tokens",
            )


@config_rule("schedule", ("pipeline.schedule",))
def schedule(cfg):
    if cfg.pipeline.schedule not in SCHEDULES:
        yield f"pipeline.schedule={cfg.pipeline.schedule} is not one of {', '.join(SCHEDULES)}"


@config_rule("precision", ("precision.*_dtype",))
def no_fp16(cfg):
    prec = cfg.precision
    dtypes = {
        k: getattr(prec, f"{k}_dtype") for k in ("compute", "param", "grad", "master", "optimizer")
    }
    fp16 = [f"precision.{k}_dtype" for k, v in dtypes.items() if v == DType.fp16]
    if fp16:
        yield f"{', '.join(fp16)}=fp16 needs loss scaling, which is not available; use bf16"


@config_rule("precision", ("precision.master_dtype", "precision.optimizer_dtype"))
def moments_no_wider(cfg):
    # bf16 moments beside fp32 master weights are upcast for each update (optim.py); the reverse
    # would keep fp32 moments for an update rounded to bf16 weights, and is not implemented.
    prec = cfg.precision
    if (prec.master_dtype, prec.optimizer_dtype) == (DType.bf16, DType.fp32):
        yield (
            "precision.optimizer_dtype=fp32 needs master_dtype=fp32 (got bf16): Adam moments "
            "may be narrower than the master weights, not wider; set one of them to match"
        )


@config_rule("optimizer", ("optimizer.qk_clip", "model.family"))
def qk_clip_attention(cfg):
    attention = families.of(cfg.model).attention
    if cfg.optimizer.qk_clip > 0 and not attention.qk_clip:
        yield (
            f"optimizer.qk_clip={cfg.optimizer.qk_clip:g}: {_name(cfg)} ({cfg.model.family}) "
            f"has {attention.name}, which undo any scale of the query and key weights that "
            "QK-clip bounds the logits by; set optimizer.qk_clip=0 (the norms bound them)"
        )


@config_rule("precision", ("precision.fp8", "hardware.device_type", "hardware.peak_tflops_fp8"))
def fp8_units(cfg):
    # Float8 GEMMs need the part's FP8 tensor cores (Hopper, Blackwell); on CPU torchao emulates
    # them (the casts and scales exact, the matmul in the input dtype), for the tests.
    fp8, hw = cfg.precision.fp8.value, cfg.hardware
    if fp8 != "none" and hw.device_type.value == "cuda" and hw.peak_tflops_fp8 <= 0:
        part = f" ({hw.part})" if hw.part else ""
        yield (
            f"precision.fp8={fp8} needs FP8 units, which hardware={hw.name}{part} has not "
            "(hardware.peak_tflops_fp8=0): use precision=bf16_mixed, or a Hopper or Blackwell "
            "preset (h100_80g, h200, h800, b200)"
        )


@config_rule("precision", ("train.adamw", "precision.master_dtype", "precision.optimizer_dtype"))
def fused_adamw_moments(cfg):
    # torch's fused and foreach kernels update moments of the parameters' dtype; narrower ones
    # take MomentDtypeAdamW's own loop (optim.py).
    prec, impl = cfg.precision, cfg.train.adamw.value
    if impl in ("fused", "foreach") and prec.optimizer_dtype != prec.master_dtype:
        yield (
            f"train.adamw={impl} needs precision.optimizer_dtype equal to master_dtype (got "
            f"{prec.optimizer_dtype.value} and {prec.master_dtype.value}): moments narrower than "
            "the weights are updated by their own loop; use train.adamw=auto"
        )


@config_rule("launch", ("launch", "hardware.nodes", "parallel.auto", "train.max_restarts"))
def launch(cfg):
    """A rendezvous a launcher can meet at, and a node range a run can go on over (torchrun's
    elastic mode with a rendezvous, a SLURM job's --nodes=MIN-MAX under hydra/launcher=slurm):
    a world that shrinks needs parallel.auto=true to re-plan, and under torchrun a restart to
    regroup."""
    la, nodes = cfg.launch, cfg.hardware.nodes
    if la.rendezvous:
        host, _, port = la.rendezvous.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            yield f"launch.rendezvous={la.rendezvous} must be HOST:PORT (port 1-65535)"
    if la.min_nodes > nodes:
        yield f"launch.min_nodes={la.min_nodes} exceeds hardware.nodes={nodes}"
    elif 0 < la.min_nodes < nodes:
        elastic = f"launch.min_nodes={la.min_nodes} < hardware.nodes={nodes} (elastic)"
        if not cfg.parallel.auto:
            yield (
                f"{elastic} needs parallel.auto=true: the group that goes on with fewer nodes "
                "re-plans its layout for them"
            )
        if la.rendezvous and cfg.train.max_restarts < 1:
            yield (
                f"{elastic} needs train.max_restarts >= 1: a node that leaves fails the "
                "others' step, and torchrun restarts them into the smaller group"
            )


@config_rule("profile", ("profile.steps", "profile.memory", "train.steps"))
def profile(cfg):
    steps = cfg.profile.steps
    outside = [s for s in steps if not 1 <= s <= cfg.train.steps]
    if outside:
        yield f"profile.steps={steps}: {outside} not in 1..train.steps={cfg.train.steps}"
    if cfg.profile.memory and not steps:
        yield "profile.memory=true needs profile.steps=[N, ...]: the steps to record"


@config_rule("precision", ("precision.compute_dtype", "precision.param_dtype"))
def compute_is_param(cfg):
    prec = cfg.precision
    if prec.compute_dtype != prec.param_dtype:
        yield (
            f"precision.compute_dtype={prec.compute_dtype.value} must equal "
            f"param_dtype={prec.param_dtype.value}: forward runs in the parameters' dtype"
        )
