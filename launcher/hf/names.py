"""Where each of our parameters lives in a Hugging Face checkpoint, per family, written once.

Pure Python (no torch): the pre-launch check compares these names and shapes with the
safetensors headers of a directory before any process starts. Our q/k projections rotate
interleaved pairs (Meta's layout) while transformers' Llama rotates halves: their rows are
permuted per head (`Source.heads`, applied by launcher/hf/weights.py both ways); DeepSeek's
need none (see launcher/models/families.py, _HF_MLA). Stacked expert weights (E, ...) are E tensors
there, one per expert (`Source.names`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from launcher.hf.config_json import (
    FAMILIES as HF_FAMILIES,
)
from launcher.hf.config_json import (
    HFConfigError,
    mismatches,
    read_config,
    unsupported,
)
from launcher.models import FIELDS, families, shapes
from launcher.models.config import ModelConfig

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Source:
    names: tuple[str, ...]  # one tensor, or one per expert stacked along our dim 0
    shape: tuple[int, ...]  # of each of those tensors
    heads: int = 0  # > 0: a q/k projection of that many heads, rows in rotate-half order
    # Tensors there that hold the same values again (the token table and the head beside
    # DeepSeek-V3's prediction depths): written on export, never read.
    copies: tuple[str, ...] = ()


# Our name (under layers.{i}) -> Hugging Face name (under model.layers.{i}).
NORMS = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
DENSE_MLP = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def sources(model: dict) -> dict[str, Source]:
    """Our parameter (and persistent buffer) name -> its Source, for the whole model the
    config fields describe: its family's parameters (launcher/models/shapes.py, as the model builds
    them) under the names its record gives them there."""
    family = model["family"]
    if family not in HF_FAMILIES:
        raise HFConfigError(
            f"model.family={family} has no Hugging Face mapping ({', '.join(HF_FAMILIES)})"
        )
    fam = families.family(family)
    m = ModelConfig(**{k: v for k, v in model.items() if k in FIELDS})
    experts_from = shapes.dense_layers(m)
    tensors = fam.tensors(m)
    depths = [m.n_layers + k for k in range(m.mtp_depth if fam.hf_depth else 0)]
    out = {
        k: Source((hf,), tensors[k], copies=_copies(fam, k, depths))
        for k, hf in TOP.items()
        if k in tensors
    }
    for ours, shape in tensors.items():
        if ours.startswith("mtp."):  # a prediction depth: layer n_layers + k there
            _, k, name = ours.split(".", 2)
            i = m.n_layers + int(k)
            if not name.startswith("block."):
                out[ours] = Source((f"model.layers.{i}.{fam.hf_depth[name]}",), shape)
                continue
            name = name.removeprefix("block.")
        elif ours.startswith("layers."):
            _, i, name = ours.split(".", 2)
        else:
            continue
        routed = int(i) >= experts_from
        hf = {**NORMS, **fam.hf_attention, **(fam.hf_moe if routed else DENSE_MLP)}[name]
        hf = f"model.layers.{i}.{hf}"
        if "{e}" in hf:  # stacked experts: one tensor per expert there
            names, shape = tuple(hf.format(e=x) for x in range(m.n_routed_experts)), shape[1:]
        else:
            names = (hf,)
        heads = fam.hf_rotate_half.get(name, 0)
        heads = heads if isinstance(heads, int) else getattr(m, heads)
        out[ours] = Source(names, shape, heads)
        if routed and name == "feed_forward.router.gate.weight" and m.score_func == "sigmoid":
            # DeepSeek-V3's correction bias, a persistent buffer
            bias = "feed_forward.router.expert_bias"
            hf = f"model.layers.{i}.{fam.hf_moe[bias]}"
            out[ours.replace("router.gate.weight", "router.expert_bias")] = Source(
                (hf,), (m.n_routed_experts,)
            )
    return out


def held_depths(hf_dir: str | Path, fields: dict) -> dict:
    """`fields` with model.mtp_depth cut to the prediction depths the directory holds tensors
    of: transformers writes num_nextn_predict_layers=1 into every DeepSeek-V3 config.json it
    saves, whether the checkpoint has that layer or not (its model has none)."""
    fam = families.family(fields["family"])
    if not fields.get("mtp_depth") or not fam.hf_depth:
        return fields
    headers = read_headers(hf_dir)
    probe = next(iter(fam.hf_depth.values()))
    held = 0
    while held < fields["mtp_depth"] and (
        f"model.layers.{fields['n_layers'] + held}.{probe}" in headers
    ):
        held += 1
    return {**fields, "mtp_depth": held}


def _copies(fam: families.Family, name: str, depths: list[int]) -> tuple[str, ...]:
    """The tensors there that repeat our parameter `name` beside each prediction depth."""
    copy = fam.hf_depth_copies.get(name)
    return tuple(f"model.layers.{i}.{copy}" for i in depths) if copy else ()


def read_headers(hf_dir: str | Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """name -> (file, shape, dtype) of every tensor in the directory's *.safetensors files,
    from their JSON headers (8-byte length, then the header; no tensor data read)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX
    if index.is_file():  # the files it names, as transformers reads them
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = set(weight_map.values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise HFConfigError(f"{index} is not a safetensors index ({e})") from e
        # File names only: an index never sends a read outside its directory.
        outside = sorted(repr(f) for f in names if not plain_file_name(f))
        if outside:
            raise HFConfigError(f"{index} names files outside {hf_dir}: {', '.join(outside)}")
        files = sorted(hf_dir / f for f in names)
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise HFConfigError(f"{hf_dir} holds no *.safetensors files")
    out: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > path.stat().st_size - 8:
                    raise ValueError(
                        f"a header of {n:,} bytes in a file of {path.stat().st_size:,}"
                    )
                header = json.loads(f.read(n))
            tensors = {
                name: (path, tuple(int(d) for d in info["shape"]), str(info["dtype"]))
                for name, info in header.items()
                if name != "__metadata__"
            }
        except (OSError, ValueError, TypeError, KeyError, AttributeError, struct.error) as e:
            raise HFConfigError(f"{path} is not a readable safetensors file ({e})") from e
        for name, entry in tensors.items():
            if name in out:
                raise HFConfigError(f"{name} is in both {out[name][0].name} and {path.name}")
            out[name] = entry
    return out


def plain_file_name(name) -> bool:
    """A name of a file directly inside a directory: no separator, not . or .."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name


def check(hf_dir: str | Path, model: dict) -> list[str]:
    """Why the run's model cannot start from this Hugging Face directory: an unusable
    directory or config.json, unsupported features, fields that differ from the model config,
    tensors missing or of another shape. Empty when it can."""
    try:
        hf = read_config(hf_dir)
        problems = [f"{hf_dir}/config.json has {u}" for u in unsupported(hf)]
        wrong = mismatches(hf, model)
        if wrong:
            problems.append(f"{hf_dir}/config.json describes another model: " + "; ".join(wrong))
        if problems:
            return problems
        headers = read_headers(hf_dir)
    except HFConfigError as e:
        return [str(e)]
    missing, shapes = [], []
    for source in sources(model).values():
        for name in source.names:
            if name not in headers:
                missing.append(name)
            elif headers[name][1] != source.shape:
                shapes.append(f"{name} {list(headers[name][1])}, expected {list(source.shape)}")
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        problems.append(f"{hf_dir} lacks tensors: {', '.join(missing[:5])}{more}")
    if shapes:
        problems.append(f"{hf_dir} has tensors of other shapes: {'; '.join(shapes[:5])}")
    return problems
