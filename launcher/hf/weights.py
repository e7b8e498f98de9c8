"""Hugging Face safetensors <-> our parameters: sharded loading, full conversion, writing.

Loading into a parallelized model reads, on each rank, only the slices of each tensor that the
rank holds (safetensors files are memory-mapped and sliced): a rank's FSDP or TP shard of a
parameter is one box of the full tensor, found from its DTensor placements. A q/k shard whose
rows start or end inside a head reads that head whole, to permute its rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from launcher.hf.names import INDEX, Source, read_headers, sources
from launcher.parallel.materialize import Box, canonical_name, local_box


def to_rotate_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows of each head from interleaved pairs (ours) to halves (transformers'):
    row 2i + j of a head goes to row j * E/2 + i."""
    return w.unflatten(0, (heads, -1, 2)).transpose(1, 2).flatten(0, 2)


def to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of to_rotate_half."""
    return w.unflatten(0, (heads, 2, -1)).transpose(1, 2).flatten(0, 2)


class Reader:
    """Slices of the tensors in a directory's safetensors files; counts the elements read."""

    def __init__(self, hf_dir: str | Path):
        self.files = {name: path for name, (path, _, _) in read_headers(hf_dir).items()}
        self.handles: dict[Path, object] = {}
        self.elements = 0

    def slice(self, name: str, box: Box) -> torch.Tensor:
        path = self.files[name]
        if path not in self.handles:
            self.handles[path] = safe_open(str(path), framework="pt")
        out = self.handles[path].get_slice(name)[box]
        self.elements += out.numel()
        return out

    def read(self, source: Source, box: Box) -> torch.Tensor:
        """The box of our parameter (global coordinates of our layout) described by source."""
        if len(source.names) > 1:  # experts stacked along our dim 0
            return torch.stack([self.slice(source.names[x], box[1:]) for x in _range(box[0])])
        if not source.heads:
            return self.slice(source.names[0], box)
        rows = box[0]
        e = source.shape[0] // source.heads
        lo, hi = rows.start // e * e, -(-rows.stop // e) * e  # whole heads around the rows
        block = self.slice(source.names[0], (slice(lo, hi), *box[1:]))
        return to_interleaved(block, (hi - lo) // e)[rows.start - lo : rows.stop - lo]


def _range(s: slice) -> range:
    return range(s.start, s.stop)


@torch.no_grad()
def load_into(parts: list[nn.Module], hf_dir: str | Path, model: dict) -> int:
    """Fill every parameter (and persistent buffer) of the model parts (whole, FSDP or TP
    shards, pipeline stages) from the directory; returns the number of elements this rank
    read."""
    table, reader = sources(model), Reader(hf_dir)
    if model.get("tie_embeddings"):
        # A pipeline's last stage holds its own copy of the tied matrix as its output.
        table = {**table, "output.weight": table["tok_embeddings.weight"]}
    for part in parts:
        # Parameters (a tied weight is listed once), and the buffers the table names
        # (DeepSeek-V3's expert bias); other buffers (RoPE tables, load counts) are derived.
        buffers = [(n, b) for n, b in part.named_buffers() if canonical_name(n) in table]
        for name, p in [*part.named_parameters(), *buffers]:
            name = canonical_name(name)
            if name not in table:
                raise KeyError(f"parameter {name} has no Hugging Face source")
            local = p.to_local() if isinstance(p, DTensor) else p
            box = local_box(p)
            if any(s.stop <= s.start for s in box):
                continue  # an empty shard (more ranks than rows)
            value = reader.read(table[name], box)
            if value.shape != local.shape:
                raise ValueError(f"{name}: read {list(value.shape)}, holds {list(local.shape)}")
            local.copy_(value)
    return reader.elements


def from_hf(hf_dir: str | Path, model: dict) -> dict[str, torch.Tensor]:
    """Our full state dict (whole tensors, the files' dtype) from a Hugging Face directory."""
    reader = Reader(hf_dir)
    out = {}
    for name, source in sources(model).items():
        shape = (len(source.names), *source.shape) if len(source.names) > 1 else source.shape
        out[name] = reader.read(source, tuple(slice(0, n) for n in shape))
    if model.get("tie_embeddings"):  # the model's state dict names the shared weight twice
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def to_hf(t: torch.Tensor, source: Source) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of one of our parameters (full tensor t)."""
    if len(source.names) > 1:
        yield from zip(source.names, t.unbind(0), strict=True)
    elif source.heads:
        yield source.names[0], to_rotate_half(t, source.heads)
    else:
        yield source.names[0], t
    for copy in source.copies:  # the same values again (names.Source)
        yield copy, t


def shard_plan(table: dict[str, Source], itemsize: int, max_shard_bytes: int) -> list[list[str]]:
    """Our parameter names grouped into files of at most max_shard_bytes (a parameter is never
    split: one larger than the limit gets a file of its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, source in table.items():
        n = (len(source.names) + len(source.copies)) * itemsize
        for dim in source.shape:
            n *= dim
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def write_shard(
    out_dir: Path, index: int, total: int, tensors: dict[str, torch.Tensor], weight_map: dict
) -> Path:
    """model-0000i-of-0000N.safetensors; records its names in weight_map."""
    file = f"model-{index:05d}-of-{total:05d}.safetensors"
    # Own, contiguous storage per tensor: safetensors refuses views that share memory.
    own = {k: v.contiguous().clone() for k, v in tensors.items()}
    save_file(own, str(out_dir / file), metadata={"format": "pt"})
    weight_map.update({name: file for name in tensors})
    return out_dir / file


def write_index(out_dir: Path, weight_map: dict, total_bytes: int) -> None:
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
