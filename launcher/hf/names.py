"""Where each of our parameters lives in a Hugging Face checkpoint, per family, written once.

Pure Python (no torch): the pre-launch check compares these names and shapes with the
safetensors headers of a directory before any process starts. Our q/k projections rotate
interleaved pairs (Meta's layout) while transformers' Llama rotates halves: their rows are
permuted per head (`Source.heads`, applied by launcher/hf/weights.py both ways). Stacked expert
weights (E, ...) are E tensors there, one per expert (`Source.names`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from launcher.hf.config import HFConfigError, mismatches, read_config, unsupported

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Source:
    names: tuple[str, ...]  # one tensor, or one per expert stacked along our dim 0
    shape: tuple[int, ...]  # of each of those tensors
    heads: int = 0  # > 0: a q/k projection of that many heads, rows in rotate-half order


# Our name (under layers.{i}) -> Hugging Face name (under model.layers.{i}).
ATTENTION = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
DENSE_MLP = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
MIXTRAL_MOE = {
    "feed_forward.router.weight": "block_sparse_moe.gate.weight",
    "feed_forward.w1": "block_sparse_moe.experts.{e}.w1.weight",
    "feed_forward.w2": "block_sparse_moe.experts.{e}.w2.weight",
    "feed_forward.w3": "block_sparse_moe.experts.{e}.w3.weight",
}
TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def sources(model: dict) -> dict[str, Source]:
    """Our parameter name -> its Source, for the whole model the config fields describe."""
    family = model["family"]
    d, v, n_layers = model["dim"], model["vocab_size"], model["n_layers"]
    h, k = model["n_heads"], model["n_kv_heads"]
    e = model.get("head_dim") or d // h
    shapes = {
        "attention_norm.weight": (d,),
        "ffn_norm.weight": (d,),
        "attention.wq.weight": (h * e, d),
        "attention.wk.weight": (k * e, d),
        "attention.wv.weight": (k * e, d),
        "attention.wo.weight": (d, h * e),
    }
    heads = {"attention.wq.weight": h, "attention.wk.weight": k}
    per_layer = dict(ATTENTION)
    if family == "llama":
        f = model["ffn_dim"]
        per_layer.update(DENSE_MLP)
        shapes.update({"feed_forward.w1.weight": (f, d), "feed_forward.w2.weight": (d, f)})
        shapes["feed_forward.w3.weight"] = (f, d)
    elif family == "mixtral":
        f = model["moe_ffn_dim"]
        per_layer.update(MIXTRAL_MOE)
        shapes.update({"feed_forward.w1": (f, d), "feed_forward.w2": (d, f)})
        shapes.update(
            {
                "feed_forward.w3": (f, d),
                "feed_forward.router.weight": (model["n_routed_experts"], d),
            }
        )
    else:
        raise HFConfigError(f"model.family={family} has no Hugging Face mapping (llama, mixtral)")

    out = {
        ours: Source((hf,), (v, d) if "embed" in hf or "lm_head" in hf else (d,))
        for ours, hf in TOP.items()
    }
    if model.get("tie_embeddings"):
        del out["output.weight"]  # the embedding is the output projection: no lm_head
    for i in range(n_layers):
        for ours, hf in per_layer.items():
            name = f"model.layers.{i}.{hf}"
            if "{e}" in name:
                names = tuple(name.format(e=x) for x in range(model["n_routed_experts"]))
            else:
                names = (name,)
            out[f"layers.{i}.{ours}"] = Source(names, shapes[ours], heads.get(ours, 0))
    return out


def read_headers(hf_dir: str | Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """name -> (file, shape, dtype) of every tensor in the directory's *.safetensors files,
    from their JSON headers (8-byte length, then the header; no tensor data read)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX
    if index.is_file():  # the files it names, as transformers reads them
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise HFConfigError(f"{index} is not a safetensors index ({e})") from e
        files = sorted({hf_dir / f for f in weight_map.values()})
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise HFConfigError(f"{hf_dir} holds no *.safetensors files")
    out: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise HFConfigError(f"{path} is not a readable safetensors file ({e})") from e
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in out:
                raise HFConfigError(f"{name} is in both {out[name][0].name} and {path.name}")
            out[name] = (path, tuple(info["shape"]), info["dtype"])
    return out


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
