"""Bad input for every command, as data, and the worker that runs them.

Each case is a command line of `launcher.plan`, `launcher.train`, `launcher.prepare`,
`launcher.checkpoint` or `launcher.convert` over broken config values, token files, prepare
input, checkpoints or Hugging Face directories (built under WORK by `build`). Each must end
with exit 2 and a message naming what is wrong, and no traceback, or, for the few cases
marked ACCEPTED, exit 0 for the stated reason.

`python tests/e2e/bad_inputs.py WORK OUT.jsonl` runs every case in this one process (the
commands' own entry points, with stdout and stderr captured at the file descriptors) and
appends one JSON line per case as it finishes: a crash of the process itself (a segfault)
leaves the case it was running without a line, which the test reports by name.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ACCEPTED = "accepted: "  # a case whose `expect` starts so must exit 0


@dataclass(frozen=True)
class Case:
    id: str
    command: str  # plan, train, prepare, checkpoint, convert, generate, runs, selftest, ...
    args: tuple[str, ...]  # "{W}" stands for the work directory
    expect: str  # a substring of the output, or ACCEPTED + the reason
    status: int = 2  # 1: a write that failed part-way (a disk that filled), not a bad input


def case_run_dir(w: Path, case_id: str) -> Path:
    """The run directory a train or plan case runs in (run_case)."""
    return w / "runs" / re.sub(r"[^A-Za-z0-9_.-]", "_", case_id)


# Files a run reads back from its directory, each a link to a device read without end.
ENDLESS = (("metrics.jsonl", "/dev/zero"), ("wandb_run_id", "/dev/full"))


def endless_case_id(name: str, target: str) -> str:
    return f"train resumed where {name} leads to {target}"


def config(key_value: str, expect: str) -> Case:
    return Case(f"config {key_value}", "plan", (key_value,), expect)


# -- config values (launcher.plan; launcher.train runs the same plan first) ----------------
CONFIG = [
    config("train.lr=nan", "train.lr=nan must be > 0"),
    config("train.lr=inf", "train.lr=inf must be > 0"),
    config("train.lr=-1", "train.lr=-1.0 must be > 0"),
    config("train.lr=abc", "train.lr"),
    config("train.min_lr=nan", "train.min_lr=nan must be >= 0"),
    config("train.min_lr=1", "train.min_lr=1.0 must be <= train.lr"),
    config("train.lr_schedule=step", "takes one of cosine, linear, constant, wsd"),
    config("train.decay_fraction=0", "train.decay_fraction=0.0 must be in (0, 1]"),
    config("train.beta1=2.0", "train.beta1=2.0 must be in [0, 1)"),
    config("train.beta1=-0.5", "train.beta1=-0.5 must be in [0, 1)"),
    config("train.beta2=1.0", "train.beta2=1.0 must be in [0, 1)"),
    config("train.beta2=nan", "train.beta2=nan must be in [0, 1)"),
    config("train.weight_decay=nan", "train.weight_decay=nan must be >= 0"),
    config("train.weight_decay=-0.1", "train.weight_decay=-0.1 must be >= 0"),
    config("train.grad_clip=nan", "train.grad_clip=nan must be >= 0"),
    config("train.grad_clip=-1", "train.grad_clip=-1.0 must be >= 0"),
    config("train.seed=-1", "train.seed=-1 must be in [0, 9.22337e+18]"),
    config("train.seed=1.5", "train.seed"),
    config("train.steps=0", "train.steps=0 must be >= 1"),
    config("train.steps=-3", "train.steps=-3 must be >= 1"),
    config("train.warmup_steps=-1", "train.warmup_steps=-1 must be >= 0"),
    config("train.global_batch_size=0", "train.global_batch_size=0 must be >= 1"),
    config("train.micro_batch_size=0", "train.micro_batch_size=0 must be >= 1"),
    config("train.micro_batch_size=3", "micro"),
    config("train.seq_len=0", "train.seq_len=0 must be >= 1"),
    config("train.seq_len=100000", "train.seq_len=100000 exceeds max_seq_len"),
    config("train.timeout_s=inf", "train.timeout_s=inf must be > 0"),
    config("train.timeout_s=0", "train.timeout_s=0.0 must be > 0"),
    config("train.eval_interval=-5", "train.eval_interval=-5 must be >= 0"),
    config("train.eval_batches=0", "train.eval_batches=0 must be >= 1 when evaluating"),
    config("train.max_restarts=-1", "train.max_restarts=-1 must be >= 0"),
    config("train.max_skipped_steps=-2", "train.max_skipped_steps=-2 must be >= 0"),
    config("train.bogus=1", "train.bogus"),
    config("+train.bogus=1", "unknown config key(s): train.bogus"),
    config("model.dim=0", "model.dim=0 must be >= 1"),
    config("model.dim=100", "model.dim=100 must be divisible by n_heads=8"),
    config("model.n_layers=0", "model.n_layers=0 must be >= 1"),
    config("model.n_heads=-8", "model.n_heads=-8 must be >= 1"),
    config("model.n_kv_heads=3", "n_heads=8 must be a multiple of n_kv_heads=3"),
    config("model.head_dim=0", "model.head_dim=0 must be >= 1"),
    config("model.ffn_dim=0", "model.ffn_dim=0 must be >= 1"),
    config("model.vocab_size=0", "model.vocab_size=0 must be >= 1"),
    config("model.vocab_size=100", "model.vocab_size=100 is smaller than the vocabulary"),
    config("model.max_seq_len=0", "model.max_seq_len=0 must be >= 1"),
    config("model.norm_eps=-1", "model.norm_eps=-1.0 must be > 0"),
    config("model.norm_eps=0", "model.norm_eps=0.0 must be > 0"),
    config("model.rope_theta=0", "model.rope_theta=0.0 must be > 0"),
    config("model.rope_theta=nan", "model.rope_theta=nan must be > 0"),
    config("model.rope_scaling_factor=0.5", "model.rope_scaling_factor=0.5 must be >= 1"),
    config("model.dropout=1.0", "model.dropout=1.0 must be in [0, 1)"),
    config("model.dropout=-0.1", "model.dropout=-0.1 must be in [0, 1)"),
    config("model.aux_loss_coef=nan", "model.aux_loss_coef=nan must be >= 0"),
    config("model.family=bert", "model.family=bert is not one of"),
    config("model.name=../../escape", "model.name='../../escape' must be a plain name"),
    config("model.name=.hidden", "model.name='.hidden' must be a plain name"),
    config("model.name=a/b", "model.name='a/b' must be a plain name"),
    config("model.n_routed_experts=4", "model.n_routed_experts=4: a llama model has no routed"),
    config("model.n_routed_experts=-1", "model.n_routed_experts=-1 must be >= 0"),
    config("hardware.peak_tflops=inf", "hardware.peak_tflops=inf must be > 0"),
    config("hardware.peak_tflops=0", "hardware.peak_tflops=0.0 must be > 0"),
    config("hardware.memory_gib=-1", "hardware.memory_gib=-1.0 must be > 0"),
    config("hardware.memory_gib=nan", "hardware.memory_gib=nan must be > 0"),
    config("hardware.efficiency_scale=nan", "hardware.efficiency_scale=nan must be > 0"),
    config("hardware.efficiency=1.5", "hardware.efficiency=1.5 must be in [0, 1]"),
    config(
        "hardware.attention_efficiency=-0.2",
        "hardware.attention_efficiency=-0.2 must be in [0, 1]",
    ),
    config("hardware.intra_node_gbps=0", "hardware.intra_node_gbps=0.0 must be > 0"),
    config("hardware.storage_gbps=-2", "hardware.storage_gbps=-2.0 must be > 0"),
    config("hardware.nodes=0", "hardware.nodes=0 must be >= 1"),
    config("hardware.devices_per_node=0", "hardware.devices_per_node=0 must be >= 1"),
    config("hardware.device_type=tpu", "hardware.device_type"),
    config("parallel.tp=0", "parallel.tp=0 must be a positive integer"),
    config("parallel.tp=3", "tp=3"),
    config("parallel.pp=-1", "parallel.pp=-1 must be a positive integer"),
    config("parallel.dp_shard=5", "the product of the degrees must equal the world size"),
    config("parallel.cp=2.5", "parallel.cp"),
    config("data_parallel.zero_stage=5", "data_parallel.zero_stage=5 must be in [0, 3]"),
    config("data_parallel.zero_stage=-1", "data_parallel.zero_stage=-1 must be in [0, 3]"),
    config("pipeline.schedule=bogus", "pipeline.schedule=bogus is not one of"),
    config("pipeline.microbatches=-1", "pipeline.microbatches=-1 must be >= 0"),
    config("pipeline.stages_per_rank=0", "pipeline.stages_per_rank=0 must be >= 1"),
    config("recompute.every=0", "recompute.every=0 must be >= 1"),
    config("recompute=bogus", "recompute"),
    Case(
        "config precision fp16",
        "plan",
        ("precision.compute_dtype=fp16", "precision.param_dtype=fp16"),
        "fp16 needs loss scaling",
    ),
    config("checkpoint.interval=-1", "checkpoint.interval=-1 must be >= 0"),
    config("checkpoint.keep=-1", "checkpoint.keep=-1 must be >= 0"),
    config("checkpoint.resume=sometimes", "checkpoint.resume"),
    config("checkpoint.initial_load_weights_only=true", "needs initial_load_path"),
    config("data.val_fraction=0", "data.val_fraction=0.0 must be in (0, 1)"),
    config("data.val_fraction=1", "data.val_fraction=1.0 must be in (0, 1)"),
    config("data.val_fraction=nan", "data.val_fraction=nan must be in (0, 1)"),
    config("data.path={W}/missing.bin", "[data] data.path="),
    config("logging.log_interval=-5", "logging.log_interval=-5 must be >= 1"),
    config("launch.rendezvous=node1", "launch.rendezvous=node1 must be HOST:PORT"),
    config("launch.rendezvous=node1:99999", "launch.rendezvous=node1:99999 must be HOST:PORT"),
    config("launch.min_nodes=-1", "launch.min_nodes=-1 must be >= 0"),
    Case(
        "config launch min_nodes above nodes",
        "plan",
        ("launch.rendezvous=n1:29500", "launch.min_nodes=3", "hardware.nodes=2"),
        "launch.min_nodes=3 exceeds hardware.nodes=2",
    ),
    Case(
        "config launch elastic without auto",
        "plan",
        ("launch.min_nodes=1", "hardware.nodes=2"),
        "(elastic) needs parallel.auto=true",
    ),
    Case(
        "config launch elastic without restarts",
        "plan",
        (
            "launch.rendezvous=n1:29500",
            "launch.min_nodes=1",
            "hardware.nodes=2",
            "parallel.auto=true",
        ),
        "(elastic) needs train.max_restarts >= 1",
    ),
    Case(
        "train rendezvous host that does not resolve",
        "train",
        (
            "launch.rendezvous=no-such-host.invalid:29500",
            "hardware.devices_per_node=2",
            "train.micro_batch_size=1",
            "hydra.run.dir={W}/no-such-host",
        ),
        "launch.rendezvous=no-such-host.invalid:29500: no such host no-such-host.invalid",
    ),
    *(
        Case(
            endless_case_id(name, target),
            "train",
            (),
            f"/{name} is not a regular file (it leads to {target}): move it aside",
        )
        for name, target in ENDLESS
    ),
    Case(
        "train one process with a rendezvous",
        "train",
        ("launch.rendezvous=no-such-host.invalid:29500", "hydra.run.dir={W}/one-rendezvous"),
        ACCEPTED + "one process meets no other: a warning says the rendezvous is not used",
    ),
    Case(
        "train several nodes without a rendezvous",
        "train",
        ("hardware.nodes=2", "train.micro_batch_size=1", "hydra.run.dir={W}/two-nodes"),
        "without one this launcher only uses one node",
    ),
    config("logging.log_interval=0", "logging.log_interval=0 must be >= 1"),
    config("logging.wandb.mode=sometimes", "logging.wandb.mode"),
    config("plan.top_k=0", "plan.top_k=0 must be >= 1"),
    config("plan.candidate=-2", "plan.candidate=-2 must be >= -1"),
    config("plan.draw={W}/plan.txt", "the file must end in one of"),
    Case(
        "plan draw of a search",
        "plan",
        ("plan.search=true", "plan.draw={W}/s.png"),
        "plan.draw={W}/s.png draws one plan, not a search",
    ),
    config("train.eval_interval=0", ACCEPTED + "0 turns evaluation off"),
    config("train.grad_clip=0", ACCEPTED + "0 turns clipping off"),
    config("checkpoint.keep=0", ACCEPTED + "0 keeps every checkpoint"),
    config("hardware.efficiency=0", ACCEPTED + "0 means the Megatron-LM fit"),
    config("train.seed=4294967296", ACCEPTED + "any seed in [0, 2^63) seeds torch and numpy"),
]


def token_case(name: str, expect: str, *extra: str) -> Case:
    return Case(f"token file {name}", "train", (f"data.path={{W}}/tok/{name}.bin", *extra), expect)


# -- token files (launcher.train reads the header in the plan, the ids before starting) --
TOKENS = [
    token_case("no_header", "is not a readable token file"),
    token_case("header_not_json", "is not a readable token file"),
    token_case("header_list", "is not an llm-launcher-tokens header"),
    token_case("wrong_format", "is not an llm-launcher-tokens header"),
    token_case("version_9", "has version 9"),
    token_case("dtype_object", "dtype='object' must be one of uint16, uint32"),
    token_case("dtype_float16", "dtype='float16' must be one of uint16, uint32"),
    token_case("dtype_missing", "dtype=None must be one of uint16, uint32"),
    token_case("n_tokens_string", "n_tokens='many' must be an integer >= 0"),
    token_case("n_tokens_negative", "n_tokens=-5 must be an integer >= 0"),
    token_case("n_tokens_bool", "n_tokens=True must be an integer >= 0"),
    token_case("n_tokens_float", "n_tokens=100.5 must be an integer >= 0"),
    token_case("vocab_zero", "vocab_size=0 must be an integer >= 1"),
    token_case("vocab_too_big_for_uint16", "does not fit in dtype=uint16"),
    token_case("eos_outside", "eos_id=300 is outside vocab_size=257"),
    token_case("n_tokens_too_many", "its header promises n_tokens="),
    token_case("bin_truncated", "its header promises n_tokens="),
    token_case("no_bin", "is not a readable token file"),
    token_case("empty", "is too few for train.seq_len"),
    token_case("ids_outside_vocab", "holds token id 300 at position 1,000, outside"),
    token_case("vocab_larger_than_model", "model.vocab_size=320 is smaller than the vocabulary"),
]


def sources_case(name: str, sources: str, expect: str, *extra: str) -> Case:
    return Case(f"sources {name}", "plan", (f"data.sources=[{sources}]", *extra), expect)


GOOD = "{W}/tok/good.bin"
# -- blends and validation sets (launcher.data.sources) -----------------------------------------
SOURCES = [
    sources_case(
        "weight 0", f"{{path: {GOOD}, weight: 0}}", "weight=0.0 must be a finite number > 0"
    ),
    sources_case("weight -1", f"{{path: {GOOD}, weight: -1}}", "weight=-1.0 must be a finite"),
    sources_case("weight nan", f"{{path: {GOOD}, weight: nan}}", "weight=nan must be a finite"),
    sources_case("missing path", "{path: {W}/nothere}", "does not exist"),
    sources_case("no path", "{weight: 1}", "data.sources"),
    sources_case("dir without tokens", "{path: {W}/out}", "directory without token files"),
    sources_case("glob of nothing", "{path: {W}/tok/nomatch*.bin}", "matches no file"),
    sources_case(
        "no tokens",
        "{path: {W}/tok/empty.bin}",
        "holds no tokens",
    ),
    sources_case(
        "tokenizers disagree",
        f"{{path: {GOOD}}}, {{path: {{W}}/tok/vocab_larger_than_model.bin}}",
        "(vocabulary 1,000, eos id 999, byte-level) does not match",
    ),
    sources_case(
        "and data.path",
        f"{{path: {GOOD}}}",
        "data.path and data.sources are both set",
        f"data.path={GOOD}",
    ),
    sources_case("too small", "{path: {W}/tok/tiny.bin}", "is too few for train.seq_len"),
    Case(
        "val_sources missing",
        "plan",
        ("data.val_sources={held: {W}/nothere.bin}",),
        "data.val_sources.held=",
    ),
    Case(
        "val_sources tokenizer",
        "plan",
        ("data.val_sources={held: {W}/tok/vocab_larger_than_model.bin}", "model.vocab_size=1000"),
        "held (vocabulary 1,000, eos id 999, byte-level) does not match the embedded",
    ),
    config("data.attention=sliding", "takes one of auto, causal, document"),
    config("optimizer.momentum=1", "optimizer.momentum=1.0 must be in [0, 1)"),
    config("optimizer.ns_steps=0", "optimizer.ns_steps=0 must be in [1, 99] (Newton-Schulz"),
    config("optimizer.ns_dtype=fp16", "takes one of bf16, fp32"),
    config("optimizer=sgd", "optimizer=sgd: no such optimizer; the optimizer options: adamw, muon"),
    config("optimizer.qk_clip=-1", "optimizer.qk_clip=-1.0 must be >= 0"),
    Case(
        "qk-clip on a family with q and k norms",
        "train",
        ("model=qwen3_debug", "optimizer.qk_clip=100"),
        "optimizer.qk_clip=100: model=qwen3_debug (qwen3) has grouped-query attention with "
        "per-head q and k norms, which undo any scale",
    ),  # fmt: skip
    Case(
        "chat conversation longer than a window",
        "train",
        ("data.path={W}/chat/long.bin", "train.seq_len=16"),
        "conversation 2 has 30 tokens, more than a window of train.seq_len + 1 = 17 (prepared "
        "with --long refuse); raise train.seq_len, or prepare it again with --max-tokens 17",
    ),
    Case(
        "chat with multi-token prediction",
        "train",
        (
            "data.path={W}/chat/long.bin",
            "train.seq_len=32",
            "model=deepseek_debug",
            "model.mtp_depth=1",
        ),
        "model.mtp_depth=1 with a chat set: the prediction depths take their loss on every token",
    ),  # fmt: skip
    Case(
        "chat mask cut short",
        "train",
        ("data.path={W}/chat/cut.bin",),
        "cut.mask has 29 bytes, but the tokens beside it are 40: the mask does not match",
    ),
    Case(
        "sources ids outside vocab",
        "train",
        (f"data.sources=[{{path: {GOOD}}}, {{path: {{W}}/tok/ids_outside_vocab.bin}}]",),
        "ids_outside_vocab.bin holds token id 300 at position 1,000, outside",
    ),
]


def prepare_case(name: str, expect: str, *extra: str) -> Case:
    return Case(f"prepare {name}", "prepare", ("--out", "{W}/out/x", *extra), expect)


# -- prepare input --------------------------------------------------------------------------
PREPARE = [
    prepare_case("empty file", "empty.txt is empty: nothing to tokenize", "{W}/in/empty.txt"),
    prepare_case("blank file", "blank.txt is empty: nothing to tokenize", "{W}/in/blank.txt"),
    prepare_case("random bytes", "random.bin is", "{W}/in/random.bin"),
    prepare_case("NUL bytes", "is binary (a NUL byte at offset 5)", "{W}/in/nul.txt"),
    prepare_case("latin-1 text", "is not UTF-8 text (byte 0xe9", "{W}/in/latin1.txt"),
    prepare_case("missing file", "not a file:", "{W}/in/missing.txt"),
    prepare_case("a directory", "not a file:", "{W}/in"),
    prepare_case("jsonl empty", "holds no JSON-lines records", "{W}/in/empty.jsonl"),
    prepare_case("jsonl not json", "bad.jsonl:2: not valid JSON", "{W}/in/bad.jsonl"),
    prepare_case("jsonl a list", "list.jsonl:1: a JSON list, not an object", "{W}/in/list.jsonl"),
    prepare_case("jsonl no field", "nofield.jsonl:1: no field 'text'", "{W}/in/nofield.jsonl"),
    prepare_case("jsonl number", "field 'text' is not a string (int)", "{W}/in/number.jsonl"),
    prepare_case("jsonl latin-1", "latin1.jsonl:1 is not UTF-8 text", "{W}/in/latin1.jsonl"),
    prepare_case(
        "eos without tokenizer", "--eos needs --tokenizer", "--eos", "</s>", "{W}/in/ok.txt"
    ),
    prepare_case(
        "tokenizer missing", "not a file", "--tokenizer", "{W}/in/none.json", "{W}/in/ok.txt"
    ),
    prepare_case(
        "tokenizer not json",
        "is not a tokenizer.json",
        "--tokenizer",
        "{W}/in/ok.txt",
        "{W}/in/ok.txt",
    ),
    Case("prepare no --out", "prepare", ("{W}/in/ok.txt",), "the following arguments are required"),
]

# -- prepare --chat (a WordLevel tokenizer with a chat template under {W}/chat/tok, one without
# under {W}/chat/plain: build_chat) ----------------------------------------------------------
CHAT_TOK = ("--chat", "--tokenizer", "{W}/chat/tok/tokenizer.json")
PREPARE += [
    prepare_case("chat without a tokenizer", "--chat needs --tokenizer", "--chat",
                 "{W}/chat/ok.jsonl"),
    prepare_case("chat tokenizer without a template",
                 "{W}/chat/plain/tokenizer.json has no chat template", "--chat", "--tokenizer",
                 "{W}/chat/plain/tokenizer.json", "{W}/chat/ok.jsonl"),
    prepare_case("chat no assistant turn", "noanswer.jsonl:1: no assistant turn", *CHAT_TOK,
                 "{W}/chat/noanswer.jsonl"),
    prepare_case("chat unknown role", "role.jsonl:1: turn 0 has role 'narrator', which the "
                 "chat template does not know", *CHAT_TOK, "{W}/chat/role.jsonl"),
    prepare_case("chat over max tokens", "ok.jsonl:1: 7 tokens, over --max-tokens 4 (--long "
                 "refuse", *CHAT_TOK, "--max-tokens", "4", "{W}/chat/ok.jsonl"),
    prepare_case("chat --long bogus", "argument --long: invalid choice: 'bogus'", *CHAT_TOK,
                 "--long", "bogus", "{W}/chat/ok.jsonl"),
    prepare_case("chat a text file", "ok.txt: --chat reads conversations from .jsonl or "
                 ".parquet files", *CHAT_TOK, "{W}/in/ok.txt"),
    prepare_case("chat with --workers", "--workers with --chat", *CHAT_TOK, "--workers", "2",
                 "{W}/chat/ok.jsonl", "{W}/chat/ok.jsonl"),
    prepare_case("max tokens without chat", "--max-tokens applies to --chat", "--max-tokens",
                 "8", "{W}/in/ok.txt"),
    prepare_case("chat template not jinja", "is not a Jinja template", "--chat", "--tokenizer",
                 "{W}/chat/broken/tokenizer.json", "{W}/chat/ok.jsonl"),
]  # fmt: skip

CKPT = "{W}/ckpt/checkpoints"


def export(name: str, expect: str) -> Case:
    return Case(
        f"checkpoint export {name}",
        "checkpoint",
        ("export", f"{CKPT}/{name}", "{W}/out/m.pt"),
        expect,
    )


STEP2 = f"{CKPT}/step_00000002"


def export_onto(what: str, out: str, expect: str) -> Case:
    """An export of step 2 whose OUT is one of its inputs, or a file the launcher did not make."""
    return Case(f"checkpoint export {what}", "checkpoint", ("export", STEP2, out), expect)


def load_path(name: str, expect: str) -> Case:
    path = f"{CKPT}/{name}"
    return Case(
        f"train initial_load_path {name}",
        "train",
        (f"checkpoint.initial_load_path={path}",),
        expect,
    )


# -- checkpoints ------------------------------------------------------------------------------
CHECKPOINTS = [
    export("crafted_metadata", "refused to load posix.system"),
    export("flipped_bytes", "has changed since it was saved (CRC-32"),
    export("truncated_shard", "__0_0.distcp has 1,000 bytes"),
    export("missing_shard", "__0_0.distcp is missing"),
    export("missing_metadata", ".metadata is missing"),
    export("unsummed_flipped", "__0_0.distcp has no saved checksum"),
    export("unlisted_truncated", "__0_0.distcp has 1,000 bytes; .metadata reads"),
    load_path("unsummed_flipped", "__0_0.distcp has no saved checksum"),
    load_path("unlisted_truncated", "__0_0.distcp has 1,000 bytes; .metadata reads"),
    export("metadata_not_pickle", ".metadata"),
    export("meta_list", "meta.json is not an llm-launcher-checkpoint file"),
    export("meta_not_json", "meta.json is not an llm-launcher-checkpoint file"),
    export("step_00000001.partial", "is incomplete: a save did not finish"),
    export("no_such_step", "is not a directory"),
    # An output onto one of the command's inputs, or onto a file it did not make.
    export_onto(
        "onto its own shard",
        f"{STEP2}/__0_0.distcp",
        "__0_0.distcp already exists; choose another path or remove it",
    ),
    export_onto("onto the run's metrics", "{W}/ckpt/metrics.jsonl", "metrics.jsonl already exists"),
    export_onto("into the checkpoint", f"{STEP2}/model.pt", "is inside the checkpoint it exports"),
    Case(
        "convert to-hf crafted_metadata",
        "convert",
        ("to-hf", f"{CKPT}/crafted_metadata", "{W}/out/hf1"),
        "refused to load posix.system",
    ),
    Case(
        "convert to-hf flipped_bytes",
        "convert",
        ("to-hf", f"{CKPT}/flipped_bytes", "{W}/out/hf2"),
        "has changed since it was saved",
    ),
    load_path("crafted_metadata", "refused to load posix.system"),
    load_path("resized_metadata", "resized_metadata/.metadata has"),
    export("resized_metadata", "resized_metadata/.metadata has"),
    load_path("truncated_shard", "__0_0.distcp has 1,000 bytes"),
    load_path("missing_shard", "__0_0.distcp is missing"),
    load_path("missing_metadata", ".metadata is missing"),
    load_path("meta_list", "meta.json is not an llm-launcher-checkpoint file"),
    load_path("step_00000001.partial", "is incomplete: a save did not finish"),
    # Emptied: what a resume refuses, an initial load refuses too.
    load_path("empty_metadata", "empty_metadata/.metadata has 0 bytes"),
    export("empty_metadata", "empty_metadata/.metadata has 0 bytes"),
    load_path("no_such_step", "is not a directory"),
    Case(
        "train another model shape",
        "train",
        (f"checkpoint.initial_load_path={CKPT}/step_00000002", "model.n_layers=3"),
        "holds another model: n_layers=1 in the checkpoint but model.n_layers=3",
    ),
    Case(
        "checkpoint list of a file",
        "checkpoint",
        ("list", "{W}/in/ok.txt"),
        "is not a directory",
    ),
]


def hf(name: str, expect: str) -> Case:
    return Case(
        f"hf {name}",
        "train",
        (f"checkpoint.initial_load_path={{W}}/hf/{name}", "checkpoint.initial_load_format=hf"),
        expect,
    )


# -- Hugging Face directories ------------------------------------------------------------------
HF = [
    Case(
        "hf without initial_load_format",
        "train",
        ("checkpoint.initial_load_path={W}/hf/good",),
        "is a Hugging Face model directory (config.json and *.safetensors), not a checkpoint "
        "of this launcher: load it with checkpoint.initial_load_format=hf",
    ),
    hf("no_config", "config.json"),
    hf("config_not_json", "config.json"),
    hf("config_list", "config.json"),
    hf("unknown_model_type", "model_type"),
    hf("other_shape", "describes another model"),
    hf("no_weights", "holds no *.safetensors files"),
    hf("index_escapes", "names files outside"),
    hf("index_not_json", "is not a safetensors index"),
    hf("index_list", "is not a safetensors index"),
    hf("header_too_long", "is not a readable safetensors file (a header of"),
    hf("header_not_json", "is not a readable safetensors file"),
    hf("header_list", "is not a readable safetensors file"),
    hf("tensor_missing", "lacks tensors"),
    Case(
        "hf convert from-hf index_escapes",
        "convert",
        ("from-hf", "{W}/hf/index_escapes", "{W}/out/c1"),
        "names files outside",
    ),
    Case(
        "hf convert from-hf no_config",
        "convert",
        ("from-hf", "{W}/hf/no_config", "{W}/out/c2"),
        "config.json",
    ),
]

# -- generate (from the tiny run's directory) --------------------------------------------------
RUN = "{W}/ckpt"
GENERATE = [
    Case("generate --device cuda", "generate", (RUN, "--prompt", "a", "--device", "cuda"),
         "--device cuda: no CUDA device here"),
    Case("generate --seed 2**70", "generate", (RUN, "--prompt", "a", "--seed", str(2**70)),
         "--seed=1180591620717411303424 must be in 0 .. 2**63 - 1"),
    Case("generate --seed -1", "generate", (RUN, "--prompt", "a", "--seed", "-1"),
         "--seed=-1 must be in 0 .. 2**63 - 1"),
    Case("generate --chat byte-level", "generate", (RUN, "--chat", "--prompt", "a"),
         "--chat needs a Hugging Face tokenizer with a chat template; this run's is byte-level"),
    Case("generate --chat no template", "generate",
         (RUN, "--chat", "--prompt", "a", "--tokenizer", "{W}/chat/plain/tokenizer.json"),
         "--chat: {W}/chat/plain/tokenizer.json has no chat template"),
]  # fmt: skip

GENERATE += [
    Case("generate --max-new-tokens 0", "generate", (RUN, "--prompt", "a", "--max-new-tokens", "0"),
         "--max-new-tokens=0 must be >= 1"),
    Case("generate --max-new-tokens abc", "generate",
         (RUN, "--prompt", "a", "--max-new-tokens", "abc"), "invalid int value: 'abc'"),
    Case("generate --temperature -1", "generate", (RUN, "--prompt", "a", "--temperature", "-1"),
         "--temperature=-1.0 must be >= 0"),
    Case("generate --temperature nan", "generate", (RUN, "--prompt", "a", "--temperature", "nan"),
         "--temperature=nan must be >= 0"),
    Case("generate --top-p 0", "generate", (RUN, "--prompt", "a", "--top-p", "0"),
         "--top-p=0.0 must be in (0, 1]"),
    Case("generate --top-p 1.5", "generate", (RUN, "--prompt", "a", "--top-p", "1.5"),
         "--top-p=1.5 must be in (0, 1]"),
    Case("generate empty prompt", "generate", (RUN, "--prompt", ""), "--prompt is empty"),
    Case("generate no such run", "generate", ("{W}/nope", "--prompt", "a"), "{W}/nope"),
    Case("generate a file", "generate", ("{W}/in/ok.txt", "--prompt", "a"), "ok.txt"),
    Case("generate tokenizer missing", "generate",
         (RUN, "--prompt", "a", "--tokenizer", "{W}/in/none.json"), "none.json"),
    Case("generate tokenizer not json", "generate",
         (RUN, "--prompt", "a", "--tokenizer", "{W}/in/ok.txt"), "ok.txt"),
    Case("generate flipped_bytes", "generate", (f"{CKPT}/flipped_bytes", "--prompt", "a"),
         "has changed since it was saved"),
    Case("generate crafted_metadata", "generate", (f"{CKPT}/crafted_metadata", "--prompt", "a"),
         "refused to load posix.system"),
    Case("generate symlink loop", "generate", ("{W}/loop", "--prompt", "a"), "{W}/loop"),
]  # fmt: skip

# -- launcher.runs, and the files a run writes ----------------------------------------------
RUNS = [
    Case("train tensorboard onto a file", "train", ("logging.tensorboard=true",),
         "train_tensorboard_onto_a_file/tensorboard is a file, not a directory"),
    Case("runs no such directory", "runs", ("{W}/nope",), "no such directory: {W}/nope"),
    Case("runs of a file", "runs", ("{W}/in/ok.txt",), "no such directory"),
    Case("runs junk metrics", "runs", ("{W}/junk_runs",),
         ACCEPTED + "a run whose metrics.jsonl is not JSON is listed, its figures unknown"),
    Case("runs plot not a run", "runs", ("plot", "{W}/in", "--out", "{W}/out/p.png"),
         "not a run directory (no metrics.jsonl)"),
    Case("runs plot --out .txt", "runs", ("plot", f"{RUN}", "--out", "{W}/out/p.txt"),
         "must end in .png, .svg or .pdf"),
    Case("runs plot --out missing dir", "runs", ("plot", f"{RUN}", "--out", "{W}/no/p.png"),
         "no such directory {W}/no"),
    Case("runs plot --out a directory", "runs", ("plot", f"{RUN}", "--out", "{W}/out/dir.png"),
         "dir.png"),
    Case("runs plot junk metrics", "runs",
         ("plot", "{W}/junk_runs/r1", "--out", "{W}/out/j.png"),
         "r1/metrics.jsonl:1 is not a metrics row of this launcher"),
    Case("train run dir under a file", "train", ("hydra.run.dir={W}/in/ok.txt/run",),
         "hydra.run.dir={W}/in/ok.txt/run is not writable"),
    Case("train run dir a symlink loop", "train", ("hydra.run.dir={W}/loop",),
         "hydra.run.dir={W}/loop is a symbolic link that leads nowhere"),
    Case("train checkpoint.dir a file", "train", ("checkpoint.dir={W}/in/ok.txt",),
         "checkpoint.dir={W}/in/ok.txt is a file, not a directory"),
    Case("train checkpoint.dir a symlink loop", "train", ("checkpoint.dir={W}/loop",),
         "checkpoint.dir={W}/loop is a symbolic link that leads nowhere"),
    Case("train metrics.jsonl a directory", "train", (), "metrics.jsonl"),
    Case("train plan.json a directory", "train", (), "plan.json"),
    Case("train run.lock a directory", "train", (), "run.lock"),
    Case("train profile onto a file", "train", ("profile.steps=[1]",),
         ACCEPTED + "the profile is lost with a warning, the run goes on"),
    Case("train data.path a fifo", "train", ("data.path={W}/in/fifo",), "fifo"),
    Case("train data.path /dev/zero", "train", ("data.path=/dev/zero",), "/dev/zero"),
]  # fmt: skip

# Run directories of the cases above, each holding a file where a directory goes or the reverse.
RUN_DIR_PLANTS = {
    "train metrics.jsonl a directory": ("metrics.jsonl", "dir"),
    "train plan.json a directory": ("plan.json", "dir"),
    "train run.lock a directory": ("run.lock", "dir"),
    "train profile onto a file": ("profile", "file"),
}

# -- side commands' arguments -------------------------------------------------------------------
SIDE = [
    prepare_case("input a directory", "not a file", "{W}/in"),
    prepare_case("input a fifo", "not a file", "{W}/in/fifo"),
    prepare_case("input /dev/zero", "not a file", "/dev/zero"),
    Case("prepare --out under a file", "prepare", ("--out", "{W}/in/ok.txt/x", "{W}/in/ok.txt"),
         "--out {W}/in/ok.txt/x.bin: {W}/in/ok.txt is not a directory"),
    Case("prepare --out a directory", "prepare", ("--out", "{W}/in", "{W}/in/ok.txt"),
         ACCEPTED + "--out NAME writes NAME.bin and NAME.json; a directory NAME stays as it is"),
    Case("prepare shards onto a directory of other files", "prepare",
         ("--shard-tokens", "10", "--out", "{W}/in", "{W}/in/ok.txt"),
         "--out {W}/in is a directory holding files that are not its shards"),
    Case("prepare shards onto a file", "prepare",
         ("--shard-tokens", "10", "--out", "{W}/in/ok.txt", "{W}/in/ok.txt"),
         "--out {W}/in/ok.txt is a file; the shards go in a directory of that name"),
    Case("prepare --workers abc", "prepare", ("--workers", "abc", "--out", "{W}/out/t",
         "{W}/in/ok.txt"), "invalid int value: 'abc'"),
    Case("checkpoint export under a file", "checkpoint",
         ("export", f"{CKPT}/step_00000002", "{W}/in/ok.txt/m.pt"),
         "OUT {W}/in/ok.txt/m.pt: {W}/in/ok.txt is not a directory"),
    Case("checkpoint export onto a directory", "checkpoint",
         ("export", f"{CKPT}/step_00000002", "{W}/out"), "OUT {W}/out is a directory"),
    Case("checkpoint list missing", "checkpoint", ("list", "{W}/nope"), "{W}/nope"),
    Case("checkpoint list a symlink loop", "checkpoint", ("list", "{W}/loop"), "{W}/loop"),
    Case("checkpoint export a symlink loop", "checkpoint", ("export", "{W}/loop", "{W}/out/l.pt"),
         "{W}/loop"),
    # The GPU benchmark's arguments, refused before minutes of benchmark (not after).
    Case("bench.gpu --steps 0", "bench.gpu", ("--steps", "0"), "--steps=0 must be at least 1"),
    Case("bench.gpu --warmup -1", "bench.gpu", ("--warmup", "-1"), "--warmup=-1 must be 0"),
    Case("bench.gpu --json onto a directory", "bench.gpu", ("--json", "{W}/out"),
         "--json {W}/out is a directory"),
    # A sweep's files (calibrate --from refits the planner to them): impossible figures.
    Case("calibrate --from a negative throughput", "calibrate", ("--from", "{W}/sweeps/negative"),
         "job 0: tokens_per_s=-5.0 is not a positive, finite number"),
    Case("calibrate --from a NaN throughput", "calibrate", ("--from", "{W}/sweeps/nan"),
         "job 0: tokens_per_s=nan is not a positive, finite number"),
    Case("calibrate --from damaged files", "calibrate", ("--from", "{W}/sweeps/damaged"),
         "has no completed job with a measured speed"),
    Case("convert to-hf onto an existing dir", "convert",
         ("to-hf", f"{CKPT}/step_00000002", "{W}/out"), "already exists"),
    # A user's own directories named like a partial output (the launcher's are hidden and
    # carry its host and PID): left as they are, OUT written.
    Case("convert to-hf beside a user's own OUT.partial", "convert",
         ("to-hf", f"{CKPT}/step_00000002", "{W}/out/mine"),
         ACCEPTED + "the user's mine.partial is not the launcher's: kept, OUT written"),
    Case("prepare shards beside a user's own NAME.partial", "prepare",
         ("--shard-tokens", "9", "--out", "{W}/out/shards", "{W}/in/ok.txt"),
         ACCEPTED + "the user's shards.partial is not the launcher's: kept, the shards written"),
    Case("prepare shards again beside a user's own NAME.replaced", "prepare",
         ("--shard-tokens", "9", "--out", "{W}/out/shards", "{W}/in/ok.txt"),
         ACCEPTED + "the old shards are renamed aside under prepare's own name, not the user's"),
    Case("convert to-hf --max-shard-size abc", "convert",
         ("to-hf", f"{CKPT}/step_00000002", "{W}/out/s1", "--max-shard-size", "abc"), "abc"),
    Case("convert to-hf --max-shard-size 0", "convert",
         ("to-hf", f"{CKPT}/step_00000002", "{W}/out/s2", "--max-shard-size", "0"),
         "--max-shard-size=0 must be at least one byte"),
    Case("convert to-hf --dtype fp16", "convert",
         ("to-hf", f"{CKPT}/step_00000002", "{W}/out/s3", "--dtype", "fp16"),
         "invalid choice: 'fp16'"),
    Case("convert to-hf --tokenizer missing", "convert",
         ("to-hf", f"{CKPT}/step_00000002", "{W}/out/s4", "--tokenizer", "{W}/in/none.json"),
         "none.json"),
    Case("convert to-hf under a file", "convert",
         ("to-hf", f"{CKPT}/step_00000002", "{W}/in/ok.txt/hf"),
         "OUT {W}/in/ok.txt/hf: {W}/in/ok.txt is not a directory"),
    Case("convert from-hf under a file", "convert",
         ("from-hf", "{W}/hf/good", "{W}/in/ok.txt/ck"),
         "OUT {W}/in/ok.txt/ck: {W}/in/ok.txt is not a directory"),
    Case("convert from-hf a symlink loop", "convert", ("from-hf", "{W}/loop", "{W}/out/c3"),
         "{W}/loop"),
    Case("convert model-config without config.json", "convert",
         ("model-config", "{W}/hf/no_config"), "config.json"),
]  # fmt: skip

SELFTEST = [
    Case("selftest.steps=1", "selftest", ("selftest.steps=1",), "selftest.steps=1 must be >= 2"),
    Case("selftest.budget_s=nan", "selftest", ("selftest.budget_s=nan",), "selftest.budget_s=nan"),
    Case("selftest.fault=bogus", "selftest", ("selftest.fault=bogus",),
         "selftest.fault takes one of none, all_to_all, send"),
    Case("selftest into an earlier one's directory", "selftest",
         ("hydra.run.dir={W}/selftest_done",),
         "{W}/selftest_done holds a self-test already: give hydra.run.dir another directory"),
    Case("selftest on 2 nodes without torchrun", "selftest", ("hardware.nodes=2",),
         "hardware.nodes=2: a multi-node self-test runs under SLURM or torchrun"),
    Case("selftest of a multi-node recipe without torchrun", "selftest",
         ("recipe=mixtral_8x22b_nemo",),
         "hardware.nodes=4 (recipe=mixtral_8x22b_nemo's): a multi-node self-test runs under "
         "SLURM or torchrun, this command on every node; hardware.nodes=1 tests this node alone"),
    Case("selftest.preset a path", "selftest", ("selftest.preset=../up",),
         "selftest.preset=../up: a preset's name is letters, digits, _ . -"),
    Case("selftest.axes of no axis", "selftest", ("selftest.axes=[tq]",),
         "selftest.axes: tq is not an axis; the axes are dp_replicate, dp_shard, tp, pp, cp, ep"),
    Case("selftest.axes no row has", "selftest",
         ("selftest.axes=[ep]", "hardware.devices_per_node=3"),
         "selftest.axes=[ep]: no row on 3 ranks exercises them"),
]  # fmt: skip

# The commands that print one table of the planner's (docs/architecture.md's tables).
TABLES = ("options", "composes", "limitations")
SIDE += [
    Case(f"{table} with an argument", table, ("--rows",),
         f"--rows: python -m launcher.plan.{table} takes no arguments")
    for table in TABLES
]  # fmt: skip

# -- read-only and full disks (tmpfs mounts made by `build`: root only) ----------------------
RO, FULL, NEARLY = "Read-only file system", "No space left on device", "{W}/nearly"


def on_disks(name: str, command: str, args, shown) -> list[Case]:
    """A command writing into {W}/ro, {W}/full (refused before it writes, naming the disk) and
    {W}/nearly (room for the check, not the output: one line, exit 1, nothing left).
    `args(DIR)` is its command line, `shown(DIR)` how the refusal names its output."""
    refused = [
        Case(f"disk {name} {kind}", command, args(f"{{W}}/{disk}"),
             f"{shown(f'{{W}}/{disk}')}: {{W}}/{disk} is not writable: {why}")
        for kind, disk, why in (("read-only", "ro", RO), ("full", "full", FULL))
    ]  # fmt: skip
    out = args(NEARLY)[-1] if command != "prepare" else f"--out {NEARLY}/t"
    return [*refused, Case(f"disk {name} fills up", command, args(NEARLY),
                           f"{out} was not written: {FULL}", status=1)]  # fmt: skip


DISKS = [
    Case("disk train run dir read-only", "train", ("hydra.run.dir={W}/ro/run",),
         f"hydra.run.dir={{W}}/ro/run is not writable: {RO}"),
    Case("disk train run dir full", "train", ("hydra.run.dir={W}/full/run",),
         f"hydra.run.dir={{W}}/full/run is not writable: {FULL}"),
    Case("disk train checkpoint.dir read-only", "train", ("checkpoint.dir={W}/ro/ck",),
         f"checkpoint.dir={{W}}/ro/ck is not writable: {RO}"),
    Case("disk train checkpoint.dir full", "train", ("checkpoint.dir={W}/full/ck",),
         f"checkpoint.dir={{W}}/full/ck is not writable: {FULL}"),
    Case("disk prepare shards read-only", "prepare",
         ("--shard-tokens", "9", "--out", "{W}/ro/s", "{W}/in/ok.txt"),
         f"{{W}}/ro is not writable: {RO}"),
    Case("disk runs plot read-only", "runs", ("plot", RUN, "--out", "{W}/ro/p.png"),
         f"--out {{W}}/ro/p.png: {{W}}/ro is not writable: {RO}"),
    Case("disk runs plot full", "runs", ("plot", RUN, "--out", "{W}/full/p.png"),
         f"--out {{W}}/full/p.png: {{W}}/full is not writable: {FULL}"),
    # Over an existing plot, on a disk that is full: the old one stays whole.
    Case("disk runs plot over a plot, full", "runs", ("plot", RUN, "--out", "{W}/full/old.png"),
         f"--out {{W}}/full/old.png: {{W}}/full is not writable: {FULL}"),
]  # fmt: skip
DISKS += [
    *on_disks("prepare", "prepare", lambda d: ("--out", f"{d}/t", "{W}/in/big.txt"),
              lambda d: f"--out {d}/t.bin"),
    *on_disks("export", "checkpoint", lambda d: ("export", STEP2, f"{d}/m.pt"),
              lambda d: f"OUT {d}/m.pt"),
    *on_disks("to-hf", "convert", lambda d: ("to-hf", STEP2, f"{d}/hf"), lambda d: f"OUT {d}/hf"),
    *on_disks("from-hf", "convert", lambda d: ("from-hf", "{W}/hf/good", f"{d}/ck"),
              lambda d: f"OUT {d}/ck"),
]  # fmt: skip
DISK_MOUNTS = {"ro": "256k", "full": "256k", "nearly": "256k"}

CASES = (
    CONFIG
    + TOKENS
    + SOURCES
    + PREPARE
    + CHECKPOINTS
    + HF
    + GENERATE
    + RUNS
    + SIDE
    + SELFTEST
    + DISKS
)

# The tiny model every train case and the checkpoint use (one process, seconds), and the
# runs of tests/e2e/test_failures.py and test_survivors.py that need no reference.
TINY_MODEL = (
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=64",
    "train.seq_len=32",
)
TINY = (
    *TINY_MODEL,
    "train.global_batch_size=2",
    "train.micro_batch_size=2",
    "train.eval_interval=0",
    "hardware.devices_per_node=1",
    "logging.wandb.mode=disabled",
)


# -- the files the cases read ----------------------------------------------------------------


def build(w: Path) -> None:
    """Everything under WORK the cases name."""
    import numpy as np

    from launcher.data.batches import ByteTokenizer, write_tokens

    (w / "in").mkdir(parents=True)
    (w / "out").mkdir()
    (w / "selftest_done" / "rows").mkdir(parents=True)  # an earlier self-test's directory
    build_chat(w / "chat")
    # run directories whose files a run reads back lead to devices read without end
    for name, target in ENDLESS:
        run = case_run_dir(w, endless_case_id(name, target))
        run.mkdir(parents=True)
        (run / name).symlink_to(target)
    # token files: a good one, then each broken variant beside it
    tok = w / "tok"
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, 20_000).astype(np.uint32)
    header = write_tokens(str(tok / "good"), [ids], byte_header(ByteTokenizer), ["random"])
    good_bin = (tok / "good.bin").read_bytes()

    def variant(name: str, header_text: str | None, data: bytes | None = good_bin) -> None:
        if header_text is not None:
            (tok / f"{name}.json").write_text(header_text)
        if data is not None:
            (tok / f"{name}.bin").write_bytes(data)

    def changed(**fields) -> str:
        return json.dumps({**header, **fields})

    variant("no_header", None)
    variant("header_not_json", "{not json")
    variant("header_list", "[1, 2]")
    variant("wrong_format", changed(format="other"))
    variant("version_9", changed(version=9))
    variant("dtype_object", changed(dtype="object"))
    variant("dtype_float16", changed(dtype="float16"))
    variant("dtype_missing", json.dumps({k: v for k, v in header.items() if k != "dtype"}))
    variant("n_tokens_string", changed(n_tokens="many"))
    variant("n_tokens_negative", changed(n_tokens=-5))
    variant("n_tokens_bool", changed(n_tokens=True))
    variant("n_tokens_float", changed(n_tokens=100.5))
    variant("vocab_zero", changed(vocab_size=0))
    variant("vocab_too_big_for_uint16", changed(vocab_size=70_000))
    variant("eos_outside", changed(eos_id=300))
    variant("n_tokens_too_many", changed(n_tokens=30_000))
    variant("bin_truncated", changed(), good_bin[:1000])
    variant("no_bin", changed(), None)
    variant("empty", changed(n_tokens=0), b"")
    bad = ids.astype(np.uint16)
    bad[1000] = 300
    variant("ids_outside_vocab", changed(), bad.tobytes())
    variant("vocab_larger_than_model", changed(vocab_size=1000, eos_id=999))
    variant("tiny", changed(n_tokens=100), good_bin[:200])

    # prepare input
    inputs = {
        "empty.txt": b"",
        "blank.txt": b"  \n\t\n",
        "random.bin": bytes(rng.integers(0, 256, 200_000, dtype=np.uint8)),
        "nul.txt": b"hello\0world",
        "latin1.txt": "café au lait".encode("latin-1"),
        "ok.txt": b"a fine document\n",
        "empty.jsonl": b"\n\n",
        "bad.jsonl": b'{"text": "ok"}\n{"text": \n',
        "list.jsonl": b"[1, 2]\n",
        "nofield.jsonl": b'{"body": "x"}\n',
        "number.jsonl": b'{"text": 5}\n',
        "latin1.jsonl": '{"text": "café"}\n'.encode("latin-1"),
    }
    for name, data in inputs.items():
        (w / "in" / name).write_bytes(data)

    # The run directory of the case "train tensorboard onto a file": RUN_DIR/tensorboard a file.
    taken = w / "runs" / "train_tensorboard_onto_a_file"
    taken.mkdir(parents=True)
    (taken / "tensorboard").write_text("")
    for case_id, (name, kind) in RUN_DIR_PLANTS.items():
        run = case_run_dir(w, case_id)
        run.mkdir(parents=True, exist_ok=True)
        (run / name).mkdir() if kind == "dir" else (run / name).write_text("")
    os.mkfifo(w / "in" / "fifo")
    (w / "loop").symlink_to(w / "loop")
    (w / "out" / "dir.png").mkdir()
    for name, speed in (("negative", "-5.0"), ("nan", "NaN"), ("damaged", "2.0")):
        job = w / "sweeps" / name / "0"
        job.mkdir(parents=True)
        (job / "overrides.json").write_text('["train.steps=3"]' if name != "damaged" else '["x"')
        (job / "plan.json").write_text('{"train_steps": 3}' if name != "damaged" else "{oops")
        (job / "metrics.jsonl").write_text(
            "".join(f'{{"step": {s}, "tokens_per_s": {speed}}}\n' for s in (1, 2, 3))
        )
    (w / "out" / "mine.partial").mkdir()  # a user's own, which convert and prepare keep
    (w / "out" / "mine.partial" / "notes.txt").write_text("mine")
    (w / "out" / "shards.partial").mkdir()  # and one a prepare to OUT=shards keeps
    (w / "out" / "shards.partial" / "notes.txt").write_text("mine")
    (w / "out" / "shards.replaced").mkdir()  # and one a second prepare to OUT=shards keeps
    (w / "out" / "shards.replaced" / "notes.txt").write_text("mine")
    junk = w / "junk_runs" / "r1"
    junk.mkdir(parents=True)
    (junk / "metrics.jsonl").write_bytes(b'\xff\xfe not json\n{"step": \n')

    (w / "in" / "big.txt").write_text("a line of a larger document\n" * 20_000)
    build_checkpoints(w)
    build_hf(w)
    mount_disks(w)


def mount_disks(w: Path) -> None:
    """{W}/ro (read-only), {W}/full (no byte free), {W}/nearly (room for the commands' checks,
    not their outputs): tmpfs mounts, or WORK/disks.json saying why there are none."""
    made = []
    for name, size in DISK_MOUNTS.items():
        (w / name).mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(w / name)]
        done = subprocess.run(mount, capture_output=True, text=True)
        if done.returncode:
            unmount_disks(w, made)
            (w / "disks.json").write_text(json.dumps({"why": done.stderr.strip() or "no mount"}))
            return
        made.append(name)
    if "full" in made:
        (w / "full" / "old.png").write_bytes(b"an older plot")
    with contextlib.suppress(OSError), open(w / "full" / "filler", "wb") as f:
        while True:
            f.write(bytes(4096))
    (w / "nearly" / "filler").write_bytes(bytes(160 << 10))
    subprocess.run(["mount", "-o", "remount,ro", str(w / "ro")], check=True)
    (w / "disks.json").write_text(json.dumps({"mounted": made}))


def unmount_disks(w: Path, names) -> None:
    for name in names:
        subprocess.run(["umount", "-l", str(w / name)], capture_output=True)


def byte_header(tokenizer) -> dict:
    return {
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "eos_token": None,
        "tokenizer": tokenizer.name,
        "tokenizer_path": None,
        "tokenizer_sha256": None,
    }


class Evil:
    """A pickle that would run a shell command when loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def build_chat(w: Path) -> None:
    """Tokenizers with a chat template (tok), without (plain), with a broken one (broken), and
    conversations; chat sets."""
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, run as a script
    from chat_data import write

    words = ["<unk>", "<|endoftext|>", "<s>", "user:", "assistant:", "narrator:", "hi", "ok"]
    template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + ' ' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")  # fmt: skip
    for name, config in (("tok", {"chat_template": template}), ("plain", {}),
                         ("broken", {"chat_template": "{% for m in messages %}"})):  # fmt: skip
        (w / name).mkdir(parents=True)
        tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(words)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(w / name / "tokenizer.json"))
        (w / name / "tokenizer_config.json").write_text(json.dumps(config))
    turn = lambda role, text: {"role": role, "content": text}  # noqa: E731
    conversations = {
        "ok": [turn("user", "hi hi"), turn("assistant", "ok ok")],
        "noanswer": [turn("user", "hi")],
        "role": [turn("narrator", "hi"), turn("assistant", "ok")],
    }
    for name, messages in conversations.items():
        (w / f"{name}.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    # chat sets as launcher.prepare --chat writes them (tests/chat_data.py): conversations of
    # 10 and 30 tokens (long), and one whose mask lost its last bytes (cut)
    pairs = [(np.append(np.arange(n - 1) % 200, 256).astype(np.uint32),
              (np.arange(n) % 3 == 1).astype(np.uint8)) for n in (10, 30)]  # fmt: skip
    write(w / "long", pairs, long="refuse")
    write(w / "cut", pairs, long="truncate")
    (w / "cut.mask").write_bytes((w / "cut.mask").read_bytes()[:29])


def build_checkpoints(w: Path) -> None:
    """A real two-step run of the tiny model, then damaged copies of its step 2."""
    run = w / "ckpt"
    subprocess.run(
        [
            sys.executable, "-m", "launcher.train", *TINY, "train.steps=2",
            "checkpoint.interval=1", "checkpoint.keep=0", f"hydra.run.dir={run}",
        ],
        cwd=ROOT, check=True, capture_output=True, env={**os.environ, "WANDB_SILENT": "true"},
    )  # fmt: skip
    ck = run / "checkpoints"
    good = ck / "step_00000002"

    def copy(name: str) -> Path:
        shutil.copytree(good, ck / name)
        return ck / name

    # A crafted .metadata in a checkpoint whose meta.json records no sizes and that has no
    # sums: the allow-list, not a size or a checksum, must refuse it.
    crafted = copy("crafted_metadata")
    (crafted / ".metadata").write_bytes(pickle.dumps(Evil(w / "pwned")))
    meta = json.loads((crafted / "meta.json").read_text())
    (crafted / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "files"}))
    for sums in crafted.glob("sums.*.json"):
        sums.unlink()
    (copy("resized_metadata") / ".metadata").write_bytes(pickle.dumps(Evil(w / "pwned")))
    shard = copy("flipped_bytes") / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    for i in range(64):
        data[len(data) // 2 + i] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.truncate(copy("truncated_shard") / "__0_0.distcp", 1000)
    (copy("missing_shard") / "__0_0.distcp").unlink()
    # The saved checksums removed, then a byte changed: not proven whole, so not loaded.
    unsummed = copy("unsummed_flipped")
    for sums in unsummed.glob("sums.*.json"):
        sums.unlink()
    flip = bytearray((unsummed / "__0_0.distcp").read_bytes())
    flip[len(flip) // 2] ^= 0x01
    (unsummed / "__0_0.distcp").write_bytes(bytes(flip))
    # meta.json's list of files emptied, the sums removed, a shard cut short: .metadata finds it.
    unlisted = copy("unlisted_truncated")
    listed = json.loads((unlisted / "meta.json").read_text())
    (unlisted / "meta.json").write_text(json.dumps({**listed, "files": {}}))
    for sums in unlisted.glob("sums.*.json"):
        sums.unlink()
    os.truncate(unlisted / "__0_0.distcp", 1000)
    (copy("missing_metadata") / ".metadata").unlink()
    metadata = copy("metadata_not_pickle") / ".metadata"
    metadata.write_bytes(b"not a pickle at all" + b"\0" * (metadata.stat().st_size - 19))
    (copy("empty_metadata") / ".metadata").write_bytes(b"")
    (copy("meta_list") / "meta.json").write_text("[1, 2]")
    (copy("meta_not_json") / "meta.json").write_text("{oops")
    shutil.copytree(good, ck / "step_00000001.partial")


def build_hf(w: Path) -> None:
    """A Hugging Face directory of the checkpoint's model, then broken copies of it."""
    from launcher.convert import main as convert

    good = w / "hf" / "good"
    assert convert(["to-hf", str(w / "ckpt" / "checkpoints" / "step_00000002"), str(good)]) == 0
    weights = good / "model.safetensors"
    config = json.loads((good / "config.json").read_text())

    def copy(name: str) -> Path:
        shutil.copytree(good, w / "hf" / name)
        return w / "hf" / name

    (copy("no_config") / "config.json").unlink()
    (copy("config_not_json") / "config.json").write_text("{nope")
    (copy("config_list") / "config.json").write_text("[]")
    (copy("unknown_model_type") / "config.json").write_text(
        json.dumps({**config, "model_type": "bert"})
    )
    (copy("other_shape") / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    (copy("no_weights") / "model.safetensors").unlink()
    escapes = copy("index_escapes")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "../good/model.safetensors"}}
    (escapes / "model.safetensors.index.json").write_text(json.dumps(index))
    (copy("index_not_json") / "model.safetensors.index.json").write_text("{")
    (copy("index_list") / "model.safetensors.index.json").write_text('{"weight_map": [1]}')
    raw = weights.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    (copy("header_too_long") / "model.safetensors").write_bytes(
        (2**62).to_bytes(8, "little") + raw[8:]
    )
    (copy("header_not_json") / "model.safetensors").write_bytes(raw[:8] + b"{" * n + raw[8 + n :])
    listed = b"[" + b" " * (n - 2) + b"]"
    (copy("header_list") / "model.safetensors").write_bytes(raw[:8] + listed + raw[8 + n :])
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    tensors.pop(next(k for k in tensors if "mlp" in k))
    save_file(tensors, copy("tensor_missing") / "model.safetensors", metadata={"format": "pt"})


# -- running the cases ---------------------------------------------------------------------------


def entry(command: str):
    """(the command's entry point, whether it is a Hydra app reading sys.argv)."""
    if command == "plan":
        from launcher.plan.__main__ import main
    elif command == "train":
        from launcher.train import main
    elif command == "prepare":
        from launcher.prepare import main
    elif command == "checkpoint":
        from launcher.checkpoint.__main__ import main
    elif command == "generate":
        from launcher.generate import main
    elif command == "runs":
        from launcher.runs import main
    elif command == "calibrate":
        from launcher.plan.calibrate import main
    elif command == "bench.gpu":
        from launcher.bench.gpu import main
    elif command == "selftest":
        from launcher.selftest.__main__ import main
    elif command in TABLES:
        from launcher.cli import print_table

        module = f"launcher.plan.{command}"
        table = importlib.import_module(module)
        return lambda args: print_table(module, table.markdown, table.__doc__, args), False
    else:
        from launcher.convert import main
    return main, command in ("plan", "train", "selftest")


def run_case(case: Case, w: Path) -> dict:
    import launcher.cli

    args = [a.replace("{W}", str(w)) for a in case.args]
    main, hydra = entry(case.command)
    if hydra:
        run_dir = case_run_dir(w, case.id)
        args = [*TINY, "train.steps=1", *args] if case.command == "train" else args
        if not any(a.startswith("hydra.run.dir=") for a in args):
            args.append(f"hydra.run.dir={run_dir}")
        args.append("hydra.output_subdir=null")
        launcher.cli._task_started = False  # each case is a fresh command
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    crash = None
    with tempfile.TemporaryFile() as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            if hydra:
                sys.argv = [f"launcher.{case.command}", *args]
                code = main()
            else:
                code = main(args)
            code = code or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # a crash: what the test must not see
            code, crash = 1, traceback.format_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
        out.seek(0)
        text = out.read().decode("utf-8", errors="replace")
    return {"id": case.id, "code": code, "output": text + (crash or ""), "crash": crash is not None}


def main(argv: list[str]) -> int:
    w, results = Path(argv[0]), Path(argv[1])
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    try:
        build(w)
        mounted = json.loads((w / "disks.json").read_text()).get("mounted")
        with open(results, "a") as f:
            for case in CASES:
                if case in DISKS and not mounted:
                    continue  # the test says why (disks.json)
                print(json.dumps({"started": case.id}), file=f, flush=True)
                print(json.dumps(run_case(case, w)), file=f, flush=True)
            print(json.dumps({"pwned": (w / "pwned").exists()}), file=f, flush=True)
    finally:
        unmount_disks(w, DISK_MOUNTS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
