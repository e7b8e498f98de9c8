"""A checkpoint's model, one tensor at a time: read from DCP's shard files directly and written
as a `torch.save` file, whatever the model's size.

`tensors(entry)` yields (name, full tensor) in the checkpoint's order, each read on its own (DCP
reads only that tensor's chunks, from every rank's file that holds one). `save_streamed` writes
the state dict torch.save would write for them, in torch's own zip format (data.pkl, then each
storage as a record), but with the pickle made from the tensors' shapes before any is read and
each storage written and dropped as it arrives: at most one tensor is in memory.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from launcher.checkpoint import reader


def model_tensors(entry) -> dict[str, TensorStorageMetadata]:
    """The model's tensors of a checkpoint (name without `model.` -> shape and dtype)."""
    metadata = reader.read_metadata_file(entry.path / ".metadata").state_dict_metadata
    return {
        key.removeprefix("model."): meta
        for key, meta in metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }


def read_tensor(entry, name: str, meta: TensorStorageMetadata) -> torch.Tensor:
    """One full tensor of the model, read from the shards that hold its pieces."""
    out = torch.empty(meta.size, dtype=meta.properties.dtype)
    reader.load({"model": {name: out}}, entry.path, no_dist=True)
    return out


class _Storage:
    """Stands for a storage written after the pickle (torch's persistent id names it)."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    """Pickles as the tensor torch.save would pickle (a contiguous view of a whole storage)."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        stride = tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))
        args = (self.storage, 0, self.shape, stride, False, collections.OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            name = torch.storage._dtype_to_storage_type_map()[obj.dtype]
            return ("storage", getattr(torch, name), obj.key, "cpu", obj.numel)
        return None


def save_streamed(
    path: Path,
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    read: Callable[[str], torch.Tensor],
    progress: Callable[[Iterator], Iterator] = iter,
) -> None:
    """torch.save({name: read(name)}) with one tensor in memory at a time; `shapes` gives each
    name's (shape, dtype) in the order to write them."""
    from torch.serialization import _get_storage_alignment, _open_zipfile_writer

    storages = {
        name: _Storage(str(i), dtype, math.prod(shape))
        for i, (name, (shape, dtype)) in enumerate(shapes.items())
    }
    state = {name: _Tensor(storages[name], tuple(shape)) for name, (shape, _) in shapes.items()}
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(state)  # torch.save's default protocol
    with _open_zipfile_writer(str(path)) as zf:
        # The records torch.save writes, in its order (torch.serialization._save).
        zf.write_record("data.pkl", buf.getvalue(), len(buf.getvalue()))
        zf.write_record(".format_version", "1", 1)
        alignment = str(_get_storage_alignment())
        zf.write_record(".storage_alignment", alignment, len(alignment))
        zf.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for name in progress(list(shapes)):
            t = read(name).contiguous()
            shape, dtype = shapes[name]
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: read {list(t.shape)} {t.dtype}, expected {shape}")
            storage = (
                t.untyped_storage() if t.storage_offset() == 0 else t.clone().untyped_storage()
            )
            nbytes = t.numel() * t.element_size()
            zf.write_record(f"data/{storages[name].key}", storage, nbytes)
            del t, storage
