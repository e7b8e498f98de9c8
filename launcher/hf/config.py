"""config.json of a Hugging Face model <-> the run's model config fields, per family.

Pure Python (no torch): the pre-launch check reads config.json with it. Both spellings of
RoPE that transformers reads are understood: `rope_parameters` (transformers 5) and
`rope_theta` + `rope_scaling` (4.x); `to_hf_config` writes the 4.x one, which both load.
"""

from __future__ import annotations

import json
from pathlib import Path

# Our family -> (model_type, architecture) in transformers.
FAMILIES = {"llama": ("llama", "LlamaForCausalLM"), "mixtral": ("mixtral", "MixtralForCausalLM")}
# (config.json key, model config field) shared by every family.
COMMON = (
    ("hidden_size", "dim"),
    ("num_hidden_layers", "n_layers"),
    ("num_attention_heads", "n_heads"),
    ("num_key_value_heads", "n_kv_heads"),
    ("head_dim", "head_dim"),
    ("vocab_size", "vocab_size"),
    ("rms_norm_eps", "norm_eps"),
    ("tie_word_embeddings", "tie_embeddings"),
)
PER_FAMILY = {
    "llama": (("intermediate_size", "ffn_dim"),),
    "mixtral": (
        ("intermediate_size", "moe_ffn_dim"),
        ("num_local_experts", "n_routed_experts"),
        ("num_experts_per_tok", "top_k"),
    ),
}
# Llama 3 RoPE scaling: rope_parameters / rope_scaling key -> model config field.
ROPE_LLAMA3 = (
    ("factor", "rope_scaling_factor"),
    ("low_freq_factor", "rope_low_freq_factor"),
    ("high_freq_factor", "rope_high_freq_factor"),
    ("original_max_position_embeddings", "rope_original_max_seq_len"),
)


class HFConfigError(ValueError):
    """A Hugging Face directory or config.json this launcher cannot use, with the reason."""


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise HFConfigError(f"{hf_dir} is not a directory")
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise HFConfigError(f"{path} cannot be read ({e.strerror})") from e
    except ValueError as e:
        raise HFConfigError(f"{path} is not JSON ({e})") from e


def family_of(hf: dict) -> str:
    model_type = hf.get("model_type")
    for family, (mtype, _) in FAMILIES.items():
        if model_type == mtype:
            return family
    known = ", ".join(m for m, _ in FAMILIES.values())
    raise HFConfigError(f"model_type={model_type} is not supported (supported: {known})")


def _rope(hf: dict) -> tuple[dict, str]:
    """(RoPE parameters, the key they came from) in either spelling."""
    if isinstance(hf.get("rope_parameters"), dict):
        return hf["rope_parameters"], "rope_parameters"
    params = dict(hf.get("rope_scaling") or {})
    if "rope_theta" in hf:
        params.setdefault("rope_theta", hf["rope_theta"])
    return params, "rope_scaling"


def unsupported(hf: dict) -> list[str]:
    """Features of this config.json that the family's model does not have."""
    out = []
    if hf.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act={hf['hidden_act']} (only silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            out.append(f"{key}=true (no biases)")
    if hf.get("sliding_window") is not None:
        out.append(f"sliding_window={hf['sliding_window']} (full causal attention only)")
    rope, key = _rope(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        out.append(f"{key}.rope_type={kind} (default or llama3 only)")
    return out


def model_fields(hf: dict) -> dict:
    """The model config fields this config.json describes (family included)."""
    family = family_of(hf)
    fields: dict = {"family": family}
    for hf_key, field in (*COMMON, *PER_FAMILY[family]):
        if hf_key in hf:
            fields[field] = hf[hf_key]
    # Absent in older configs, meaning their defaults: as many kv heads as heads, untied.
    fields.setdefault("n_kv_heads", fields.get("n_heads"))
    if fields.get("head_dim") is None:
        fields["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
    fields.setdefault("tie_embeddings", False)
    if family == "mixtral":
        fields["ffn_dim"] = fields["moe_ffn_dim"]  # as the presets write it; no dense layer
    fields["max_seq_len"] = hf.get("max_position_embeddings", 2048)
    rope, _ = _rope(hf)
    fields["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    if rope.get("rope_type", rope.get("type")) == "llama3":
        fields.update({field: rope[key] for key, field in ROPE_LLAMA3})
    else:
        fields["rope_scaling_factor"] = 1.0
    return fields


def mismatches(hf: dict, model: dict) -> list[str]:
    """`num_key_value_heads=8 but model.n_kv_heads=4` for every field that differs.

    max_position_embeddings is not compared: it only bounds the positions a run may use
    (train.seq_len is checked against model.max_seq_len), the weights do not depend on it.
    """
    family = family_of(hf)
    out = []
    if model.get("family") != family:
        return [f"model_type={hf.get('model_type')} but model.family={model.get('family')}"]
    ours = dict(model)
    if ours.get("head_dim") is None:
        ours["head_dim"] = ours["dim"] // ours["n_heads"]
    theirs = model_fields(hf)
    for hf_key, field in (*COMMON, *PER_FAMILY[family]):
        if theirs.get(field) != ours.get(field):
            out.append(f"{hf_key}={theirs.get(field)} but model.{field}={ours.get(field)}")
    rope, key = _rope(hf)
    pairs = [("rope_theta", "rope_theta")]
    scaled = theirs["rope_scaling_factor"] != 1.0 or ours.get("rope_scaling_factor", 1.0) != 1.0
    if scaled:
        pairs += ROPE_LLAMA3
    for hf_key, field in pairs:
        if float(theirs.get(field, 1.0)) != float(ours.get(field, 1.0)):
            out.append(f"{key}.{hf_key}={theirs.get(field)} but model.{field}={ours.get(field)}")
    return out


def to_hf_config(model: dict, dtype: str) -> dict:
    """The config.json transformers builds this model from (architecture, shapes, RoPE)."""
    family = model["family"]
    if family not in FAMILIES:
        raise HFConfigError(
            f"model.family={family} has no Hugging Face mapping (supported: {', '.join(FAMILIES)})"
        )
    model_type, arch = FAMILIES[family]
    head_dim = model.get("head_dim") or model["dim"] // model["n_heads"]
    out = {"architectures": [arch], "model_type": model_type}
    for hf_key, field in (*COMMON, *PER_FAMILY[family]):
        out[hf_key] = head_dim if field == "head_dim" else model[field]
    out.update(
        hidden_act="silu",
        max_position_embeddings=model["max_seq_len"],
        rope_theta=float(model["rope_theta"]),
        rope_scaling=None,
        torch_dtype=dtype,
    )
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if family == "mixtral":
        out.update(sliding_window=None, output_router_logits=False)
    if model.get("rope_scaling_factor", 1.0) != 1.0:
        out["rope_scaling"] = {"rope_type": "llama3"}
        out["rope_scaling"].update({key: model[field] for key, field in ROPE_LLAMA3})
    return out


def preset_yaml(name: str, hf_dir: str, hf: dict) -> str:
    """A conf/model preset for this config.json."""
    fields = model_fields(hf)
    order = ["family", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"]
    order += ["vocab_size", "max_seq_len", "rope_theta", "rope_scaling_factor"]
    order += [f for _, f in ROPE_LLAMA3[1:]]
    order += ["norm_eps", "tie_embeddings", "n_routed_experts", "top_k", "moe_ffn_dim"]
    lines = [
        f"# {hf.get('architectures', ['?'])[0]} from {hf_dir}/config.json",
        f"# (python -m launcher.convert model-config {hf_dir}).",
        f"name: {name}",
    ]
    unscaled = {f for _, f in ROPE_LLAMA3[1:]} if fields["rope_scaling_factor"] == 1.0 else set()
    for field in order:
        if field in fields and field not in unscaled:
            lines.append(f"{field}: {_yaml(fields[field])}")
    return "\n".join(lines) + "\n"


def _yaml(value) -> str:
    """A scalar as YAML 1.1 reads it back (1e-05 would be a string there: 1.0e-05)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value
    text = repr(value)
    if isinstance(value, float) and "e" in text and "." not in text:
        text = text.replace("e", ".0e")
    return text
