"""Reading a checkpoint runs none of its code.

torch.distributed.checkpoint unpickles `.metadata` with plain `pickle.load` and `torch.load`s
every non-tensor entry with weights_only=False: a crafted checkpoint from someone else would
run whatever its pickles name (a `.metadata` naming `os.system` ran it before this module: the
`crafted_metadata` cases of tests/e2e/bad_inputs.py). Here `.metadata` is unpickled through an
allow-list of DCP's metadata classes, torch's size, layout and dtypes, and non-tensor entries
through torch's weights-only unpickler; anything else is refused by name (`UnsafeCheckpoint`).
Tensors are read by DCP itself with weights_only=True. What is trusted: these classes'
constructors, and the bytes of the tensors (checked against the checkpoint's checksums where it
has them: launcher/checkpoint/store.py).
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from launcher.checkpoint.store import METADATA, damage, recorded_sums

# (module, name) the metadata pickle may construct.
ALLOWED = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint whose metadata names something other than checkpoint metadata."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"refused to load {module}.{name}: a checkpoint's metadata holds only "
            "torch.distributed.checkpoint metadata classes (launcher/checkpoint/reader.py)"
        )


def read_metadata_file(path) -> Metadata:
    """A `.metadata` file, unpickled through the allow-list."""
    with open(path, "rb") as f:
        metadata = MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is read through the allow-list."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata_file(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor entries with torch's weights-only unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpoint(f"{read_item.dest_index.fqn}: {e}") from e
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def checkpoint_damage(entry, share: tuple[int, int] | None = (0, 1)) -> list[str]:
    """store.damage (files missing, resized, changed), and on the first of `share`'s ranks
    a `.metadata` that the allow-list refuses or that is not a whole pickle, and what it reads
    that the checkpoint does not hold whole (`unproven`)."""

    problems = damage(entry, share)
    if problems or (share is not None and share[0] != 0):
        return problems
    try:
        metadata = read_metadata_file(entry.path / METADATA)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        return [f"{entry.path / METADATA}: {e}"]
    return unproven(entry, metadata, checksums=share is not None)


def unproven(entry, metadata: Metadata, checksums: bool) -> list[str]:
    """What `.metadata` reads that the checkpoint does not hold whole: a file it names that is
    missing or shorter than the bytes read from it, and (with `checksums`) a file, .metadata
    included, without its saved CRC-32 (a sums.RANK.json removed, or never written: a save
    whose process died before adding it cannot be told from a tampered one)."""
    extent: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        extent[info.relative_path] = max(extent.get(info.relative_path, 0), end)
    sums = recorded_sums(entry) if checksums else {}
    out = []
    for name, end in sorted(extent.items()):
        f = entry.path / name
        if not f.is_file():
            out.append(f"{f} is missing")
        elif f.stat().st_size < end:
            out.append(f"{f} has {f.stat().st_size:,} bytes; {METADATA} reads {end:,} from it")
    unsummed = sorted({*extent, METADATA} - set(sums)) if checksums else []
    for name in unsummed:
        out.append(
            f"{entry.path / name} has no saved checksum (its sums.RANK.json is missing or "
            "edited): it cannot be proven whole"
        )
    return out


def load(state: dict, path, no_dist: bool) -> None:
    """dcp.load of `state` from the checkpoint directory `path`, running none of its code."""
    import torch.distributed.checkpoint as dcp

    dcp.load(
        state,
        storage_reader=SafeReader(str(path)),
        planner=SafePlanner(),
        no_dist=no_dist,
    )
