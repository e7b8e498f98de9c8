"""`python -m launcher.convert`: Hugging Face checkpoints in and out.

  to-hf CKPT OUT_DIR        a checkpoint of ours -> a directory that
                            transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR) loads
                            (config.json, sharded safetensors + index)
  from-hf HF_DIR OUT_CKPT   a Hugging Face directory -> a checkpoint of ours (weights only),
                            for checkpoint.initial_load_path=OUT_CKPT
  model-config HF_DIR       print the model preset (model/NAME.yaml of a config directory)
                            for HF_DIR/config.json

Training can also start from a Hugging Face directory directly, each rank reading only its
shards: checkpoint.initial_load_path=HF_DIR checkpoint.initial_load_format=hf.
Families: llama, mixtral, deepseek (DeepseekV3ForCausalLM, or DeepseekV2ForCausalLM for a
softmax router). Our q/k projections rotate interleaved pairs, transformers' Llama and Mixtral
rotate halves: their rows are permuted per head both ways (launcher/hf/weights.py); DeepSeek's
checkpoints keep interleaved pairs, as ours.

Examples:
  python -m launcher.convert to-hf outputs/RUN/checkpoints/step_00000200 /tmp/my-llama --dtype bf16
  python -m launcher.convert model-config /models/Llama-3.1-8B > ~/llm-conf/model/my_llama.yaml
  python -m launcher.train --config-dir ~/llm-conf model=my_llama ...   (docs/config.md)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import shutil
import sys
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from launcher.checkpoint.store import (
    META,
    CheckpointError,
    Entry,
    newest_complete,
    open_checkpoint,
    resolve_checkpoint_dir,
    seal,
)
from launcher.cli import USAGE_ERROR, fail
from launcher.config import ModelConfig
from launcher.data.batches import read_header
from launcher.data.sources import first_token_file
from launcher.hf.config_json import (
    HFConfigError,
    model_fields,
    preset_yaml,
    read_config,
    to_hf_config,
    unsupported,
)
from launcher.hf.names import check, held_depths, sources
from launcher.runtime.scratch import command, output_problem, writing

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
# Copied into a to-hf directory from beside the tokenizer.json, when present: the chat template
# too (in tokenizer_config.json, or chat_template.jinja as transformers 5 saves it).
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def run_tokenizer(meta: dict) -> tuple[Path, int] | None:
    """(tokenizer.json, EOS id) the checkpoint's run prepared its data with: named in its token
    file's header, still there and unchanged (same sha256). None otherwise."""
    path = first_token_file((meta.get("config") or {}).get("data") or {})
    try:
        header = read_header(path) if path else {}
    except (OSError, ValueError):
        return None
    tok = header.get("tokenizer_path")
    if not tok or not Path(tok).is_file():
        return None
    if hashlib.sha256(Path(tok).read_bytes()).hexdigest() != header.get("tokenizer_sha256"):
        return None
    return Path(tok), header["eos_id"]


def explicit_tokenizer(path: Path) -> tuple[Path, int]:
    from launcher.prepare import InputError, hf_encoder  # tokenizers: only to read a tokenizer

    try:
        encoder, _ = hf_encoder(path, None)
    except InputError as e:
        fail(str(e))
    return path, encoder.header["eos_id"]


def stop_ids(tok: Path, eos_id: int) -> int | list[int]:
    """config.json's eos_token_id: the documents' EOS, and where the tokenizer has a chat
    template, its end of turn (tokenizer_config.json's eos_token) too, so that generate stops
    after an answer."""
    from launcher.data import chat  # jinja2: only to read a template

    try:
        turn = chat.template_of(tok).variables.get("eos_token")
    except chat.ChatError:
        return eos_id
    from tokenizers import Tokenizer

    turn_id = Tokenizer.from_file(str(tok)).token_to_id(turn) if turn else None
    return eos_id if turn_id is None or turn_id == eos_id else [eos_id, turn_id]


def copy_tokenizer(tok: Path, out: Path) -> list[str]:
    """tokenizer.json and its companions into out; the names copied."""
    shutil.copyfile(tok, out / "tokenizer.json")
    copied = ["tokenizer.json"]
    for name in TOKENIZER_FILES:
        if (tok.parent / name).is_file():
            shutil.copyfile(tok.parent / name, out / name)
            copied.append(name)
    return copied


def newest(path: Path) -> Entry:
    """The checkpoint at path, or the newest complete one under a run / checkpoints dir."""
    if not (path / META).is_file():
        entry = newest_complete(resolve_checkpoint_dir(path))
        if entry is not None:
            return entry
    return open_checkpoint(path)  # refused with the reason


def refuse_existing(out: Path) -> None:
    """Nothing is overwritten, and OUT's directory can be made."""
    if out.exists() or out.is_symlink():
        fail(f"{out} already exists; choose another output path or remove it")
    if problem := output_problem(out, "OUT"):
        fail(problem)


@contextlib.contextmanager
def fresh(out: Path) -> Iterator[Path]:
    """A directory to write OUT into, renamed to OUT once complete inside the block (OUT checked
    by the caller); removed however the block ends otherwise (runtime/scratch.py)."""
    with writing(out) as partial:
        try:
            partial.mkdir(parents=True)
        except OSError as e:  # a read-only or full disk
            fail(f"OUT {out} cannot be written: {e.strerror or e} ({e.filename})")
        yield partial


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?)B?", text.strip().upper())
    if not match:
        fail(f"--max-shard-size={text} is not a size like 5GB, 500MB or 100KB")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[match.group(2)]
    size = int(float(match.group(1)) * scale)
    if size < 1:
        fail(f"--max-shard-size={text} must be at least one byte")
    return size


def to_hf_command(
    ckpt: Path, out: Path, dtype: str | None, max_shard: int, tokenizer: Path | None
) -> int:
    refuse_existing(out)
    try:
        entry = newest(ckpt)
    except CheckpointError as e:
        fail(str(e))
    model = ((entry.meta or {}).get("config") or {}).get("model")
    if not model:
        fail(f"{entry.path}/meta.json holds no model config")
    try:
        table = sources(model)
    except HFConfigError as e:
        fail(str(e))

    # torch and what needs it: loaded once the arguments are checked
    import torch
    from rich.progress import track

    from launcher.checkpoint import reader
    from launcher.hf.weights import shard_plan, to_hf, write_index, write_shard
    from launcher.parallel.data_parallel import DTYPES

    damaged = reader.checkpoint_damage(entry)  # files, checksums, the metadata's allow-list
    if damaged:
        fail(f"{entry.path} is damaged: {'; '.join(damaged)}")
    metadata = reader.read_metadata_file(entry.path / ".metadata").state_dict_metadata
    saved = metadata[f"model.{next(iter(table))}"].properties.dtype
    target = DTYPES[dtype] if dtype else saved
    config = to_hf_config(model, str(target).removeprefix("torch."))
    with fresh(out) as partial:
        groups = shard_plan(table, target.itemsize, max_shard)
        weight_map: dict[str, str] = {}
        total = 0
        for i, names in enumerate(track(groups, description="writing safetensors", transient=True)):
            # One file's parameters at a time: memory stays at one shard, whatever the model.
            state = {n: torch.empty(metadata[f"model.{n}"].size, dtype=saved) for n in names}
            reader.load({"model": state}, entry.path, no_dist=True)
            tensors = {
                # The routers' correction biases stay fp32, as transformers keeps them.
                hf_name: t.float() if name.endswith("expert_bias") else t.to(target)
                for name in names
                for hf_name, t in to_hf(state[name], table[name])
            }
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            write_shard(partial, i + 1, len(groups), tensors, weight_map)
        if len(groups) == 1:  # one file: named as transformers names a single shard
            (partial / weight_map[next(iter(weight_map))]).rename(partial / "model.safetensors")
        else:
            write_index(partial, weight_map, total)
        tok = explicit_tokenizer(tokenizer) if tokenizer else run_tokenizer(entry.meta or {})
        note = "; no tokenizer (pass --tokenizer PATH/tokenizer.json to add one)"
        if tok is not None:
            config["eos_token_id"] = stop_ids(*tok)
            note = f"; {', '.join(copy_tokenizer(tok[0], partial))} from {tok[0].parent}"
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        partial.rename(out)
    print(
        f"wrote {out}: {config['architectures'][0]}, {len(weight_map)} tensors in "
        f"{len(groups)} file(s), {total / 1e6:,.1f} MB {config['torch_dtype']}, from step "
        f"{entry.step} of {entry.path}{note}"
    )
    return 0


def hf_model(hf_dir: Path) -> tuple[dict, dict]:
    """(config.json, our model fields) of a usable Hugging Face directory, or exit 2."""
    try:
        hf = read_config(hf_dir)
        fields = held_depths(hf_dir, model_fields(hf))
    except HFConfigError as e:
        fail(str(e))
    problems = [f"config.json has {u}" for u in unsupported(hf)] or check(hf_dir, fields)
    if problems:
        fail(f"{hf_dir}: " + "; ".join(problems))
    return hf, fields


def from_hf_command(hf_dir: Path, out: Path) -> int:
    refuse_existing(out)
    _, fields = hf_model(hf_dir)
    # torch and what needs it: loaded once the arguments are checked
    import torch.distributed.checkpoint as dcp

    from launcher.hf.weights import from_hf

    state = from_hf(hf_dir, fields)
    with fresh(out) as partial:
        dcp.save({"model": state}, checkpoint_id=str(partial), no_dist=True)
        model = {**asdict(ModelConfig()), "name": _name(hf_dir), **fields}
        # The model only: a run started from it begins at step 1 with fresh optimizer states.
        # What proves it whole (checkpoint/reader.py) is written before OUT appears: a convert
        # killed at any moment leaves either no OUT or a whole one.
        seal(
            partial,
            out,
            {"step": 0, "samples": 0, "weights_only": True, "source": str(hf_dir),
             "layout": {}, "config": {"model": model}},
        )  # fmt: skip
    n = sum(t.numel() for t in state.values())
    print(
        f"wrote {out}: {len(state)} tensors, {n:,} parameters ({fields['family']}); start a "
        f"run from it with checkpoint.initial_load_path={out}"
    )
    return 0


def _name(hf_dir: Path) -> str:
    return re.sub(r"[^a-z0-9]+", "_", hf_dir.resolve().name.lower()).strip("_") or "hf_model"


def model_config_command(hf_dir: Path, name: str | None) -> int:
    hf, fields = hf_model(hf_dir)
    sys.stdout.write(preset_yaml(name or _name(hf_dir), str(hf_dir), hf, fields))
    return 0


@command("nothing was written, and nothing half-written is left")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-hf", help="a checkpoint of ours -> a Hugging Face directory")
    p.add_argument("checkpoint", type=Path, help="step_NNNNNNNN dir (or a run dir: its newest)")
    p.add_argument("out", type=Path, help="the directory to write (must not exist)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="default: as saved (the fp32 master)")
    p.add_argument("--max-shard-size", default="5GB", help="per safetensors file (default 5GB)")
    p.add_argument(
        "--tokenizer",
        type=Path,
        help="tokenizer.json to include (default: the one the run's data was prepared with, "
        "if its token file's header names it and it is unchanged)",
    )
    p = sub.add_parser("from-hf", help="a Hugging Face directory -> a checkpoint of ours")
    p.add_argument("hf_dir", type=Path, help="config.json + *.safetensors")
    p.add_argument("out", type=Path, help="the checkpoint directory to write (must not exist)")
    p = sub.add_parser("model-config", help="print the model preset YAML for HF_DIR/config.json")
    p.add_argument("hf_dir", type=Path)
    p.add_argument("--name", help="the preset's name (default: from the directory name)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return USAGE_ERROR if e.code else 0
    if args.command == "to-hf":
        size = parse_size(args.max_shard_size)
        return to_hf_command(args.checkpoint, args.out, args.dtype, size, args.tokenizer)
    if args.command == "from-hf":
        return from_hf_command(args.hf_dir, args.out)
    return model_config_command(args.hf_dir, args.name)


if __name__ == "__main__":
    sys.exit(main())
