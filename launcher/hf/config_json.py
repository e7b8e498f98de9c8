"""config.json of a Hugging Face model <-> the run's model config fields.

Pure Python (no torch): the pre-launch check reads config.json with it. What differs between
families (their model types, their own keys, the RoPE scalings, what their model lacks) is in
each family's record (launcher/models/families.py); nothing here names a family. Both spellings of
RoPE that transformers reads are understood: `rope_parameters` (transformers 5) and `rope_theta` +
`rope_scaling` (4.x); `to_hf_config` writes the 4.x one, which both load. A family with two model
types (DeepSeek's v3 and v2) tells them apart by its router's score function.
"""

from __future__ import annotations

import json
from pathlib import Path

from launcher.models import families

# transformers' model_type -> (our family, its HFType), from the family records.
MODEL_TYPES = {t.model_type: (f.name, t) for f in families.FAMILIES.values() for t in f.hf}
FAMILIES = tuple(dict.fromkeys(family for family, _ in MODEL_TYPES.values()))
# (config.json key, model config field) shared by every family.
COMMON = (
    ("hidden_size", "dim"),
    ("num_hidden_layers", "n_layers"),
    ("num_attention_heads", "n_heads"),
    ("num_key_value_heads", "n_kv_heads"),
    ("vocab_size", "vocab_size"),
    ("rms_norm_eps", "norm_eps"),
    ("tie_word_embeddings", "tie_embeddings"),
)
# config.json keys that null stands for: no q latent, one expert group.
NULL_MEANS = {"q_lora_rank": 0, "n_group": 1, "topk_group": 1}
# Llama 3 RoPE scaling: rope_parameters / rope_scaling key -> model config field.
ROPE_LLAMA3 = (
    ("factor", "rope_scaling_factor"),
    ("low_freq_factor", "rope_low_freq_factor"),
    ("high_freq_factor", "rope_high_freq_factor"),
    ("original_max_position_embeddings", "rope_original_max_seq_len"),
)
# YaRN (DeepSeek): key -> (model config field, value when absent, as transformers reads it).
ROPE_YARN = (
    ("factor", "rope_yarn_factor", None),
    ("original_max_position_embeddings", "rope_yarn_original_max_seq_len", None),
    ("beta_fast", "rope_yarn_beta_fast", 32.0),
    ("beta_slow", "rope_yarn_beta_slow", 1.0),
    ("mscale", "rope_yarn_mscale", 0.0),
    ("mscale_all_dim", "rope_yarn_mscale_all_dim", 0.0),
)


class HFConfigError(ValueError):
    """A Hugging Face directory or config.json this launcher cannot use, with the reason."""


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise HFConfigError(f"{hf_dir} is not a directory")
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise HFConfigError(f"{path} cannot be read ({e.strerror})") from e
    except ValueError as e:
        raise HFConfigError(f"{path} is not JSON ({e})") from e
    if not isinstance(config, dict):
        raise HFConfigError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config


def family_of(hf: dict) -> str:
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        known = ", ".join(MODEL_TYPES)
        raise HFConfigError(f"model_type={model_type} is not supported (supported: {known})")
    return MODEL_TYPES[model_type][0]


def _pairs(family: str) -> tuple[tuple[str, str], ...]:
    return (*COMMON, *families.family(family).hf_config)


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
    fam = families.family(MODEL_TYPES.get(hf.get("model_type"), (families.FALLBACK,))[0])
    if kind not in ("default", *fam.rope):
        out.append(f"{key}.rope_type={kind} (default or {' or '.join(fam.rope)} only)")
    if kind == "yarn":
        if rope.get("attention_factor") is not None:
            out.append(f"{key}.attention_factor (only the one mscale and factor give)")
        if rope.get("truncate") is False:
            out.append(f"{key}.truncate=false (the truncated correction range only)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        out.append(f"{key}.partial_rotary_factor={rope['partial_rotary_factor']} (1 only)")
    if fam.hf_unsupported is not None and hf.get("model_type") in MODEL_TYPES:
        out += fam.hf_unsupported(hf)
    return out


def model_fields(hf: dict) -> dict:
    """The model config fields this config.json describes (family included)."""
    family = family_of(hf)
    fam = families.family(family)
    fields: dict = {"family": family}
    hf_type = MODEL_TYPES[hf["model_type"]][1]
    hf = {**hf_type.read_defaults, **hf}
    for hf_key, field in _pairs(family):
        if hf_key in hf:
            fields[field] = hf[hf_key] if hf[hf_key] is not None else NULL_MEANS.get(hf_key)
    # Absent in older configs, meaning their defaults: as many kv heads as heads, untied.
    fields.setdefault("n_kv_heads", fields.get("n_heads"))
    if "head_dim" not in fam.attention.fields:
        fields["head_dim"] = None  # MLA's head widths are their own fields
    elif fields.get("head_dim") is None:
        fields["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
    if hf_type.score_func is not None:  # the router tells the model types apart
        fields["score_func"] = hf_type.score_func
    fields.setdefault("tie_embeddings", False)
    if "ffn_dim" not in fields and "moe_ffn_dim" in fields:
        fields["ffn_dim"] = fields["moe_ffn_dim"]  # as the presets write it; no dense layer
    fields["max_seq_len"] = hf.get("max_position_embeddings", 2048)
    rope, _ = _rope(hf)
    fields["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "llama3":
        fields.update({field: rope[key] for key, field in ROPE_LLAMA3})
    else:
        fields["rope_scaling_factor"] = 1.0
    if "yarn" in fam.rope:
        fields.update(_yarn_fields(rope if kind == "yarn" else {}, fields["max_seq_len"]))
    return fields


def _yarn_fields(rope: dict, max_seq_len: int) -> dict:
    """Our YaRN fields from rope parameters ({} for none), with transformers' fallbacks: the
    original length defaults to max_position_embeddings, the factor to their ratio."""
    if not rope:
        return {"rope_yarn_factor": 1.0}
    old_len = rope.get("original_max_position_embeddings") or max_seq_len
    out = {"rope_yarn_factor": float(rope.get("factor") or max_seq_len / old_len)}
    out["rope_yarn_original_max_seq_len"] = old_len
    for key, field, absent in ROPE_YARN[2:]:
        out[field] = float(rope.get(key) or absent)
    return out


# Fields a model may have fewer of than the checkpoint: its multi-token-prediction depths (a
# run that trains the next token only leaves them out; their tensors are then not read).
MAY_LEAVE_OUT = ("mtp_depth",)


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
    if ours.get("head_dim") is None and "head_dim" in families.family(family).attention.fields:
        ours["head_dim"] = ours["dim"] // ours["n_heads"]
    theirs = model_fields(hf)
    for hf_key, field in _pairs(family):
        if field in MAY_LEAVE_OUT and (ours.get(field) or 0) <= (theirs.get(field) or 0):
            continue
        if theirs.get(field) != ours.get(field):
            out.append(f"{hf_key}={theirs.get(field)} but model.{field}={ours.get(field)}")
    if "score_func" in theirs and theirs["score_func"] != ours.get("score_func", "softmax"):
        out.append(
            f"model_type={hf['model_type']} (a {theirs['score_func']} router) but "
            f"model.score_func={ours.get('score_func', 'softmax')}"
        )
    rope, key = _rope(hf)
    pairs = [("rope_theta", "rope_theta")]
    scaled = theirs["rope_scaling_factor"] != 1.0 or ours.get("rope_scaling_factor", 1.0) != 1.0
    if scaled:
        pairs += ROPE_LLAMA3
    if "yarn" in families.family(family).rope and (
        _yarn_on(theirs.get("rope_yarn_factor")) or _yarn_on(ours.get("rope_yarn_factor"))
    ):
        pairs += [(hf_key, field) for hf_key, field, _ in ROPE_YARN]
    for hf_key, field in pairs:
        if float(theirs.get(field, 1.0)) != float(ours.get(field, 1.0)):
            out.append(f"{key}.{hf_key}={theirs.get(field)} but model.{field}={ours.get(field)}")
    return out


def _yarn_on(factor) -> bool:
    return factor is not None and float(factor) > 1.0


def to_hf_config(model: dict, dtype: str) -> dict:
    """The config.json transformers builds this model from (architecture, shapes, RoPE)."""
    family = model["family"]
    if family not in FAMILIES:
        raise HFConfigError(
            f"model.family={family} has no Hugging Face mapping (supported: {', '.join(FAMILIES)})"
        )
    fam = families.family(family)
    score = model.get("score_func", "softmax")
    hf_type = next((t for t in fam.hf if t.score_func == score), fam.hf[0])
    head_dim = model.get("head_dim") or model["dim"] // model["n_heads"]
    out = {"architectures": [hf_type.architecture], "model_type": hf_type.model_type}
    for hf_key, field in _pairs(family):
        out[hf_key] = head_dim if field == "head_dim" else model[field]
        if hf_key in fam.hf_null_zero and not out[hf_key]:
            out[hf_key] = None
    out.update(
        hidden_act="silu",
        max_position_embeddings=model["max_seq_len"],
        rope_theta=float(model["rope_theta"]),
        rope_scaling=None,
        torch_dtype=dtype,
    )
    out.update(hf_type.written)
    if "yarn" in fam.rope and _yarn_on(model.get("rope_yarn_factor")):
        out["rope_scaling"] = {"rope_type": "yarn"}
        for key, field, _ in ROPE_YARN:
            out["rope_scaling"][key] = model[field]
        for key in ("mscale", "mscale_all_dim"):  # 0: unset
            if not out["rope_scaling"][key]:
                del out["rope_scaling"][key]
    elif "yarn" not in fam.rope and model.get("rope_scaling_factor", 1.0) != 1.0:
        out["rope_scaling"] = {"rope_type": "llama3"}
        out["rope_scaling"].update({key: model[field] for key, field in ROPE_LLAMA3})
    problems = unsupported(out)
    if problems:
        raise HFConfigError(
            f"model.family={family} as configured has no transformers model: {'; '.join(problems)}"
        )
    return out


def preset_yaml(name: str, hf_dir: str, hf: dict, fields: dict | None = None) -> str:
    """A conf/model preset for this config.json (`fields`: its model fields, as the directory
    holds them; model_fields(hf) by default)."""
    fields = fields or model_fields(hf)
    order = ["family", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"]
    order += ["vocab_size", "max_seq_len", "rope_theta", "rope_scaling_factor"]
    order += [f for _, f in ROPE_LLAMA3[1:]]
    order += ["norm_eps", "tie_embeddings", "n_routed_experts", "top_k", "moe_ffn_dim"]
    order += [f for fam in families.FAMILIES.values() for _, f in fam.hf_config]
    order = [*dict.fromkeys(order), "score_func"]
    order += [f for _, f, _ in ROPE_YARN]
    lines = [
        f"# {(hf.get('architectures') or ['?'])[0]} from {hf_dir}/config.json",
        f"# (python -m launcher.convert model-config {hf_dir}).",
        f"name: {name}",
    ]
    unscaled = {f for _, f in ROPE_LLAMA3[1:]} if fields["rope_scaling_factor"] == 1.0 else set()
    if "yarn" in families.family(fields["family"]).rope:
        unscaled.add("rope_scaling_factor")
        if not _yarn_on(fields["rope_yarn_factor"]):
            unscaled |= {f for _, f, _ in ROPE_YARN[1:]}
    for field in order:
        if field in fields and fields[field] is not None and field not in unscaled:
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
