"""Checkpoint directories on disk, without torch: names, completeness, listing, checks, pruning.

CHECKPOINT_DIR/step_00000120/ is complete: DCP's shards and `.metadata`, plus `meta.json`
(step, layout, resolved config, plan: readable with nothing but Python). A save writes into
step_00000120.partial/ and becomes step_00000120/ by one atomic rename, done by global rank 0
once DCP has reported every rank's shards written and meta.json is on disk. A crash mid-save
leaves a `.partial` directory, which resuming skips and loading by path refuses.

Before rank 0 publishes a save, each rank sums the files it wrote (sums.RANK.json, the CRC-32
of each) and meta.json's `files` records every file's size: a checkpoint is never visible
without what proves it whole. `damage` finds a missing, truncated or changed file, and
resuming falls back past a damaged checkpoint to the newest intact one. What is whole is proven
by what the checkpoint holds, not by a list that can lose entries: DCP's .metadata names every
file and the bytes read from it, and each of those files must have its saved checksum
(launcher/checkpoint/reader.py, checkpoint_damage).

Nothing leaves the complete set half-deleted: a checkpoint is renamed out of it
(step_N.deleting, invisible like a partial) before its files are removed, by pruning and by a
publish that replaces a checkpoint of the same step. So at every instant of a save the newest
checkpoint that can be proven whole is there: the new one once published, else the ones before.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

from launcher.hf.names import check
from launcher.layout import AXES
from launcher.models import families

FORMAT = "llm-launcher-checkpoint"
META = "meta.json"
PARTIAL = ".partial"
DELETING = ".deleting"  # renamed out of the complete set, being removed
NAME = re.compile(r"^step_(\d{8})(\.partial)?$")
# Model fields that decide the shapes (and names) of the parameters a checkpoint holds.
SHAPE_FIELDS = (
    "family", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size",
    "tie_embeddings", "n_routed_experts", "n_shared_experts", "moe_ffn_dim", "n_dense_layers",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "score_func",  # sigmoid routers hold an expert_bias buffer
)  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with the reason in words."""


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


@dataclass
class Entry:
    path: Path
    step: int
    complete: bool
    meta: dict | None

    @property
    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())

    @property
    def layout(self) -> str:
        """The degrees it was saved under, e.g. `dp_shard=2 tp=2` (`-` when unknown)."""
        lay = (self.meta or {}).get("layout") or {}
        text = " ".join(f"{a}={lay[a]}" for a in AXES if lay.get(a, 1) > 1)
        if lay.get("pp", 1) > 1:
            text += f" {lay['schedule']}/{lay['stages_per_rank']}"
        return text or ("single process" if lay else "-")


def list_checkpoints(directory: str | Path) -> list[Entry]:
    """Every checkpoint directory, complete or not, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    out = []
    for path in root.iterdir():
        match = NAME.match(path.name)
        if not match or not path.is_dir():
            continue
        complete = match.group(2) is None and (path / META).is_file()
        meta = read_json(path / META) if complete else None
        out.append(Entry(path, int(match.group(1)), complete and meta is not None, meta))
    return sorted(out, key=lambda e: (e.step, e.complete))


def complete_newest_first(directory: str | Path) -> list[Entry]:
    return [e for e in reversed(list_checkpoints(directory)) if e.complete]


def newest_complete(directory: str | Path) -> Entry | None:
    complete = [e for e in list_checkpoints(directory) if e.complete]
    return complete[-1] if complete else None


def read_json(path: Path) -> dict | None:
    """A JSON object from `path`; None when it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


METADATA = ".metadata"  # DCP's index of every tensor's file, offset and length
SUMS = "sums.{rank}.json"  # the CRC-32 of each file a rank wrote, added after the save
CHUNK = 16 * 2**20


def crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            crc = zlib.crc32(block, crc)  # releases the GIL: training goes on meanwhile
    return f"{crc:08x}"


def file_sizes(directory: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes": size}} of these files of a checkpoint directory."""
    return {n: {"bytes": (directory / n).stat().st_size} for n in names}


def rank_files(directory: Path, rank: int) -> list[str]:
    """The shard files DCP's FileSystemWriter wrote for `rank` (__RANK_I.distcp), plus, on
    rank 0, DCP's .metadata."""
    names = sorted(p.name for p in directory.glob(f"__{rank}_*.distcp"))
    return names + ([METADATA] if rank == 0 and (directory / METADATA).is_file() else [])


def write_sums(directory: Path, rank: int, names: list[str]) -> dict[str, dict]:
    """Sum the files this rank wrote into a save's directory before it is published: their
    CRC-32 into sums.RANK.json (flushed to disk); returns their sizes, for meta.json. An
    OSError (a disk that filled) leaves no sums file: the save is then not published."""
    sums = {name: crc32(directory / name) for name in names}
    path = directory / SUMS.format(rank=rank)
    try:
        with open(path, "w") as f:
            f.write(json.dumps(sums))
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        path.unlink(missing_ok=True)
        raise
    return file_sizes(directory, names)


def recorded_sums(entry: Entry) -> dict[str, str]:
    """name -> CRC-32 of the checkpoint's files, from its sums.*.json (an unreadable one
    counts as absent: its files keep their size check)."""
    out = {}
    for path in entry.path.glob(SUMS.format(rank="*")):
        sums = read_json(path) or {}
        out.update({k: v for k, v in sums.items() if isinstance(v, str)})
    return out


def damage(entry: Entry, share: tuple[int, int] | None = (0, 1)) -> list[str]:
    """What is wrong with a complete checkpoint's files: DCP's .metadata missing, a recorded
    file missing or of another size (every file), or another CRC-32 where one was recorded
    (the files at positions rank, rank + world, ... of (rank, world) = `share`, so that ranks
    split the reading; None: sizes only). Checkpoints from before sizes were recorded are
    checked for .metadata only."""
    path, recorded = entry.path, (entry.meta or {}).get("files") or {}
    if not (path / METADATA).is_file():
        return [f"{path / METADATA} is missing"]
    sums = recorded_sums(entry) if share else {}
    out = []
    # The files the sums name are checked too: an edited meta.json hides none of them.
    for i, name in enumerate(sorted(set(recorded) | set(sums))):
        f, want = path / name, recorded.get(name)
        if not f.is_file():
            out.append(f"{f} is missing")
        elif want is not None and f.stat().st_size != want["bytes"]:
            out.append(f"{f} has {f.stat().st_size:,} bytes, {want['bytes']:,} when saved")
        elif (
            share and i % share[1] == share[0] and name in sums and (now := crc32(f)) != sums[name]
        ):
            out.append(f"{f} has changed since it was saved (CRC-32 {now}, saved {sums[name]})")
    return out


def open_checkpoint(path: str | Path) -> Entry:
    """The checkpoint at `path`, refused with the reason unless it is complete."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    if path.name.endswith(PARTIAL) or not (path / META).is_file():
        raise CheckpointError(
            f"{path} is incomplete: a save did not finish (no {META}); the previous complete "
            "checkpoint in its directory is the one to resume from"
        )
    meta = read_json(path / META)
    if meta is None or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}/{META} is not an {FORMAT} file")
    match = NAME.match(path.name)
    return Entry(path, int(match.group(1)) if match else meta["step"], True, meta)


def shape_mismatches(saved: dict, model: dict) -> list[str]:
    """`saved.field=x but model.field=y` for every shape field that differs."""
    fam = families.FAMILIES.get(model.get("family"))
    fields = SHAPE_FIELDS + (fam.embedding.fields if fam else ())  # learned positions' rows

    def value(config: dict, f: str):
        # head_dim None means dim // n_heads: compared as such when the other side sets it.
        if f == "head_dim" and config.get(f) is None and (saved.get(f) or model.get(f)):
            return config["dim"] // config["n_heads"]
        if f == "score_func":  # checkpoints from before routing options were softmax
            return config.get(f) or "softmax"
        return config.get(f)

    return [
        f"{f}={value(saved, f)} in the checkpoint but model.{f}={value(model, f)}"
        for f in fields
        if value(saved, f) != value(model, f)
    ]


def resolve_checkpoint_dir(path: Path) -> Path:
    """RUN_DIR/checkpoints when given a run directory, else the directory itself."""
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def run_checkpoint_dir(configured: str | None, run_dir: str | Path) -> Path:
    """checkpoint.dir, or RUN_DIR/checkpoints by default."""
    return Path(configured) if configured else Path(run_dir) / "checkpoints"


def starting_checkpoint(
    directory: str | Path, resume: str, load_path: str | None
) -> tuple[Entry | None, bool]:
    """(checkpoint to start from, whether it is an initial load): the newest complete one in
    `directory` (resume=auto), else load_path (a checkpoint of ours), else None. Raises
    CheckpointError for a load_path that is not a complete checkpoint."""
    if resume == "auto":
        entry = newest_complete(directory)
        if entry is not None:
            return entry, False
    if load_path:
        return open_checkpoint(load_path), True
    return None, False


def finished(directory: str | Path, resume: str, steps: int) -> Entry | None:
    """The run's newest checkpoint when it already holds every step (`steps`) and every file it
    records, .metadata included, has its saved CRC-32 and still matches it: the checkpoint
    a resume would start from, so nothing is left to train. None otherwise (the ranks decide:
    a checkpoint whose files cannot be proven whole is passed over for an older one)."""
    entry = newest_complete(directory) if resume == "auto" else None
    if entry is None or entry.step < steps or (entry.meta or {}).get("weights_only"):
        return None
    recorded = set((entry.meta or {}).get("files") or {})
    if not recorded or not (recorded | {METADATA}) <= set(recorded_sums(entry)):
        return None
    return None if damage(entry) else entry


def nothing_left(step: int, steps: int, run_dir: str | Path) -> str:
    """What a run whose checkpoint is at or past train.steps says instead of training."""
    # A new train.steps alone would name another run directory (the overrides' hash):
    # continuing this run needs this directory named too.
    return (
        f"nothing left to train: the checkpoint is at step {step} of train.steps={steps}. To "
        f"train this run further, give it more steps in this directory: train.steps=N "
        f"hydra.run.dir={run_dir} (the same command with another train.steps alone starts a "
        "new run elsewhere)"
    )


def _hugging_face_dir(path: Path) -> bool:
    """A directory as transformers' save_pretrained leaves it, with none of our meta.json."""
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and not (path / META).exists()
        and any(path.glob("*.safetensors"))
    )


def start_problems(
    directory: str | Path, resume: str, load_path: str | None, load_format: str, model: dict
) -> list[str]:
    """Why the run cannot start from (or without) its checkpoints, before any process starts:
    an unusable initial_load_path (a checkpoint of ours, or a Hugging Face directory), a
    model that differs from the checkpoint's, or resume=never over a directory that already
    holds checkpoints (nothing is overwritten)."""
    newest = newest_complete(directory)
    if resume == "never" and newest is not None:
        return [
            f"checkpoint.resume=never but checkpoint.dir={directory} already holds checkpoints "
            f"(newest: step {newest.step}); remove them or choose another hydra.run.dir or "
            "checkpoint.dir"
        ]
    hf = load_format == "hf"
    if not hf and load_path and _hugging_face_dir(Path(load_path)):
        return [
            f"checkpoint.initial_load_path={load_path} is a Hugging Face model directory "
            "(config.json and *.safetensors), not a checkpoint of this launcher: load it with "
            "checkpoint.initial_load_format=hf"
        ]
    try:
        entry, initial = starting_checkpoint(directory, resume, None if hf else load_path)
    except CheckpointError as e:
        return [f"checkpoint.initial_load_path: {e}"]
    damaged = damage(entry, None) if initial else []  # checksums: the ranks (Trainer.intact)
    if damaged:
        return [f"checkpoint.initial_load_path: {entry.path} is damaged ({'; '.join(damaged)})"]
    if entry is None:
        if hf and load_path:
            return [f"checkpoint.initial_load_path: {p}" for p in check(load_path, model)]
        return []
    saved = ((entry.meta or {}).get("config") or {}).get("model") or {}
    wrong = shape_mismatches(saved, model)
    if wrong:
        return [f"{entry.path} holds another model: " + "; ".join(wrong)]
    return []


def write_meta(directory: Path, meta: dict) -> None:
    """meta.json, flushed to disk before the directory is renamed into place."""
    path = directory / META
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "version": 1, **meta}, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())


def seal(partial: Path, final: Path, meta: dict) -> None:
    """Finish a one-process save as the Checkpointer finishes a run's: its sums, meta.json with
    every file's size, then the rename to `final`."""
    files = write_sums(partial, 0, rank_files(partial, 0))
    write_meta(partial, {**meta, "files": files})
    publish(partial, final)


def delete(path: Path) -> None:
    """Remove a directory, or only the link where it is a symbolic link (to itself, or to
    something the launcher did not make)."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def remove(path: Path) -> None:
    """Delete a checkpoint directory: first renamed out of the complete set in one step (a
    kill while its files go leaves nothing that looks like a checkpoint), then removed."""
    aside = path.with_name(path.name + DELETING)
    delete(aside)  # left by a removal that was killed
    with contextlib.suppress(FileNotFoundError):
        os.rename(path, aside)
    delete(aside)


def sync_dir(directory: Path) -> None:
    """Flush a directory's entries (a rename) to disk."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def publish(partial: Path, final: Path) -> None:
    """Make a finished save visible: one atomic rename (same filesystem). Whatever holds the
    name already (a checkpoint of the same step from before a restart that resumed from an
    older one, a stray link) is renamed aside first and removed after: at no instant is
    there neither."""
    aside = final.with_name(final.name + DELETING)
    if final.exists() or final.is_symlink():
        delete(aside)
        os.rename(final, aside)
    os.rename(partial, final)
    sync_dir(final.parent)
    delete(aside)


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (0 keeps all), any partial one
    older than the newest complete one, and what a killed removal left; returns what was
    deleted."""
    entries = list_checkpoints(directory)
    complete = [e for e in entries if e.complete]
    for left in Path(directory).glob(f"step_*{DELETING}"):
        delete(left)
    if not complete:
        return []
    doomed = complete[:-keep] if keep > 0 else []
    doomed += [e for e in entries if not e.complete and e.step < complete[-1].step]
    for e in doomed:
        remove(e.path)
    return [e.path for e in doomed]
